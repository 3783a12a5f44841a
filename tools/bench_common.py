"""The benchmarks' shared helpers, for the scripts in tools/: they live in
delayd/bench/common.py (``delayd bench`` uses them too)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from delayd.bench.common import Emit, emit_host_speed, emitter, reference_loop_ms

__all__ = ["Emit", "bench_parser", "emit_host_speed", "emitter", "reference_loop_ms"]


def bench_parser(doc: str, quick: str) -> argparse.ArgumentParser:
    """A benchmark script's parser: the first paragraph of its docstring ``doc`` as the
    description, and ``--quick``, whose smaller runs ``quick`` describes."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=quick)
    return parser
