"""Replication benchmark: what replicating costs a delay group. The data path alone
(message_log records copied from a leader process to a follower process), and real
``delayd serve`` processes in a group on a real etcd: acknowledged intake against a
single node, the replication lag under a steady load, and lateness of delivery.

Prints one JSON object per figure on stdout:
    {"bench": "replication", "metric": ..., "value": ..., "unit": ..., ...}

    python tools/bench_replication.py            # the figures of docs/benchmarks.md
    python tools/bench_replication.py --quick    # the same cases, smaller (< 1 minute)
    python tools/bench_replication.py --only intake,lag

Cases (full / --quick):

- datapath: records of 150 bytes (a 100-byte message with its message_log header), in
  batches of 100, appended by ``--producers`` concurrent tasks the way intake appends
  them (SegmentedLog.append_batch through the sync LogWriter: group-committed fsyncs),
  the leader's streams notified after each append and each fsync. Each producer waits
  for its batch's ack: ``ack=leader`` the leader's fsync only, ``ack=sync`` the
  follower's as well (delayd.replication.Leader.wait_acknowledged). 2,000,000 / 200,000
  records. Leader process on CPU 0, follower process on CPU 1, TCP on 127.0.0.1.
- intake: acknowledged intake of a group (leader on CPU 0, one follower on CPU 1,
  ``ack = "sync"``) and of a single node (CPU 0), the same flags and config, with the
  intake benchmark's client (tools/bench_intake.py: 100-byte bodies, batches of 100,
  16 SEND_BATCHes in flight, on CPU 1 beside the follower, or ``--client-cpu 0``
  beside the leader), in interleaved rounds (single, group, single, ...: 3 of 500,000 /
  1 of 50,000 messages each); the median round of each, their ratio, and each
  server's CPU per message.
- lag: a steady load of 50 % of the group's intake figure (the paced client below, on
  CPU 1) for 20 / 5 s, under ``ack = "sync"`` (the intake case's group) and under
  ``ack = "leader"`` (a new group): the leader's ``delayd_replication_follower_lag_bytes``
  and ``_lag_seconds`` scraped from /metrics every 50 ms (p50, p99, max), in records
  through the mean size of a message_log record; the ack latency the client saw.
- lateness: the delivery benchmark's lateness case (delayd/bench/delivery.py: 20,000 /
  2,000 messages due evenly over 10 / 2 s, consumed from the embedded broker) through
  a group (sent by the member list, consumed from the leader's broker), then on a
  single node (figures prefixed ``single_node_``); the producer and the consumer
  (this process) on CPU 1.

``--smoke`` runs every case tiny (the test suite's: it shows the tool works, its
figures mean nothing). etcd (tests/etcd_support.py's, pinned to CPU 1) runs with a
10 ms heartbeat and a 100 ms election timeout; the group's processes come from
tools/replicated_group.py. A run that fails keeps its directory, the members' logs in
it, and says where on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import bench_common
import bench_intake
import trio
from replicated_group import Member, ReplicatedGroup, lone_server, wait_until, work_dir

from delayd.address import parse_address
from delayd.bench import delivery
from delayd.protocol import ResultCode, SendBatchResult, decode_event
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
CASES = ("datapath", "intake", "lag", "lateness")
LAG_SCRAPE_S = 0.05

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


def bench_datapath(records: int, producers: int) -> None:
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


# ----------------------------------------------------------------------------- groups


def cpu_used(members: list[Member]) -> list[float]:
    """CPU seconds each member's process has used so far."""
    return [bench_intake.cpu_seconds(member.proc.pid) for member in members]  # type: ignore[union-attr]


def start_pair(work: Path, ack: str) -> ReplicatedGroup:
    """A group of a leader on CPU 0 and a follower on CPU 1, the follower in sync."""
    group = ReplicatedGroup(work, ack=ack)
    leader = group.add(LEADER_CPU)
    wait_until(lambda: group.leader() is leader, 30, "the first member leads")
    group.add(FOLLOWER_CPU)
    group.wait_in_sync()
    return group


def bench_intake_ab(
    group: ReplicatedGroup, single: Member, messages: int, rounds: int, client_cpu: str
) -> float:
    """The intake case (module docstring), the client on ``client_cpu``; returns the
    group's median msg/s."""
    leader, follower = group.members
    rates: dict[str, list[float]] = {"single": [], "group": []}
    cpu_us: dict[str, list[float]] = {"single": [], "leader": [], "follower": []}
    for _ in range(rounds):
        for kind, servers in (("single", [single]), ("group", [leader, follower])):
            before = cpu_used(servers)
            result = bench_intake.run_client(
                "client", servers[0].intake, messages, 16, cpu=client_cpu
            )
            used = [after - b for after, b in zip(cpu_used(servers), before, strict=True)]
            rates[kind].append(result["acked"] / result["seconds"])
            for name, seconds in zip(["single"] if kind == "single" else ["leader", "follower"],
                                     used, strict=True):  # fmt: skip
                cpu_us[name].append(seconds / result["acked"] * 1e6)
    single_rate = statistics.median(rates["single"])
    group_rate = statistics.median(rates["group"])
    extra = {"messages": messages, "rounds": rounds, "in_flight_batches": 16,
             "client_cpu": client_cpu}  # fmt: skip
    emit("intake_single_node", single_rate, "msg/s",
         each=[round(r) for r in rates["single"]], **extra)  # fmt: skip
    emit("intake_group_sync", group_rate, "msg/s", target=">= 50000",
         each=[round(r) for r in rates["group"]], **extra)  # fmt: skip
    emit("intake_group_vs_single", group_rate / single_rate * 100, "%", target=">= 50", **extra)
    for name, values in cpu_us.items():
        emit(f"intake_cpu_per_message_{name}", statistics.median(values), "us", **extra)
    return group_rate


def paced_client_main(args: argparse.Namespace) -> None:
    """Send ``--messages`` in batches of BATCH at ``--rate`` msg/s, pipelined (a batch
    goes out on time whether or not earlier ones were answered); print the ack
    latencies' p50 and p99 and the rate achieved."""
    client = bench_intake.IntakeClient(*parse_address(args.addr), "bench-replication-lag")
    frames = client.frames(args.messages // BATCH, seed=4)
    interval_s = BATCH / args.rate
    sent_at: list[float] = []
    latencies_ms: list[float] = []
    started = time.perf_counter()
    while len(latencies_ms) < len(frames):
        now = time.perf_counter()
        while len(sent_at) < len(frames) and now >= started + len(sent_at) * interval_s:
            client.sock.sendall(frames[len(sent_at)])
            sent_at.append(now)
        wait_s = started + len(sent_at) * interval_s - now if len(sent_at) < len(frames) else 1.0
        ready, _, _ = select.select([client.sock], [], [], max(0.0, wait_s))
        if not ready:
            continue
        client.decoder.feed(client.sock.recv(1 << 20))
        while (frame := client.decoder.next_frame()) is not None:
            answer = decode_event(frame.command, frame.flags, frame.request_id, frame.body)
            assert isinstance(answer, SendBatchResult), answer
            assert all(r.code is ResultCode.OK for r in answer.results), answer
            latencies_ms.append((time.perf_counter() - sent_at[len(latencies_ms)]) * 1000)
    seconds = time.perf_counter() - started
    print(json.dumps({"rate": len(frames) * BATCH / seconds,
                      "p50_ms": percentile(latencies_ms, 0.5),
                      "p99_ms": percentile(latencies_ms, 0.99)}))  # fmt: skip


def scrape_lag(
    leader: Member, stop: threading.Event, out: list[tuple[float, float, float]]
) -> None:
    """Append (lag bytes, lag seconds, message_log acknowledged bytes) from the leader's
    /metrics every LAG_SCRAPE_S until ``stop``."""
    while not stop.wait(LAG_SCRAPE_S):
        page = leader.metrics()
        lag_bytes = sum(
            v for k, v in page.items() if k.startswith("delayd_replication_follower_lag_bytes")
        )
        lag_s = max(
            (v for k, v in page.items() if k.startswith("delayd_replication_follower_lag_seconds")),
            default=0.0,
        )
        acked = page.get('delayd_replication_acknowledged_offset_bytes{log="message_log"}', 0.0)
        out.append((lag_bytes, lag_s, acked))


def bench_lag(group: ReplicatedGroup, ack: str, rate: float, seconds: float) -> None:
    """The lag case (module docstring) on ``group`` at ``rate`` msg/s."""
    leader = group.members[0]
    samples: list[tuple[float, float, float]] = []
    stop = threading.Event()
    scraper = threading.Thread(target=scrape_lag, args=(leader, stop, samples))
    messages = int(rate * seconds) // BATCH * BATCH
    scraper.start()
    try:
        args = [sys.executable, str(Path(__file__).resolve()), "paced-client", "--addr",
                leader.intake, "--messages", str(messages), "--rate", str(rate)]  # fmt: skip
        client = bench_intake.run_pinned_client(FOLLOWER_CPU, args)
    finally:
        stop.set()
        scraper.join()
    # message_log's growth over the case per message sent: a record's mean size, which
    # turns the exported lag in bytes into records.
    record_bytes = (samples[-1][2] - samples[0][2]) / messages
    lag_bytes = [b for b, _, _ in samples]
    lag_records = [b / record_bytes for b in lag_bytes]
    lag_ms = [s * 1000 for _, s, _ in samples]
    extra = {"ack": ack, "rate_msg_s": round(rate), "seconds": seconds, "samples": len(samples)}
    for name, values, unit in (
        ("bytes", lag_bytes, "bytes"),
        ("records", lag_records, "records"),
        ("ms", lag_ms, "ms"),
    ):
        emit(f"lag_{ack}_{name}_p50", percentile(values, 0.5), unit, **extra)
        emit(f"lag_{ack}_{name}_p99", percentile(values, 0.99), unit, **extra)
        emit(f"lag_{ack}_{name}_max", max(values), unit, **extra)
    emit(
        f"lag_{ack}_record_bytes",
        record_bytes,
        "bytes",
        what="message_log growth per message",
        **extra,
    )
    emit(f"lag_{ack}_client_rate", client["rate"], "msg/s", **extra)
    emit(f"lag_{ack}_ack_latency_p50", client["p50_ms"], "ms", **extra)
    emit(f"lag_{ack}_ack_latency_p99", client["p99_ms"], "ms", **extra)


def lateness_of(server: Member, intake: str, count: int, window_ms: int) -> tuple[dict, float, int]:
    """The lateness case's ``count`` messages due over ``window_ms``, sent to ``intake``
    and consumed from ``server``'s broker; (what was received, ``server``'s CPU seconds
    and preemptions meanwhile)."""
    assert server.proc is not None
    cpu_before = cpu_used([server])[0]
    preempted_before = delivery.involuntary_switches(server.proc.pid)
    got = delivery.lateness_blocking(intake, server.broker, count, window_ms)
    cpu = cpu_used([server])[0] - cpu_before
    return got, cpu, delivery.involuntary_switches(server.proc.pid) - preempted_before


def bench_lateness(work: Path, count: int, window_ms: int) -> None:
    """The lateness case (module docstring): through a new group, then a single node."""
    group = start_pair(work, "sync")
    try:
        leader = group.members[0]
        got, cpu, preempted = lateness_of(leader, group.member_list, count, window_ms)
    finally:
        group.close()
    late = {"p99_target": "<= 10", "consumer": "blocking"}
    pair = "leader + 1 follower, ack = sync"
    delivery.report_lateness(emit, got, count, window_ms, cpu, preempted, **late, group=pair)
    single = lone_server(work, LEADER_CPU)
    try:
        got, cpu, preempted = lateness_of(single, single.intake, count, window_ms)
    finally:
        single.close()

    def emit_single(metric: str, value: float, unit: str, **extra: object) -> None:
        emit(f"single_node_{metric}", value, unit, **extra)

    delivery.report_lateness(emit_single, got, count, window_ms, cpu, preempted, **late)


@dataclass(frozen=True)
class Size:
    """How big each case runs."""

    datapath_records: int
    intake_messages: int  # per round, per side
    intake_rounds: int
    lag_s: float
    lateness: tuple[int, int]  # messages, over ms


SIZES = {
    "full": Size(2_000_000, 500_000, 3, 20.0, (20_000, 10_000)),
    "quick": Size(200_000, 50_000, 1, 5.0, (2_000, 2_000)),
    "smoke": Size(20_000, 5_000, 1, 1.0, (200, 500)),
}


def bench_groups(cases: set[str], size: Size, client_cpu: str) -> None:
    """The cases that run ``delayd serve`` processes (intake, lag, lateness)."""
    with work_dir("bench-replication-") as work:
        if cases & {"intake", "lag"}:
            (work / "ab").mkdir()
            group = start_pair(work / "ab", "sync")
            single = lone_server(work / "ab", LEADER_CPU)
            try:
                rate = bench_intake_ab(
                    group, single, size.intake_messages, size.intake_rounds, client_cpu
                )
                single.close()
                if "lag" in cases:
                    bench_lag(group, "sync", rate / 2, size.lag_s)
            finally:
                single.close()
                group.close()
            if "lag" in cases:
                (work / "lag").mkdir()
                group = start_pair(work / "lag", "leader")
                try:
                    bench_lag(group, "leader", rate / 2, size.lag_s)
                finally:
                    group.close()
        if "lateness" in cases:
            (work / "late").mkdir()
            bench_lateness(work / "late", *size.lateness)


def parse_cases(text: str) -> set[str]:
    cases = {case for case in text.split(",") if case}
    unknown = cases - set(CASES)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown case(s) {', '.join(sorted(unknown))}; choose from {', '.join(CASES)}"
        )
    return cases


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "smaller runs (< 1 minute)")
    parser.add_argument("mode", nargs="?", default="bench",
                        choices=["bench", "leader", "follower", "paced-client"])  # fmt: skip
    parser.add_argument(
        "--client-cpu",
        choices=[LEADER_CPU, FOLLOWER_CPU],
        default=FOLLOWER_CPU,
        help="the intake case's client: beside the follower (1, the default) or the leader (0)",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny runs that only show the tool works (tests)"
    )
    parser.add_argument(
        "--only",
        type=parse_cases,
        default=set(CASES),
        help=f"the cases to run, comma-separated (of {', '.join(CASES)})",
    )
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    parser.add_argument("--leader", help=argparse.SUPPRESS)
    parser.add_argument("--records", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--addr", help=argparse.SUPPRESS)
    parser.add_argument("--messages", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rate", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--producers", type=int, default=8, help="datapath: concurrent producers")
    args = parser.parse_args()
    if args.mode == "leader":
        trio.run(leader_main, args)
        return
    if args.mode == "follower":
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        trio.run(follower_main, args)
        return
    if args.mode == "paced-client":
        paced_client_main(args)
        return
    size = SIZES["smoke" if args.smoke else "quick" if args.quick else "full"]
    bench_common.emit_host_speed(emit)
    if "datapath" in args.only:
        bench_datapath(size.datapath_records, args.producers)
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {int(FOLLOWER_CPU)})  # the clients' CPU, off the leader's
    bench_groups(args.only, size, args.client_cpu)


if __name__ == "__main__":
    main()
