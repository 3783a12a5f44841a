"""Wheel benchmark: bytes per loaded entry, add and expire throughput, expire pauses.

Prints one JSON object per figure on stdout:
    {"bench": "wheel", "metric": ..., "value": ..., "unit": ...}

    python tools/bench_wheel_memory.py            # 10,000,000 entries (about 3 minutes)
    python tools/bench_wheel_memory.py --quick    # 1,000,000 entries (under a minute)

Cases, all with the default geometry (1 ms tick, 1024 slots: 1.024 s rounds):

* window: N entries due over a 2 h load window, in a scrambled order (as buckets are
  loaded: in message_log order, not due order). Bytes per entry three ways — the RSS
  growth of the process, tracemalloc's count of Python allocations (a second load, the
  same entries), and the wheel's own ``statistics().bytes_estimate``; adds per second;
  then a ticker-style drain (``expire`` at each ``next_due_ms``), whose rate includes
  cascading every overflow round into the wheel, and how long single ``expire`` calls
  take (p99.9 and max wall time; the CPU time of the slowest call that cascaded a
  round). The cyclic GC is off while a drain is timed, so that the figures are the
  wheel's and not a full collection of whatever else the process holds.
* round: N entries due within one round (all in wheel slots, ~N/1024 per slot):
  tracemalloc bytes per entry.
* burst: N/20 entries (500,000 for the full run) due within the same second, released
  ms by ms: the time to release them all, and expire's p99.9 and max.
* cascade: the CPU time per entry of moving one overflow round into the wheel, which
  is what a round boundary costs (docs/wheel.md, "Costs").
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time
import tracemalloc
from array import array
from pathlib import Path

import bench_common

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from delayd.wheel import TimingWheel  # noqa: E402

T0 = 1_795_341_600_000  # 2026-11-22T10:00:00Z, epoch ms
WINDOW_MS = 2 * 3_600_000
BUCKETS = 120  # distinct bucket ids, as a 2 h window of 1-minute buckets


emit = bench_common.emitter("wheel")


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def scrambled_dues(count: int, spread_ms: int) -> array:
    """``count`` due times spread evenly over ``spread_ms`` from T0, in the order of a
    multiplicative permutation (deterministic, and far from sorted)."""
    step = 1_000_003  # a prime: coprime with count unless count is a multiple of it
    while math.gcd(step, count) != 1:
        step += 2
    return array("q", (T0 + (k * step % count) * spread_ms // count for k in range(count)))


def load(wheel: TimingWheel, dues: array) -> float:
    """Add every due (bucket = index % BUCKETS, offset = index * 100); returns seconds."""
    add = wheel.add
    started = time.perf_counter()
    for index, due in enumerate(dues):
        add(due, index % BUCKETS, index * 100)
    return time.perf_counter() - started


def traced_bytes_per_entry(dues: array) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        wheel = TimingWheel(T0)
        load(wheel, dues)
        return (tracemalloc.get_traced_memory()[0] - before) / len(dues)
    finally:
        tracemalloc.stop()


class Pauses:
    """Durations of single expire calls: wall time (perf_counter) for all of them, and
    CPU time (thread_time, ten times dearer to read) for the calls that enter a new
    round and so cascade it — wall time on a shared machine includes being descheduled."""

    def __init__(self, span_ms: int) -> None:
        self.span_ms = span_ms
        self.wall = array("d")
        self.cascade_cpu = array("d")
        self.round = None

    def expire(self, wheel: TimingWheel, now_ms: int) -> int:
        round_ = now_ms // self.span_ms
        if round_ != self.round:
            self.round = round_
            before_cpu, before = time.thread_time(), time.perf_counter()
            released = len(wheel.expire(now_ms))
            self.wall.append(time.perf_counter() - before)
            self.cascade_cpu.append(time.thread_time() - before_cpu)
            return released
        before = time.perf_counter()
        released = len(wheel.expire(now_ms))
        self.wall.append(time.perf_counter() - before)
        return released

    def emit(self, **extra: object) -> None:
        wall = sorted(self.wall)
        p999 = wall[min(len(wall) - 1, int(len(wall) * 0.999))]
        emit("expire_pause_p99.9", p999 * 1000, "ms", clock="wall", **extra)
        emit("expire_pause_max", wall[-1] * 1000, "ms", clock="wall", **extra)
        cascades = sorted(self.cascade_cpu)
        p50 = cascades[len(cascades) // 2]
        p99 = cascades[min(len(cascades) - 1, int(len(cascades) * 0.99))]
        emit("cascade_pause_p50", p50 * 1000, "ms", clock="cpu", rounds=len(cascades), **extra)
        emit("cascade_pause_p99", p99 * 1000, "ms", clock="cpu", **extra)
        emit("cascade_pause_max", cascades[-1] * 1000, "ms", clock="cpu", **extra)


def drain_at_each_due(wheel: TimingWheel) -> tuple[int, float, Pauses]:
    """What the ticker does, without sleeping: expire at each next_due_ms.
    Returns (entries released, seconds, the pauses)."""
    released = 0
    pauses = Pauses(wheel.span_ms)
    gc.disable()  # time the wheel, not a full collection of the whole process
    try:
        started = time.perf_counter()
        while (next_ms := wheel.next_due_ms()) is not None:
            released += pauses.expire(wheel, next_ms)
        return released, time.perf_counter() - started, pauses
    finally:
        gc.enable()


def bench_window(count: int) -> None:
    dues = scrambled_dues(count, WINDOW_MS)
    gc.collect()
    rss_before = rss_bytes()
    wheel = TimingWheel(T0)
    seconds = load(wheel, dues)
    rss_after = rss_bytes()
    stats = wheel.statistics()
    emit("add_rate", count / seconds, "entries/s", case="window", entries=count)
    emit("bytes_per_entry_rss", (rss_after - rss_before) / count, "B", case="window")
    emit("bytes_per_entry_estimate", stats.bytes_estimate / count, "B", case="window")
    emit(
        "wheel_layout",
        stats.overflow_rounds,
        "overflow rounds",
        slots_in_use=stats.slots_in_use,
        wheel_entries=stats.wheel_entries,
        overflow_entries=stats.overflow_entries,
    )
    released, seconds, pauses = drain_at_each_due(wheel)
    assert released == count and len(wheel) == 0
    calls = len(pauses.wall)
    emit("expire_rate", released / seconds, "entries/s", case="window", expire_calls=calls)
    pauses.emit(case="window")
    del wheel
    emit("bytes_per_entry_traced", traced_bytes_per_entry(dues), "B", case="window")


def bench_round(count: int) -> None:
    dues = scrambled_dues(count, TimingWheel(T0).span_ms)
    emit("bytes_per_entry_traced", traced_bytes_per_entry(dues), "B", case="round")


def bench_burst(count: int) -> None:
    wheel = TimingWheel(T0)
    load(wheel, scrambled_dues(count, 1_000))
    wheel.expire(T0 - 1)
    pauses = Pauses(wheel.span_ms)
    released = 0
    gc.disable()
    try:
        started = time.perf_counter()
        for now_ms in range(T0, T0 + 1_000):
            released += pauses.expire(wheel, now_ms)
        seconds = time.perf_counter() - started
    finally:
        gc.enable()
    assert released == count
    emit("burst_release_time", seconds * 1000, "ms", case="burst", entries=count)
    pauses.emit(case="burst", entries=count)


def bench_cascade(count: int) -> None:
    """CPU time per entry to cascade one overflow round of ``count`` entries."""
    wheel = TimingWheel(T0)
    span = wheel.span_ms
    next_round = (T0 // span + 1) * span
    load(wheel, array("q", (next_round + span // 2 + k % (span // 2) for k in range(count))))
    before = time.thread_time()
    assert len(wheel.expire(next_round)) == 0  # enters the round: cascades, releases none
    seconds = time.thread_time() - before
    emit("cascade_cost", seconds / count * 1e9, "ns/entry", clock="cpu", entries=count)


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "1,000,000 entries")
    parser.add_argument("--entries", type=int, help="entries (default 10,000,000)")
    args = parser.parse_args()
    bench_common.emit_host_speed(emit)
    count = args.entries or (1_000_000 if args.quick else 10_000_000)
    bench_window(count)
    bench_round(count)
    bench_burst(max(1, count // 20))
    bench_cascade(200_000)


if __name__ == "__main__":
    main()
