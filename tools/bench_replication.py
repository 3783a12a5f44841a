"""Replication benchmark: message_log records copied from a leader process to a follower
process, with sync acks (the leader's fsync and the follower's), and without.

Prints one JSON object per figure on stdout:
    {"bench": "replication", "metric": ..., "value": ..., "unit": ..., ...}

    python tools/bench_replication.py            # the figures of docs/benchmarks.md
    python tools/bench_replication.py --quick    # the same cases, smaller (< 1 minute)

Workload: records of 150 bytes (a 100-byte message with its message_log header), in
batches of 100, appended by ``--producers`` concurrent tasks the way intake appends
them (SegmentedLog.append_batch through the sync LogWriter: group-committed fsyncs), the
leader's streams notified after each append and each fsync. Each producer waits for
its batch's ack before the next one: ``ack=leader`` waits for the leader's fsync only,
``ack=sync`` for the follower's as well (delayd.replication.Leader.wait_acknowledged).
The leader process runs pinned to CPU 0 and the follower process to CPU 1 (taskset),
each with its own data directory; they talk over TCP on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_common
import trio

from delayd.replication import (
    MESSAGE_LOG,
    DelayStreams,
    EpochHistory,
    Follower,
    Leader,
)
from storage.flusher import LogWriter

RECORD = b"r" * 150
BATCH = 100
LEADER_CPU = "0"
FOLLOWER_CPU = "1"
GROUP = "bench"

emit = bench_common.emitter("replication")


def pinned(cpu: str, args: list[str]) -> list[str]:
    return ["taskset", "-c", cpu, *args] if shutil.which("taskset") else args


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


# ----------------------------------------------------------------------------- leader


async def leader_main(args: argparse.Namespace) -> None:
    streams = DelayStreams(args.data)
    history = EpochHistory.open_in(args.data)
    leader = Leader(streams, history, 1, group=GROUP, ack="sync", min_in_sync=1)
    writer = LogWriter(streams.message_log, on_durable=streams.grew)
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        await nursery.start(leader.run, "127.0.0.1", 0)
        Path(args.port_file).write_text(str(leader.addresses[0][1]))
        with trio.fail_after(30):
            while leader.in_sync != {"follower"}:
                await trio.sleep(0.01)
        for ack in ("leader", "sync"):
            await run_case(args, streams, writer, leader, ack)
        nursery.cancel_scope.cancel()
    streams.close()
    history.close()


async def run_case(
    args: argparse.Namespace, streams: DelayStreams, writer: LogWriter, leader: Leader, ack: str
) -> None:
    batches = args.records // BATCH
    latencies_ms: list[float] = []
    start_end = streams.message_log.end_offset
    next_batch = 0

    async def producer() -> None:
        nonlocal next_batch
        payloads = [RECORD] * BATCH
        while next_batch < batches:
            next_batch += 1
            began = time.perf_counter()
            offsets = streams.message_log.append_batch(payloads)
            streams.grew()
            end = offsets[-1] + len(RECORD) + 9
            await writer.flush()
            if ack == "sync":
                await leader.wait_acknowledged(MESSAGE_LOG, end)
            latencies_ms.append((time.perf_counter() - began) * 1000)

    began = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(args.producers):
            nursery.start_soon(producer)
    elapsed = time.perf_counter() - began
    copied = streams.message_log.end_offset - start_end
    records = batches * BATCH
    extra = {"ack": ack, "producers": args.producers, "records": records}
    emit(f"ack_{ack}_records_per_s", records / elapsed, "records/s", **extra)
    emit(f"ack_{ack}_bytes_per_s", copied / elapsed, "bytes/s", **extra)
    emit(f"ack_{ack}_latency_p50", percentile(latencies_ms, 0.5), "ms", **extra)
    emit(f"ack_{ack}_latency_p99", percentile(latencies_ms, 0.99), "ms", **extra)
    if ack == "sync":
        # Sync acks copy while they run: the follower holds what was acknowledged.
        emit("follower_lag_after_sync", leader.lag().get("follower", 0), "bytes", **extra)


# ----------------------------------------------------------------------------- follower


async def follower_main(args: argparse.Namespace) -> None:
    streams = DelayStreams(args.data)
    history = EpochHistory.open_in(args.data)
    host, port = args.leader.rsplit(":", 1)
    follower = Follower(streams, history, group=GROUP, member="follower", leader=(host, int(port)))
    await follower.run()


# ----------------------------------------------------------------------------- driver


def bench(records: int, producers: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-replication-"))
    port_file = work / "port"
    script = [sys.executable, str(Path(__file__).resolve())]
    leader_args = ["leader", "--data", str(work / "leader"), "--port-file", str(port_file)]
    leader_args += ["--records", str(records), "--producers", str(producers)]
    leader = subprocess.Popen(
        pinned(LEADER_CPU, [*script, *leader_args]), stdout=subprocess.PIPE, text=True
    )
    follower = None
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline or leader.poll() is not None:
                raise SystemExit("the leader process did not start")
            time.sleep(0.02)
        address = f"127.0.0.1:{port_file.read_text()}"
        follower_args = ["follower", "--data", str(work / "follower"), "--leader", address]
        follower = subprocess.Popen(pinned(FOLLOWER_CPU, [*script, *follower_args]))
        assert leader.stdout is not None
        for line in leader.stdout:
            row = json.loads(line)
            print(json.dumps(row), flush=True)
        if leader.wait(60) != 0:
            raise SystemExit(f"the leader process failed with status {leader.returncode}")
    finally:
        for proc in (leader, follower):
            if proc is not None and proc.poll() is None:
                bench_common.stop_process(proc, 10)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "smaller runs (< 1 minute)")
    parser.add_argument("mode", nargs="?", default="bench", choices=["bench", "leader", "follower"])
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    parser.add_argument("--leader", help=argparse.SUPPRESS)
    parser.add_argument("--records", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--producers", type=int, default=8, help="concurrent producers")
    args = parser.parse_args()
    if args.mode == "leader":
        trio.run(leader_main, args)
        return
    if args.mode == "follower":
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        trio.run(follower_main, args)
        return
    bench_common.emit_host_speed(emit)
    bench(200_000 if args.quick else 2_000_000, args.producers)


if __name__ == "__main__":
    main()
