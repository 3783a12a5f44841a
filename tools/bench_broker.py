"""Broker benchmark: produce and consume throughput, end-to-end latency, on loopback.

Starts a real ``delayd broker`` process (pinned to CPU 0 with taskset when there is
one) and drives it from this process (pinned to CPU 1) with the delayd clients. Prints
one JSON object per figure on stdout::

    {"bench": "broker", "metric": ..., "value": ..., "unit": ...}

    python tools/bench_broker.py            # the figures of docs/benchmarks.md
    python tools/bench_broker.py --quick    # the same cases, smaller (< 1 minute)
    python tools/bench_broker.py --profile  # also cProfile the client side of each case

Cases (targets from issue 3):
- produce: 100-byte bodies, SEND_BATCH frames of 100, the broker on ``--flush sync``
  (acks after fsync, group commit); a few frames in flight so one fsync covers several.
  Blocking producer (pipelined frames) and async producer (concurrent tasks, trio).
  Target >= 100,000 msg/s.
- consume: pulling what produce stored, as a new group, with the async and the blocking
  consumer (auto-commit). Target >= 200,000 msg/s.
- latency: one message every ms (1,000 msg/s) sent by the blocking producer in one
  thread while the async consumer long-polls in another; send start to delivery, p50
  and p99. Target p99 < 5 ms.
"""

from __future__ import annotations

import cProfile
import io
import math
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import anyio
import bench_common

REPO = bench_common.ROOT

import delayd  # noqa: E402
from delayd.address import parse_address  # noqa: E402
from delayd.client._blocking_link import BlockingLink  # noqa: E402
from delayd.protocol import Message, Stats, StatsResult  # noqa: E402

BODY = b"b" * 100
FRAME = 100  # messages per SEND_BATCH


emit = bench_common.emitter("broker")


class Broker:
    """A ``delayd broker`` child process, pinned to CPU 0 when taskset exists."""

    def __init__(self, data: str) -> None:
        # Port 0: the broker picks a free port and prints it (a port probed free here
        # could be taken again before the broker binds it).
        args = [sys.executable, "-m", "delayd", "broker", "--data", data, "--listen", "127.0.0.1:0"]
        args += ["--metrics-listen", "off", "--log-level", "warning"]
        self.pinned = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
        if self.pinned:
            args = ["taskset", "-c", "0", *args]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.proc.kill()
            raise RuntimeError(f"broker did not start: {line!r}")
        self.addr = line.rsplit(" ", 1)[1].strip()  # "delayd broker listening on HOST:PORT"

    def stop(self) -> None:
        bench_common.stop_process(self.proc, 10)


def pin_client() -> bool:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {1})
        return True
    return False


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def broker_fsyncs(addr: str) -> int:
    """The broker's fsync count, from STATS."""
    link = BlockingLink.open(
        parse_address(addr), token=None, client_name="bench", deadline=time.monotonic() + 10
    )
    try:
        result = link.request(lambda rid: Stats(request_id=rid), time.monotonic() + 10)
    finally:
        link.close()
    assert isinstance(result, StatsResult)
    return int(result.stats.get("broker.fsyncs_total", -1))


class Case:
    """Where the time of one case went: wall clock, broker CPU, client CPU, fsyncs.

    CPU seconds near the wall time mean that side was the bottleneck; both well below
    it mean the time went to waiting (fsync, round trips). With ``profile`` the client
    side runs under cProfile and its top entries go to stderr.
    """

    def __init__(self, broker: Broker, name: str, *, profile: bool) -> None:
        self.broker, self.name = broker, name
        self.profiler = cProfile.Profile() if profile else None

    def __enter__(self) -> Case:
        self.fsyncs = broker_fsyncs(self.broker.addr)
        self.broker_cpu = process_cpu_s(self.broker.proc.pid)
        self.client_cpu = time.process_time()
        self.wall = time.perf_counter()
        if self.profiler:
            self.profiler.enable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.profiler:
            self.profiler.disable()
        self.wall = time.perf_counter() - self.wall
        self.client_cpu = time.process_time() - self.client_cpu
        self.broker_cpu = process_cpu_s(self.broker.proc.pid) - self.broker_cpu
        self.fsyncs = broker_fsyncs(self.broker.addr) - self.fsyncs
        if self.profiler:
            out = io.StringIO()
            pstats.Stats(self.profiler, stream=out).sort_stats("tottime").print_stats(15)
            print(f"--- client profile: {self.name}\n{out.getvalue()}", file=sys.stderr)

    def figures(self, messages: int) -> dict[str, float]:
        """The case's costs; per message, CPU time is what a side could sustain alone
        on an idle core (1e6 / us_per_msg msg/s), whatever else ran on the machine."""
        return {
            "wall_s": round(self.wall, 3),
            "broker_cpu_s": round(self.broker_cpu, 3),
            "client_cpu_s": round(self.client_cpu, 3),
            "broker_cpu_us_per_msg": round(self.broker_cpu / messages * 1e6, 2),
            "client_cpu_us_per_msg": round(self.client_cpu / messages * 1e6, 2),
            "broker_fsyncs": self.fsyncs,
        }


def messages(subject: str, n: int) -> list[Message]:
    """Messages made up front, so that the figures measure the wire, not the test data."""
    return [Message(f"{subject}-{i:012d}", subject, body=BODY) for i in range(n)]


# --- produce ------------------------------------------------------------------------------


def produce_blocking(addr: str, batch: list[Message], in_flight: int) -> float:
    """msg/s: send_batch of ``in_flight`` frames at a time, pipelined on one socket."""
    chunk = FRAME * in_flight
    with delayd.Producer(addr, max_frame_messages=FRAME, max_in_flight=in_flight) as producer:
        started = time.perf_counter()
        for start in range(0, len(batch), chunk):
            receipts = producer.send_batch(batch[start : start + chunk])
            assert all(r.ok for r in receipts)
        return len(batch) / (time.perf_counter() - started)


async def produce_async(addr: str, batch: list[Message], tasks: int) -> float:
    """msg/s: ``tasks`` concurrent tasks, each sending frames of 100 one after another."""
    frames = [batch[i : i + FRAME] for i in range(0, len(batch), FRAME)]
    async with delayd.open_producer(addr) as producer:

        async def lane(mine: list[list[Message]]) -> None:
            for frame in mine:
                receipts = await producer.send_batch(frame)
                assert all(r.ok for r in receipts)

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for lane_index in range(tasks):
                tg.start_soon(lane, frames[lane_index::tasks])
        return len(batch) / (time.perf_counter() - started)


# --- consume ------------------------------------------------------------------------------


async def consume_async(addr: str, subject: str, n: int) -> float:
    async with delayd.open_consumer(
        addr, subject=subject, group="bench-async", max_messages=2000
    ) as consumer:
        started = time.perf_counter()
        count = 0
        async for _ in consumer:
            count += 1
            if count == n:
                break
        return n / (time.perf_counter() - started)


def consume_blocking(addr: str, subject: str, n: int) -> float:
    with delayd.Consumer(addr, subject=subject, group="bench-blocking", max_messages=2000) as c:
        started = time.perf_counter()
        for count, _ in enumerate(c, 1):
            if count == n:
                break
        return n / (time.perf_counter() - started)


# --- latency ------------------------------------------------------------------------------


def latency(addr: str, seconds: float, rate: int) -> list[float]:
    """Seconds from the start of each send to its delivery to the long-polling consumer."""
    subject = "latency"
    sent_at: dict[str, float] = {}
    delays: list[float] = []
    total = int(seconds * rate)
    ready = threading.Event()

    async def consume() -> None:
        async with delayd.open_consumer(
            addr, subject=subject, group="bench-latency", pull_wait_ms=5000
        ) as consumer:
            ready.set()
            async for message in consumer:
                delays.append(time.perf_counter() - sent_at[message.message_id])
                if len(delays) == total:
                    return

    consumer = threading.Thread(target=anyio.run, args=(consume,), kwargs={"backend": "trio"})
    consumer.start()
    ready.wait(10)
    with delayd.Producer(addr) as producer:
        interval = 1 / rate
        next_at = time.perf_counter()
        for i in range(total):
            message_id = f"lat-{i}"
            now = time.perf_counter()
            if now < next_at:
                time.sleep(next_at - now)
            sent_at[message_id] = time.perf_counter()
            producer.send(subject, BODY, message_id=message_id)
            next_at += interval
    consumer.join(30)
    return delays


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "smaller runs, under a minute")
    parser.add_argument("--profile", action="store_true", help="cProfile the client side")
    args = parser.parse_args()
    bench_common.emit_host_speed(emit)
    n = 200_000 if args.quick else 1_000_000
    latency_s = 3 if args.quick else 10
    pinned = pin_client()
    data = tempfile.mkdtemp(prefix="bench-broker-")
    broker = Broker(data)
    placement = {"pinned": pinned and broker.pinned}
    produced = {"frame": FRAME, **placement}  # what both produce figures carry
    try:
        with Case(broker, "produce, blocking", profile=args.profile) as case:
            rate = produce_blocking(broker.addr, messages("blocking", n), in_flight=8)
        emit("produce_blocking", rate, "msg/s", in_flight=8, **produced, **case.figures(n))
        with Case(broker, "produce, async (trio)", profile=args.profile) as case:
            rate = anyio.run(produce_async, broker.addr, messages("async", n), 8, backend="trio")
        emit("produce_async_trio", rate, "msg/s", tasks=8, **produced, **case.figures(n))
        with Case(broker, "consume, async (trio)", profile=args.profile) as case:
            rate = anyio.run(consume_async, broker.addr, "blocking", n, backend="trio")
        emit("consume_async_trio", rate, "msg/s", **placement, **case.figures(n))
        with Case(broker, "consume, blocking", profile=args.profile) as case:
            rate = consume_blocking(broker.addr, "async", n)
        emit("consume_blocking", rate, "msg/s", **placement, **case.figures(n))
        with Case(broker, "latency", profile=False) as case:
            delays = latency(broker.addr, latency_s, 1000)
        emit("e2e_latency_p50", percentile(delays, 50) * 1000, "ms", samples=len(delays))
        emit("e2e_latency_p99", percentile(delays, 99) * 1000, "ms", rate_msg_s=1000)
        emit("e2e_latency_max", max(delays) * 1000, "ms", **case.figures(len(delays)))
    finally:
        broker.stop()
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
