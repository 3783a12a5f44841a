"""Promotion benchmark: how long reading message_log back at a take-over stalls the
event loop.

A member that followed a leader decides every tombstone of message_log again when it
takes over (``Canceller.take_over``, docs/replication.md), and to find them it reads the
whole log back. This writes a message_log of N records (one in 100 a CANCEL tombstone,
the rest 150-byte messages), then reads the tombstones back two ways on a trio event
loop while a heartbeat task ticks every millisecond:

- ``loop``: ``SegmentedLog.iter_from`` on the event loop, as take_over read it before;
- ``thread``: ``read_tombstones`` in a worker thread, as it reads now.

For each: the wall time of the read and the longest the heartbeat waited (the longest
any other task — intake's handlers, /metrics, the lease's renewals — could have waited).
The decisions that follow are the same in both (one per tombstone, yielding every 1,000).

Prints one JSON object per figure on stdout (after ``host_reference_loop``).
``--quick``: 100,000 records.
"""

from __future__ import annotations

import random
import tempfile
import time

import bench_common  # puts this checkout first on sys.path
import trio

from delayd.logs import layout, message_log, tombstone
from delayd.logs.message_log import MessageRecord
from delayd.replay.tombstone_index import read_tombstones
from storage.fs import REAL_FS
from storage.segmented_log import SegmentedLog

T = 1_795_341_600_000
BATCH = 1000


def fill(data_dir: str, records: int) -> SegmentedLog:
    log = SegmentedLog.open(layout.message_log_dir(data_dir))
    rng = random.Random(1)
    body = rng.randbytes(100)
    for first in range(0, records, BATCH):
        messages, stones = [], []
        for n in range(first, min(first + BATCH, records)):
            if n % 100 == 99:
                stones.append(tombstone.encode(tombstone.Tombstone(f"m-{n - 1}", T, None, True)))
            else:
                record = MessageRecord(T + 3_600_000, n + 1, T, f"m-{n}", "orders", body=body)
                messages.append(message_log.encode_record(record))
        log.append_batch(messages, message_log.TYPE_MESSAGE)
        if stones:
            log.append_batch(stones, message_log.TYPE_CANCEL)
    log.flush()
    return log


async def measure(way: str, data_dir: str, log: SegmentedLog) -> tuple[float, float, int]:
    longest_gap = 0.0
    end = log.end_offset

    async def heartbeat() -> None:
        nonlocal longest_gap
        last = time.perf_counter()
        while True:
            await trio.sleep(0.001)
            now = time.perf_counter()
            longest_gap = max(longest_gap, now - last)
            last = now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(heartbeat)
        await trio.sleep(0.05)
        longest_gap = 0.0
        started = time.perf_counter()
        if way == "loop":
            found = [
                r for r in log.iter_from(log.min_offset, end) if r.type != message_log.TYPE_MESSAGE
            ]
        else:
            found = await trio.to_thread.run_sync(
                read_tombstones, REAL_FS, data_dir, log.min_offset, end
            )
        elapsed = time.perf_counter() - started
        await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    return elapsed, longest_gap, len(found)


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "100,000 records instead of 1,000,000")
    parser.add_argument("--records", type=int, default=None)
    args = parser.parse_args()
    records = args.records or (100_000 if args.quick else 1_000_000)
    emit = bench_common.emitter("take_over")
    bench_common.emit_host_speed(emit)
    with tempfile.TemporaryDirectory(prefix="delayd-bench-take-over-") as data_dir:
        log = fill(data_dir, records)
        try:
            for way in ("loop", "thread"):
                elapsed, stall, found = trio.run(measure, way, data_dir, log)
                extra = {"way": way, "records": records, "log_bytes": log.end_offset}
                emit("read_s", elapsed, "s", tombstones=found, **extra)
                emit("longest_event_loop_stall", stall * 1000, "ms", **extra)
        finally:
            log.close()


if __name__ == "__main__":
    main()
