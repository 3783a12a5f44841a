"""The benchmarks' shared helpers, for the scripts in tools/: they live in
delayd/bench/common.py (``delayd bench`` uses them too)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout the scripts run from
sys.path.insert(0, str(ROOT))

from delayd.bench.common import Emit, emit_host_speed, emitter, reference_loop_ms  # noqa: E402

__all__ = [
    "ROOT",
    "Emit",
    "bench_parser",
    "emit_host_speed",
    "emitter",
    "reference_loop_ms",
    "stop_process",
]


def bench_parser(doc: str, quick: str) -> argparse.ArgumentParser:
    """A benchmark script's parser: the first paragraph of its docstring ``doc`` as the
    description, and ``--quick``, whose smaller runs ``quick`` describes."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    return parser


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """Ask ``proc`` to stop (SIGTERM); kill it when it is still running ``timeout_s``
    seconds later."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
