"""The benchmarks' shared helpers, for the scripts in tools/: they live in
delayd/bench/common.py (``delayd bench`` uses them too)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from delayd.bench.common import Emit, emit_host_speed, emitter, reference_loop_ms

__all__ = ["Emit", "emit_host_speed", "emitter", "reference_loop_ms"]
