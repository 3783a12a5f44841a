"""Promotion benchmark: what a take-over reads of message_log, and how long.

A member that followed a leader decides every tombstone of message_log again when it
takes over (``Canceller.take_over``, docs/replication.md). This writes a message_log of N
records (one in 100 a CANCEL tombstone, the rest 150-byte messages) and finds the
tombstones on a trio event loop while a heartbeat task ticks every millisecond:

- ``loop``: ``SegmentedLog.iter_from`` over the whole log on the event loop, as
  take_over read it first;
- ``thread``: ``read_tombstones`` over the whole log in a worker thread, as it read it
  until the tombstone index;
- ``indexed``: ``Replayer.tombstones_between``, the records at the offsets the
  replayer's tombstone index holds, in a worker thread, as it reads them now.

For each: the wall time of the read and the longest the heartbeat waited (the longest
any other task — intake's handlers, /metrics, the lease's renewals — could have waited).
``thread`` and ``indexed`` run in alternation, ``--rounds`` times each. The index is
built as a restarted member builds it: a replayer replays half the log and stops at a
checkpoint; a new one scans below it (``scan_at_start_s``, in the background while the
member follows: not on the promotion's path) while it replays the rest. The decisions
that follow are the same for every way (one per tombstone, yielding every 1,000).

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
from delayd.replay import Replayer, open_replayer
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


def replay_half_then_restart(data_dir: str, log: SegmentedLog) -> Replayer:
    """A follower that replayed half the log and stopped at a checkpoint, started
    again (its tombstone index starts at the checkpoint)."""
    first = open_replayer(data_dir, log, segment_scale=1, index=False)
    while first.position < log.end_offset // 2 and first.replay_available(10_000):
        pass
    first.checkpoint()
    first.close()
    return open_replayer(data_dir, log, segment_scale=1, index=False)


async def scan_while_replaying(replayer: Replayer) -> float:
    """Replay the rest while the scan below the checkpoint runs; the scan's wall time."""
    scanned_s = 0.0

    async def scan() -> None:
        nonlocal scanned_s
        started = time.perf_counter()
        await replayer.scan_tombstones()
        scanned_s = time.perf_counter() - started

    async with trio.open_nursery() as nursery:
        nursery.start_soon(scan)
        while replayer.replay_available(10_000):
            await trio.sleep(0)
    return scanned_s


async def measure(way: str, data_dir: str, replayer: Replayer) -> tuple[float, float, int]:
    longest_gap = 0.0
    log = replayer.log
    end = replayer.position

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
        elif way == "thread":
            found = await trio.to_thread.run_sync(
                read_tombstones, REAL_FS, data_dir, log.min_offset, end
            )
        else:
            found = await trio.to_thread.run_sync(replayer.tombstones_between, log.min_offset, end)
        elapsed = time.perf_counter() - started
        await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    return elapsed, longest_gap, len(found)


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "100,000 records instead of 1,000,000")
    parser.add_argument("--records", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3, help="thread/indexed reads, each")
    args = parser.parse_args()
    records = args.records or (100_000 if args.quick else 1_000_000)
    emit = bench_common.emitter("take_over")
    bench_common.emit_host_speed(emit)
    with tempfile.TemporaryDirectory(prefix="delayd-bench-take-over-") as data_dir:
        log = fill(data_dir, records)
        replayer = replay_half_then_restart(data_dir, log)
        try:
            scanned_s = trio.run(scan_while_replaying, replayer)
            extra = {"records": records, "log_bytes": log.end_offset}
            below = replayer.tombstones.replay_start
            emit("scan_at_start_s", scanned_s, "s", scanned_bytes=below, **extra)
            emit("index_bytes", len(replayer.tombstones) * 8, "bytes", **extra)
            ways = ["loop"] + ["thread", "indexed"] * args.rounds
            for n, way in enumerate(ways):
                elapsed, stall, found = trio.run(measure, way, data_dir, replayer)
                figure = {"way": way, "round": (n + 1) // 2, **extra}
                emit("read_s", elapsed, "s", tombstones=found, **figure)
                emit("longest_event_loop_stall", stall * 1000, "ms", **figure)
        finally:
            replayer.close()
            log.close()


if __name__ == "__main__":
    main()
