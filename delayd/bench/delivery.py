"""Delivery benchmark: how late, how fast in a burst, how much memory and how
quick a restart of ``delayd serve`` delivering delayed messages to its embedded broker.

Prints one JSON object per figure on stdout:
    {"bench": "delivery", "metric": ..., "value": ..., "unit": ..., ...}

    delayd bench                        # the figures of docs/benchmarks.md
    delayd bench --quick                # the same cases, smaller (< 1 minute)
    delayd bench --only lateness,burst
    delayd bench --only lateness --consumer async

``python tools/bench_delivery.py`` is the same, from a checkout (its own delayd first);
the options are read by delayd/cli/bench.py.

Cases (full / --quick):

- lateness: 20,000 / 2,000 messages due evenly over 10 s / 2 s, starting 3 s after the
  run starts; a long-polling consumer stamps each on receipt (``time.time_ns()``, float
  ms): lateness = receipt - due_ms (p50, p99, max, early, missing). Server-side lateness
  is ``dispatched_ms - due_ms`` as the sender stamped it, broker-side ``store_ms -
  due_ms``; the server's CPU time and preemptions over the case show CPU contention.
- burst: 500,000 / 50,000 messages due within one second, a few seconds after the sends
  finish; the time from the start of that second until the last is stored by the broker
  (max ``store_ms``) and until the consumer has received the last; server CPU per message.
- memory: VmRSS of the server with 10,000,000 / 200,000 messages pending two days out
  (far beyond the wheel's load window), read once replay has caught up.
- restart: on the memory case's data directory, ``kill -9`` the server and time until a
  new server process acknowledges a send.

The server runs as its own process (``python -m delayd serve``, started from the
current directory with this interpreter, so a checkout run from its root serves its own
code) pinned to CPU 0 with ``taskset``; this process (producer and consumer) pins
itself to CPU 1. The producer is the public blocking ``delayd.Producer``
(``send_batch``), the consumer the blocking ``delayd.Consumer``. Progress goes to
stderr.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import delayd
from delayd.address import parse_address
from delayd.bench import common
from delayd.bench.raw_client import RawClient
from delayd.protocol import Message

BODY = b"b" * 100
SUBJECT = "due"
SEND_CHUNK = 10_000  # messages per send_batch call (the client splits frames of 1,000)
SERVER_CPU = "0"
CLIENT_CPU = 1
INTAKE_READY = re.compile(r"delayd serve listening on (\S+):(\d+)")
BROKER_READY = re.compile(r"delayd serve broker listening on (\S+):(\d+)")
DAY_MS = 86_400_000
CASES = {"lateness", "burst", "memory", "restart"}
CONFIG = """\
[intake]
max_pending_acks = 1000000
max_replay_lag_records = 10000000
"""


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


emit = common.emitter("delivery")


def now_ms() -> float:
    return time.time_ns() / 1e6


def percentile(ordered: list[float], p: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))]


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def involuntary_switches(pid: int) -> int:
    """How often ``pid``'s threads were preempted so far (Linux /proc)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("nonvoluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


# ----------------------------------------------------------------------------- server


class Server:
    """One ``delayd serve`` process over ``data`` (started by ``start``)."""

    def __init__(
        self,
        data: str,
        *,
        config: str = CONFIG,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        cpu: str | None = SERVER_CPU,
    ) -> None:
        """``config``: the TOML file's text; ``extra``: more flags; ``env``: the
        environment (None: this process's); ``cpu``: the CPU it is pinned to (None:
        not pinned)."""
        self.data = data
        self.config = Path(data) / "bench.toml"
        self.config.write_text(config)
        self.extra = extra
        self.env = env
        self.cpu = cpu
        self.proc: subprocess.Popen | None = None
        self.intake = ""
        self.broker = ""

    def start(self) -> None:
        # Free ports throughout, metrics included (kept on, as a deployment runs it): a
        # bench must not collide with a running `make run` or another bench.
        args = [sys.executable, "-m", "delayd", "serve", "--data", str(Path(self.data) / "d"),
                "--config", str(self.config), "--listen", "127.0.0.1:0",
                "--broker-listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                "--http-listen", "off",
                "--log-level", "warning", *self.extra]  # fmt: skip
        if self.cpu is not None and shutil.which("taskset"):
            args = ["taskset", "-c", self.cpu, *args]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, env=self.env)
        out = ""
        deadline = time.monotonic() + 60
        while (match := INTAKE_READY.search(out)) is None:
            timeout = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            chunk = os.read(self.proc.stdout.fileno(), 65536).decode() if ready else ""
            if not chunk:
                self.proc.kill()
                raise RuntimeError(f"delayd serve did not start: {out!r}")
            out += chunk
        self.intake = f"{match.group(1)}:{match.group(2)}"
        broker = BROKER_READY.search(out)
        assert broker is not None, out
        self.broker = f"{broker.group(1)}:{broker.group(2)}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()

    def stats(self) -> dict:
        """The server's STATS (replay lag and so on), over a fresh connection."""
        with RawClient(*parse_address(self.intake), "bench-delivery") as client:
            return client.stats()

    def wait_replayed(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while self.stats()["replay.lag_records"]:
            if time.monotonic() > deadline:
                raise RuntimeError("replay did not catch up")
            time.sleep(0.05)  # polling a counter; nothing to wait on


def send_all(addr: str, dues: list[int] | range, at_ms_of, prefix: str) -> float:
    """Send one message per item of ``dues`` (``at_ms_of(item)``), ids ``prefix-N``;
    returns the seconds it took. Raises if any is refused."""
    started = time.perf_counter()
    with delayd.Producer(addr, timeout_s=60) as producer:
        for first in range(0, len(dues), SEND_CHUNK):
            batch = [
                Message(f"{prefix}-{i}", SUBJECT, body=BODY, at_ms=at_ms_of(dues[i]))
                for i in range(first, min(first + SEND_CHUNK, len(dues)))
            ]
            receipts = producer.send_batch(batch)
            refused = [r for r in receipts if not r.ok]
            if refused:
                raise RuntimeError(f"{len(refused)} refused, first: {refused[0]}")
    return time.perf_counter() - started


def consume(addr: str, consumer: delayd.Consumer, wanted: int, until_ms: float) -> dict:
    """Receive until ``wanted`` distinct ids or ``until_ms``; id -> (receipt ms, Message)."""
    got: dict[str, tuple[float, Message]] = {}
    while len(got) < wanted:
        left_s = (until_ms - now_ms()) / 1000
        if left_s <= 0:
            break
        message = consumer.receive(timeout_s=min(left_s, 1.0))
        if message is None:
            continue
        received = now_ms()
        got.setdefault(message.message_id, (received, message))
    return got


# ----------------------------------------------------------------------------- cases


def schedule_window(intake: str, count: int, window_ms: int) -> int:
    """Send ``count`` messages due evenly over ``window_ms`` from 3 s on to ``intake``
    (an address as the producer takes it); the start."""
    start = int(now_ms()) + 3000
    step = window_ms / count
    seconds = send_all(intake, range(count), lambda i: start + int(i * step), "late")
    log(f"lateness: sent {count:,} in {seconds:.2f} s; "
        f"first due in {(start - now_ms()) / 1000:.2f} s")  # fmt: skip
    return start


def lateness_blocking(intake: str, broker: str, count: int, window_ms: int) -> dict:
    """The lateness case's messages sent to ``intake`` and consumed from ``broker``
    (addresses as the clients take them); id -> (receipt ms, Message)."""
    # Join before anything is due, so the group sees every message.
    with delayd.Consumer(broker, subject=SUBJECT, group="lateness",
                         max_messages=1000, pull_wait_ms=1000) as consumer:  # fmt: skip
        start = schedule_window(intake, count, window_ms)
        return consume(broker, consumer, count, start + window_ms + 10_000)


def lateness_async(intake: str, broker: str, count: int, window_ms: int) -> dict:
    """As lateness_blocking with ``delayd.open_consumer`` under trio in a thread."""
    import trio

    got: dict[str, tuple[float, Message]] = {}
    joined = threading.Event()
    until: list[float] = []

    async def receive() -> None:
        async with delayd.open_consumer(
            broker, subject=SUBJECT, group="lateness", max_messages=1000, pull_wait_ms=1000
        ) as consumer:
            joined.set()
            while len(got) < count and (not until or now_ms() < until[0]):
                message = await consumer.receive(timeout_s=1.0)
                if message is not None:
                    got.setdefault(message.message_id, (now_ms(), message))

    thread = threading.Thread(target=trio.run, args=(receive,))
    thread.start()
    joined.wait(30)
    start = schedule_window(intake, count, window_ms)
    until.append(start + window_ms + 10_000)
    thread.join()
    return got


def bench_lateness(count: int, window_ms: int, consumer_kind: str) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-delivery-") as data:
        server = Server(data)
        server.start()
        try:
            cpu_before = cpu_seconds(server.pid)
            preempted_before = involuntary_switches(server.pid)
            lateness = lateness_async if consumer_kind == "async" else lateness_blocking
            got = lateness(server.intake, server.broker, count, window_ms)
            cpu = cpu_seconds(server.pid) - cpu_before
            preempted = involuntary_switches(server.pid) - preempted_before
        finally:
            server.stop()
    report_lateness(emit, got, count, window_ms, cpu, preempted, consumer=consumer_kind)


def report_lateness(
    emit: common.Emit,
    got: dict[str, tuple[float, Message]],
    count: int,
    window_ms: int,
    cpu: float,
    preempted: int,
    p99_target: str = "<= 5",
    **extra: object,
) -> None:
    """The lateness case's figures, of what ``lateness_blocking`` (or ``_async``)
    received: ``cpu`` seconds and ``preempted`` times are the server's over the case;
    ``extra`` goes into the main figures."""
    load = load_average()
    figures = {"messages": count, "window_ms": window_ms, **extra, "load_average": load}
    if not got:
        emit("lateness_missing", count, "messages", **figures)
        return
    late = sorted(received - m.due_ms for received, m in got.values())
    server_late = sorted(m.dispatched_ms - m.due_ms for _, m in got.values())
    store_late = sorted(m.store_ms - m.due_ms for _, m in got.values())
    # The first 100 ms of the window: one-off costs of the first delivery show up here.
    first = min(m.due_ms for _, m in got.values()) + 100
    steady = sorted(r - m.due_ms for r, m in got.values() if m.due_ms >= first)
    emit("lateness_p50", percentile(late, 50), "ms", target="<= 2", **figures)
    emit("lateness_p99", percentile(late, 99), "ms", target=p99_target, **figures)
    emit("lateness_p99_9", percentile(late, 99.9), "ms", **figures)
    emit("lateness_max", late[-1], "ms", target="<= 20", **figures)
    emit("lateness_early", sum(1 for x in late if x < 0), "messages", target="0", **figures)
    emit("lateness_missing", count - len(got), "messages", target="0", **figures)
    emit("server_lateness_p50", percentile(server_late, 50), "ms", what="dispatched - due")
    emit("server_lateness_p99", percentile(server_late, 99), "ms", what="dispatched - due")
    emit("server_lateness_max", server_late[-1], "ms", what="dispatched - due")
    # CPU contention: how busy the server was, and how often it lost its CPU anyway.
    emit("server_cpu_during_lateness", cpu, "s", what="sends included", **figures)
    emit("server_preempted_during_lateness", preempted, "times", **figures)
    emit("store_lateness_p50", percentile(store_late, 50), "ms", what="broker store - due")
    emit("store_lateness_p99", percentile(store_late, 99), "ms", what="broker store - due")
    emit("store_lateness_max", store_late[-1], "ms", what="broker store - due")
    what = "receipt - due, after the first 100 ms"
    emit("steady_lateness_p50", percentile(steady, 50), "ms", what=what)
    emit("steady_lateness_p99", percentile(steady, 99), "ms", what=what)
    emit("steady_lateness_max", steady[-1], "ms", what=what)


def bench_burst(count: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-delivery-") as data:
        server = Server(data)
        server.start()
        try:
            with delayd.Consumer(server.broker, subject=SUBJECT, group="burst",
                                 max_messages=2000, pull_wait_ms=1000) as consumer:  # fmt: skip
                # Intake with this client runs at ~60-85k msg/s; leave room for a slow run.
                due = int(now_ms()) + int(count / 30_000 * 1000) + 5000
                seconds = send_all(server.intake, range(count),
                                   lambda i: due + i * 1000 // count, "burst")  # fmt: skip
                server.wait_replayed()
                cpu_before = cpu_seconds(server.pid)
                ahead_s = (due - now_ms()) / 1000
                log(f"burst: sent {count:,} in {seconds:.2f} s ({count / seconds:,.0f} msg/s); "
                    f"due in {ahead_s:.2f} s")  # fmt: skip
                if ahead_s < 1:
                    log("burst: WARNING the sends ran into the due second")
                got = consume(server.broker, consumer, count, due + 120_000)
                cpu = cpu_seconds(server.pid) - cpu_before
        finally:
            server.stop()
    load = load_average()
    stored = max(m.store_ms for _, m in got.values()) - due
    dispatched = max(m.dispatched_ms for _, m in got.values()) - due
    received = max(r for r, _ in got.values()) - due
    common = {"messages": count, "load_average": load}
    emit("burst_last_stored_after_due", stored / 1000, "s", target="<= 10", **common)
    emit("burst_last_dispatched_after_due", dispatched / 1000, "s", **common)
    emit("burst_last_received_after_due", received / 1000, "s", **common)
    emit("burst_missing", count - len(got), "messages", target="0", **common)
    # Steadier than the wall clock on a shared machine: the server's own cost.
    emit("burst_server_cpu_per_message", cpu / count * 1e6, "us",
         what="wheel, sender, dispatch_log, broker store and serving the consumer")  # fmt: skip
    emit("burst_send_rate", count / seconds, "msg/s", **common)


def fill_far_pending(server: Server, count: int) -> tuple[int, float]:
    """Send ``count`` messages (ids ``far-<i>``) due two days out, spread over 6 hours:
    far beyond the wheel's load window. Returns (first due ms, seconds to send), once
    replay has caught up and the manager's first look at the cursors has settled."""
    base = int(now_ms()) + 2 * DAY_MS
    spread = 6 * 3_600_000
    seconds = send_all(server.intake, range(count),
                       lambda i: base + i * spread // count, "far")  # fmt: skip
    log(f"memory: sent {count:,} in {seconds:.1f} s ({count / seconds:,.0f} msg/s)")
    server.wait_replayed()
    time.sleep(1)
    return base, seconds


def bench_memory_restart(count: int, parts: set[str]) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-delivery-") as data:
        server = Server(data)
        server.start()
        try:
            rss_empty = rss_mb(server.pid)
            base, seconds = fill_far_pending(server, count)
            rss = rss_mb(server.pid)
            load = load_average()
            if "memory" in parts:
                emit("rss_with_pending", rss, "MB", target="< 300", pending=count,
                     rss_empty_mb=round(rss_empty, 1), load_average=load)  # fmt: skip
                emit("send_rate", count / seconds, "msg/s", messages=count)
            if "restart" in parts:
                killed = time.perf_counter()
                server.kill()
                server.start()
                listening = time.perf_counter() - killed
                with delayd.Producer(server.intake, timeout_s=30) as producer:
                    producer.send(SUBJECT, BODY, at_ms=base, message_id="after-restart")
                served = time.perf_counter() - killed
                emit("restart_to_first_ack", served, "s", target="<= 2", pending=count,
                     listening_s=round(listening, 3), load_average=load_average())  # fmt: skip
                emit("rss_after_restart", rss_mb(server.pid), "MB", pending=count)
        finally:
            server.stop()


def run(cases: set[str], *, quick: bool, consumer: str, pending: int | None) -> None:
    """Run ``cases`` (of CASES), each in its full size or, ``quick``, its small one;
    ``consumer`` is the lateness case's (blocking or async), ``pending`` the memory
    and restart cases' message count (default by size)."""
    common.emit_host_speed(emit)
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > CLIENT_CPU:
        os.sched_setaffinity(0, {CLIENT_CPU})
    log(f"load average {load_average()}")
    if "lateness" in cases:
        bench_lateness(*((2_000, 2_000) if quick else (20_000, 10_000)), consumer)
    if "burst" in cases:
        bench_burst(50_000 if quick else 500_000)
    if cases & {"memory", "restart"}:
        bench_memory_restart(pending or (200_000 if quick else 10_000_000), cases)
