"""Storage benchmark: append (async / sync group commit), iterate, reopen after kill -9.

Prints one JSON object per figure on stdout:
    {"bench": "storage", "metric": ..., "value": ..., "unit": ...}

    python tools/bench_storage.py            # the full figures of docs/benchmarks.md
    python tools/bench_storage.py --quick    # the same cases, smaller (< 1 minute)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import bench_common
import trio

from storage.flusher import FlushMode, FlushPolicy, LogWriter
from storage.segmented_log import SegmentedLog

PAYLOAD = b"p" * 100
BATCH = [PAYLOAD] * 100


emit = bench_common.emitter("storage")


async def append_with_policy(
    directory: str, records: int, policy: FlushPolicy, producers: int
) -> float:
    log = SegmentedLog.open(directory)
    writer = LogWriter(log, policy)
    per_producer = records // producers // len(BATCH)
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        started = time.perf_counter()
        async with trio.open_nursery() as lanes:
            for _ in range(producers):

                async def lane() -> None:
                    for _ in range(per_producer):
                        await writer.append_batch(BATCH)

                lanes.start_soon(lane)
        await writer.flush()  # the async figure includes making everything durable
        elapsed = time.perf_counter() - started
        nursery.cancel_scope.cancel()
    log.close()
    return per_producer * producers * len(BATCH) / elapsed, writer.fsyncs


def bench_appends(root: str, records: int) -> None:
    directory = os.path.join(root, "async")
    rate, fsyncs = trio.run(
        append_with_policy, directory, records, FlushPolicy(FlushMode.ASYNC, interval_ms=100), 1
    )
    emit("append_async_batch100", rate, "records/s", payload_bytes=100, fsyncs=fsyncs)
    shutil.rmtree(directory)
    directory = os.path.join(root, "sync")
    rate, fsyncs = trio.run(append_with_policy, directory, records, FlushPolicy(FlushMode.SYNC), 16)
    emit(
        "append_sync_group_commit_batch100",
        rate,
        "records/s",
        payload_bytes=100,
        producers=16,
        fsyncs=fsyncs,
    )
    # one producer: every batch waits for its own fsync, the floor of the sync policy
    lone = os.path.join(root, "sync1")
    rate, fsyncs = trio.run(append_with_policy, lone, records // 10, FlushPolicy(FlushMode.SYNC), 1)
    emit("append_sync_one_producer_batch100", rate, "records/s", producers=1, fsyncs=fsyncs)
    shutil.rmtree(lone)
    # iterate what the sync case wrote
    log = SegmentedLog.open(directory)
    started = time.perf_counter()
    count = sum(1 for _ in log.iter_from(0))
    elapsed = time.perf_counter() - started
    log.close()
    emit("iterate_from_0", count / elapsed, "records/s", records=count)
    shutil.rmtree(directory)


WRITER = r"""
import sys

from storage.segmented_log import SegmentedLog
directory, total, segment_size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
log = SegmentedLog.open(directory, segment_size=segment_size)
big = [b"B" * 65536] * 16
written = 0
while written < total:
    log.append_batch(big)
    written += 16 * 65540
    if written % (64 << 20) < 16 * 65540:
        log.flush()  # as the async flusher would: periodic fsyncs, checkpoints
# the tail: small records, flushed in part, then killed with more in the page cache
small = [b"s" * 100] * 100
for i in range(2000):
    log.append_batch(small)
    if i == 1000:
        log.flush()
print("ready", log.end_offset, flush=True)
sys.stdin.read()
"""


def bench_reopen(root: str, total_bytes: int) -> None:
    directory = os.path.join(root, "reopen")
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, directory, str(total_bytes), str(1 << 30)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    line = child.stdout.readline().split()
    end = int(line[1])
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    started = time.perf_counter()
    log = SegmentedLog.open(directory)
    elapsed = time.perf_counter() - started
    assert log.end_offset == end, (log.end_offset, end)
    emit(
        "reopen_after_kill9",
        elapsed,
        "s",
        log_bytes=end,
        scanned_bytes=log.recovery.scanned_bytes,
    )
    log.close()
    shutil.rmtree(directory)


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "smaller cases, under a minute")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    bench_common.emit_host_speed(emit)
    root = tempfile.mkdtemp(prefix="bench-storage-", dir=args.dir)
    try:
        bench_appends(root, 500_000 if args.quick else 3_000_000)
        bench_reopen(root, (256 << 20) if args.quick else (2 << 30))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
