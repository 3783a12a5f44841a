"""What delayd's benchmarks (``delayd bench``, tools/) share: one JSON object per figure
on stdout, and how fast this host runs Python at the moment.

The development machine is a 2-vCPU VM on a shared host whose speed moves: the same
code measured 12 µs of server CPU per intake message one day and 27 µs another. So every
benchmark prints ``host_reference_loop`` first — the best of five runs of
``sum(range(1_000_000))`` in this interpreter, in ms (lower is faster; 18 to 21 ms on the
slow days, 9 to 10 ms is a typical modern core) — and figures taken on different days can
be compared through it.
"""

from __future__ import annotations

import json
import timeit
from collections.abc import Callable

Emit = Callable[..., None]
"""``emit(metric, value, unit, **extra)``: print one figure."""


def emitter(bench: str) -> Emit:
    """The ``emit`` of benchmark ``bench``: one JSON line per figure,
    ``{"bench", "metric", "value", "unit", …extra}``, value rounded to 3 places."""

    def emit(metric: str, value: float, unit: str, **extra: object) -> None:
        row = {"bench": bench, "metric": metric, "value": round(value, 3), "unit": unit}
        print(json.dumps({**row, **extra}), flush=True)

    return emit


def reference_loop_ms() -> float:
    """Best of five timings of ``sum(range(1_000_000))``, in ms."""
    return min(timeit.repeat("sum(range(1_000_000))", number=5, repeat=5)) / 5 * 1000


def emit_host_speed(emit: Emit) -> None:
    """Print ``host_reference_loop`` (see the module docstring)."""
    emit(
        "host_reference_loop",
        reference_loop_ms(),
        "ms",
        what="best of 5: sum(range(1_000_000)) in this Python; lower is faster",
    )
