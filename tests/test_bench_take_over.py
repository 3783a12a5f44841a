"""tools/bench_take_over.py as docs/benchmarks.md runs it, on a small log: every figure
printed, and the indexed read finds the very tombstones the full read finds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_indexed_read_finds_what_the_full_read_finds() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "tools/bench_take_over.py", "--records", "20000", "--rounds", "1"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    figures = [json.loads(line) for line in done.stdout.splitlines()]
    assert figures[0]["metric"] == "host_reference_loop"
    reads = {f["way"]: f for f in figures if f["metric"] == "read_s"}
    assert set(reads) == {"loop", "thread", "indexed"}
    assert reads["indexed"]["tombstones"] == reads["thread"]["tombstones"] == 200
    (index,) = [f for f in figures if f["metric"] == "index_bytes"]
    assert index["value"] == 200 * 8
    (scan,) = [f for f in figures if f["metric"] == "scan_at_start_s"]
    assert 0 < scan["scanned_bytes"] < scan["log_bytes"]  # half below the checkpoint
