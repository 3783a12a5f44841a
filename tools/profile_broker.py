"""Where the broker's time goes: an in-process profile and a real-process benchmark.

Both speak the wire protocol through ``delayd.protocol.Connection`` only (no client
library), so they measure the broker and the codec, nothing else::

    python tools/profile_broker.py inproc [--messages N] [--cprofile] [--latency-s S]
    python tools/profile_broker.py procs [--repo DIR] [--messages N] [--in-flight K]
    python tools/profile_broker.py codec

``inproc`` opens an embedded ``Broker`` on a real on-disk store (``--flush sync``) in
this process and drives it the way the TCP server does, minus the sockets: SEND_BATCH
frames (100 messages of 100 bytes, ``--in-flight`` frames per group commit) through a
server Connection, ``append_batch``, ``wait_durable`` (fsync and reput), the encoded
answer; then a new group PULLs everything back (2000 per PULL) and a client Connection
decodes the answers. It prints the main thread's CPU time per message for each stage
(the fsyncs run in a worker thread and are not counted) and, with ``--cprofile``, the
top functions of each phase by own time.

``procs`` runs ``delayd broker`` as a child process pinned to CPU 0 (``taskset -c 0``)
and pins itself to CPU 1: produce throughput (one socket, ``--in-flight`` SEND_BATCH
frames pipelined), consume throughput (a new group, ``--pulls`` PULLs of 2000 in
flight, every message decoded), then produce -> long-poll consume latency (a producer
process sending one message per ms and waiting for each ack, this process
long-polling). ``--repo`` runs another checkout (the broker and the client codec both
come from it), for before/after comparisons. Broker CPU comes from /proc/PID/stat, so
``broker_cpu_us_per_msg`` is what the broker would sustain alone on an idle core
(1e6 / us msg/s) whatever else the machine was doing.

Every figure is one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

BODY_BYTES = 100
FRAME_MESSAGES = 100
PULL_MESSAGES = 2000
READY = re.compile(r"listening on (\S+):(\d+)")


def emit(**figures: object) -> None:
    print(json.dumps(figures), flush=True)


def process_cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid`` so far, all threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {cpu})


# --- in-process ---------------------------------------------------------------------------


class Stages:
    """Main-thread CPU time per named stage (time.thread_time: fsync threads excluded)."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}

    def timed(self, name: str, fn: Callable, *args: object) -> object:
        started = time.thread_time_ns()
        try:
            return fn(*args)
        finally:
            self.ns[name] = self.ns.get(name, 0) + time.thread_time_ns() - started

    async def timed_async(self, name: str, fn: Callable, *args: object) -> object:
        # Only the CPU of this thread counts; time spent waiting is not CPU.
        started = time.thread_time_ns()
        try:
            return await fn(*args)
        finally:
            self.ns[name] = self.ns.get(name, 0) + time.thread_time_ns() - started

    def report(self, phase: str, messages: int, wall_s: float) -> None:
        if "reput" in self.ns:  # timed inside "durable" (and the reput task): not twice
            self.ns["durable"] = self.ns.get("durable", 0) - self.ns["reput"]
        per = {name: round(ns / messages / 1000, 3) for name, ns in self.ns.items()}
        total = round(sum(self.ns.values()) / messages / 1000, 3)
        emit(
            phase=phase,
            messages=messages,
            wall_msg_per_s=round(messages / wall_s),
            cpu_us_per_msg=total,
            stages_us_per_msg=per,
        )


def _print_profile(profiler: cProfile.Profile | None, phase: str) -> None:
    if profiler is None:
        return
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
    print(f"--- {phase}: top functions by own time\n{out.getvalue()}", file=sys.stderr)


async def inproc(args: argparse.Namespace) -> None:
    import trio

    from delayd import protocol as wire
    from delayd.broker import Broker, BrokerConfig

    data = tempfile.mkdtemp(prefix="profile-broker-", dir=args.dir)
    try:
        config = BrokerConfig(
            recent_cache_bytes=args.cache_bytes, checkpoint_interval_ms=args.checkpoint_ms
        )
        broker = Broker.open(data, config)
        async with trio.open_nursery() as nursery:
            await nursery.start(broker.run)
            client, server = wire.Connection(wire.CLIENT), wire.Connection(wire.SERVER)

            def exchange(request: object, answer: Callable[[object], object]) -> object:
                server.receive_data(client.send(request))
                event = server.next_event()
                client.receive_data(server.send(answer(event)))
                return client.next_event()

            exchange(
                wire.Hello(client_name="profile", request_id=1),
                lambda e: wire.HelloOk(wire.PROTOCOL_VERSION, request_id=e.request_id),
            )

            # Produce: frames encoded up front, as a producer would have sent them.
            body = b"x" * BODY_BYTES
            frames = []
            for start in range(0, args.messages, FRAME_MESSAGES):
                batch = [
                    wire.Message(f"m-{i:012d}", "bench", body=body)
                    for i in range(start, min(args.messages, start + FRAME_MESSAGES))
                ]
                frames.append(
                    client.send(wire.SendBatch(batch, request_id=client.next_request_id()))
                )
            # The code being profiled may predate stored-bytes paths (--repo comparisons).
            encoded = hasattr(broker, "pull_encoded")

            def append(event: wire.SendBatch) -> list:
                if encoded:
                    return broker.append_batch(event.messages, broker.clock(), event.encoded)
                return broker.append_batch(event.messages, broker.clock())

            stages = Stages()
            profiler = cProfile.Profile() if args.cprofile else None
            store = broker.store
            # The reput pass on its own (it runs inside wait_durable or the reput task):
            # "durable" is then what waiting for the group commit costs the event loop.
            reput = store.reput_durable
            store.reput_durable = lambda: stages.timed("reput", reput)
            started = time.perf_counter()
            if profiler:
                profiler.enable()
            for group in range(0, len(frames), args.in_flight):
                answers = []
                for frame in frames[group : group + args.in_flight]:
                    server.receive_data(frame)
                    event = stages.timed("decode", server.next_event)
                    await store.make_room()
                    results = stages.timed("append", append, event)
                    answers.append(wire.SendBatchResult(results, request_id=event.request_id))
                await stages.timed_async("durable", store.wait_durable)
                for answer in answers:
                    stages.timed("encode_result", server.send, answer)
            if profiler:
                profiler.disable()
            stages.report("produce", args.messages, time.perf_counter() - started)
            _print_profile(profiler, "produce")
            # Consume: a new group PULLs everything back.
            joined = exchange(
                wire.JoinGroup("g", "bench", "c1", request_id=client.next_request_id()),
                lambda e: wire.JoinGroupResult(
                    broker.join(e.group, e.subject, e.consumer_id, None, broker.monotonic_ms()),
                    request_id=e.request_id,
                ),
            )
            assert joined.queues, joined
            stages = Stages()
            client_ns = 0
            profiler = cProfile.Profile() if args.cprofile else None
            got = 0
            started = time.perf_counter()
            if profiler:
                profiler.enable()
            while True:
                request = wire.Pull("bench", "g", "c1", PULL_MESSAGES, 0)
                server.receive_data(client.send(_with_id(request, client.next_request_id())))
                event = stages.timed("decode_pull", server.next_event)
                messages = await stages.timed_async(
                    "take",
                    broker.pull_encoded if encoded else broker.pull,
                    event.subject,
                    event.group,
                    event.consumer_id,
                    event.max_messages,
                    0,
                )
                frame = stages.timed(
                    "encode_pull_result",
                    server.send,
                    wire.PullResult(encoded=messages, request_id=event.request_id)
                    if encoded
                    else wire.PullResult(messages, request_id=event.request_id),
                )
                before = time.thread_time_ns()
                client.receive_data(frame)
                result = client.next_event()
                client_ns += time.thread_time_ns() - before
                got += len(result.messages)
                if not result.messages:
                    break
            if profiler:
                profiler.disable()
            stages.report("consume", got, time.perf_counter() - started)
            emit(phase="consume_client", client_decode_us_per_msg=round(client_ns / got / 1000, 3))
            _print_profile(profiler, "consume")
            assert got == args.messages, (got, args.messages)
            if args.latency_s:
                await inproc_latency(broker, args)
            nursery.cancel_scope.cancel()
    finally:
        shutil.rmtree(data, ignore_errors=True)


async def inproc_latency(broker, args: argparse.Namespace) -> None:
    """The latency case inside the broker's own event loop: a task stores one message
    per ``--interval-ms`` through ``send_batch`` while another long-polls; how long the
    commitlog fsyncs took (worker thread), send to ack, and send to delivery."""
    import trio

    from delayd.protocol import Message

    commitlog = broker.store.commitlog
    flush = commitlog.flush
    fsyncs: list[int] = []

    def timed_flush() -> int:
        started = time.perf_counter_ns()
        try:
            return flush()
        finally:
            fsyncs.append(time.perf_counter_ns() - started)

    commitlog.flush = timed_flush
    broker.join("lat", "latency", "c1", None, broker.monotonic_ms())
    count = int(args.latency_s * 1000 / args.interval_ms)
    acks: list[int] = []
    deliveries: list[int] = []

    async def produce() -> None:
        deadline = trio.current_time()
        for i in range(count):
            deadline += args.interval_ms / 1000
            await trio.sleep_until(deadline)
            stamp = time.perf_counter_ns()
            body = stamp.to_bytes(8, "little")
            await broker.send_batch([Message(f"lat-{i}", "latency", body=body)])
            acks.append(time.perf_counter_ns() - stamp)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        while len(deliveries) < count:
            got = await broker.pull("latency", "lat", "c1", 100, 2000)
            now = time.perf_counter_ns()
            deliveries += [now - int.from_bytes(m.body, "little") for m in got]
    skip = int(1000 / args.interval_ms)

    def q(samples: list[int]) -> dict[str, float]:
        cuts = statistics.quantiles(sorted(samples[skip:]), n=1000)
        return {f"p{p / 10:g}_ms": round(cuts[p - 1] / 1e6, 3) for p in (500, 900, 990, 999)}

    emit(
        phase="latency",
        messages=count - skip,
        fsync=q(fsyncs),
        send_to_ack=q(acks),
        send_to_delivery=q(deliveries),
    )


def _with_id(request, request_id: int):
    import dataclasses

    return dataclasses.replace(request, request_id=request_id)


def codec(args: argparse.Namespace) -> None:
    """The codec alone: best of several timings of each hot encode/decode, per message."""
    import timeit

    from delayd.protocol import (
        Command,
        FrameDecoder,
        Message,
        PullResult,
        ResultCode,
        SendBatch,
        SendBatchResult,
        SendResult,
        decode_event,
        encode_event,
    )

    def best_us(fn: Callable[[], object], number: int, per: int) -> float:
        return round(min(timeit.repeat(fn, number=number, repeat=7)) / number / per * 1e6, 3)

    decoder = FrameDecoder(1 << 30)

    def decode(frame: bytes) -> Callable[[], object]:
        def run() -> object:
            decoder.feed(frame)
            got = decoder.next_frame()
            return decode_event(Command(got.command), got.flags, got.request_id, got.body)

        return run

    body = b"x" * BODY_BYTES
    batch = [Message(f"id-{i:08d}", "bench", body=body) for i in range(FRAME_MESSAGES)]
    stored = [
        Message(
            f"id-{i:08d}",
            "bench",
            body=body,
            store_ms=1_700_000_000_000,
            commitlog_offset=i * 200,
            queue=i % 4,
            queue_offset=i,
        )
        for i in range(PULL_MESSAGES)
    ]
    results = [
        SendResult(ResultCode.OK, "", 1_700_000_000_000, i * 200, i % 4, i)
        for i in range(FRAME_MESSAGES)
    ]
    send_batch = encode_event(SendBatch(batch, request_id=1))
    pull_result = encode_event(PullResult(stored, request_id=1))
    batch_result = encode_event(SendBatchResult(results, request_id=1))
    n = FRAME_MESSAGES
    emit(
        phase="codec",
        us_per_msg={
            "encode_send_batch": best_us(
                lambda: encode_event(SendBatch(batch, request_id=1)), 300, n
            ),
            "decode_send_batch": best_us(decode(send_batch), 300, n),
            "encode_pull_result": best_us(
                lambda: encode_event(PullResult(stored, request_id=1)), 20, PULL_MESSAGES
            ),
            "decode_pull_result": best_us(decode(pull_result), 20, PULL_MESSAGES),
            "encode_send_batch_result": best_us(
                lambda: encode_event(SendBatchResult(results, request_id=1)), 300, n
            ),
            "decode_send_batch_result": best_us(decode(batch_result), 300, n),
        },
    )


# --- real processes ----------------------------------------------------------------------


class BrokerProcess:
    """``delayd broker`` from ``repo``, pinned to CPU 0."""

    def __init__(self, repo: Path, data: str, extra: list[str], profile: str | None) -> None:
        env = dict(os.environ, PYTHONPATH=str(repo))
        args = [sys.executable, "-m", "delayd", "broker", "--data", data]
        if profile:
            args[1:1] = ["-m", "cProfile", "-o", profile]
        args += ["--listen", "127.0.0.1:0", "--metrics-listen", "off", "--log-level", "warning"]
        if shutil.which("taskset") and (os.cpu_count() or 1) >= 2:
            args = ["taskset", "-c", "0", *args]
        # cwd outside any checkout: ``python -m`` puts the cwd first on sys.path.
        self.proc = subprocess.Popen(
            [*args, *extra], stdout=subprocess.PIPE, text=True, env=env, cwd="/"
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = READY.search(line)
        if not match:
            self.proc.kill()
            raise RuntimeError(f"broker did not start: {line!r}")
        self.address = (match.group(1), int(match.group(2)))

    @property
    def cpu_s(self) -> tuple[float, float]:
        return process_cpu_s(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class RawClient:
    """One Connection(CLIENT) over a blocking socket; requests may be pipelined."""

    def __init__(self, address: tuple[str, int], name: str) -> None:
        from delayd.protocol import CLIENT, Connection, Hello

        self.sock = socket.create_connection(address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = Connection(CLIENT)
        self.request(Hello(client_name=name))

    def send(self, request) -> int:
        request_id = self.conn.next_request_id()
        self.sock.sendall(self.conn.send(_with_id(request, request_id)))
        return request_id

    def next(self):
        from delayd.protocol import NEED_DATA

        while True:
            event = self.conn.next_event()
            if event is not NEED_DATA:
                return event
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the broker closed the connection")
            self.conn.receive_data(data)

    def request(self, request):
        request_id = self.send(request)
        event = self.next()
        assert event.request_id == request_id, event
        return event

    def close(self) -> None:
        self.sock.close()


def fsyncs(client: RawClient) -> int:
    from delayd.protocol import Stats

    return int(client.request(Stats()).stats["broker.fsyncs_total"])


def broker_cpu(broker: BrokerProcess, before: tuple[float, float], messages: int) -> dict:
    user, system = (now - then for now, then in zip(broker.cpu_s, before, strict=True))
    return {
        "broker_cpu_us_per_msg": round((user + system) / messages * 1e6, 2),
        "broker_user_us_per_msg": round(user / messages * 1e6, 2),
        "broker_sys_us_per_msg": round(system / messages * 1e6, 2),
    }


def bench_produce(broker: BrokerProcess, args: argparse.Namespace, subject: str) -> None:
    from delayd.protocol import Message, ResultCode, SendBatch, SendBatchResult

    client = RawClient(broker.address, "produce")
    body = b"x" * BODY_BYTES
    frames = []
    for start in range(0, args.messages, FRAME_MESSAGES):
        batch = [
            Message(f"{subject}-{i:012d}", subject, body=body)
            for i in range(start, min(args.messages, start + FRAME_MESSAGES))
        ]
        request_id = client.conn.next_request_id()
        frames.append(client.conn.send(SendBatch(batch, request_id=request_id)))
    fsyncs_before = fsyncs(client)
    cpu_before, client_before = broker.cpu_s, time.process_time()
    started = time.perf_counter()
    sent = answered = 0
    while answered < len(frames):
        while sent < len(frames) and sent - answered < args.in_flight:
            client.sock.sendall(frames[sent])
            sent += 1
        answer = client.next()
        assert isinstance(answer, SendBatchResult), answer
        assert all(r.code is ResultCode.OK for r in answer.results), answer.results[:3]
        answered += 1
    wall = time.perf_counter() - started
    client_cpu = time.process_time() - client_before
    emit(
        case="produce",
        messages=args.messages,
        in_flight=args.in_flight,
        msg_per_s=round(args.messages / wall),
        **broker_cpu(broker, cpu_before, args.messages),
        client_cpu_us_per_msg=round(client_cpu / args.messages * 1e6, 2),
        fsyncs=fsyncs(client) - fsyncs_before,
    )
    client.close()


def bench_consume(broker: BrokerProcess, args: argparse.Namespace, subject: str) -> None:
    from delayd.protocol import JoinGroup, Pull, PullResult

    client = RawClient(broker.address, "consume")
    client.request(JoinGroup("bench", subject, "c1"))
    cpu_before, client_before = broker.cpu_s, time.process_time()
    started = time.perf_counter()
    got = outstanding = 0
    empty = False
    while outstanding or not empty:
        while not empty and outstanding < args.pulls:
            client.send(Pull(subject, "bench", "c1", PULL_MESSAGES, 0))
            outstanding += 1
        answer = client.next()
        assert isinstance(answer, PullResult), answer
        outstanding -= 1
        got += len(answer.messages)
        empty = empty or not answer.messages
    wall = time.perf_counter() - started
    client_cpu = time.process_time() - client_before
    assert got == args.messages, (got, args.messages)
    emit(
        case="consume",
        messages=got,
        pulls_in_flight=args.pulls,
        msg_per_s=round(got / wall),
        **broker_cpu(broker, cpu_before, got),
        client_cpu_us_per_msg=round(client_cpu / got * 1e6, 2),
    )
    client.close()


def latency_producer(args: argparse.Namespace) -> None:
    """The producer half of the latency case (a child process): one message per
    ``--interval-ms``, each in its own SEND_BATCH, waiting for the ack; the body is the
    send start time (CLOCK_MONOTONIC ns, comparable across processes)."""
    from delayd.protocol import Message, ResultCode, SendBatch

    pin(1)
    from delayd.address import parse_address

    client = RawClient(parse_address(args.address), "latency-producer")
    interval = args.interval_ms / 1000
    deadline = time.monotonic()
    acks: list[int] = []
    for i in range(args.count):
        deadline += interval
        now = time.monotonic()
        if deadline > now:
            time.sleep(deadline - now)
        stamp = time.monotonic_ns()
        message = Message(f"lat-{i}", "latency", body=stamp.to_bytes(8, "little"))
        answer = client.request(SendBatch([message]))
        acks.append(time.monotonic_ns() - stamp)
        assert answer.results[0].code is ResultCode.OK, answer
    client.close()
    # The ack comes after the fsync and the reput: delivery minus ack is the wake-up path.
    q = statistics.quantiles(sorted(acks[int(1000 / args.interval_ms) :]), n=100)
    emit(case="latency_ack", p50_ms=round(q[49] / 1e6, 3), p99_ms=round(q[98] / 1e6, 3))


def bench_latency(broker: BrokerProcess, args: argparse.Namespace) -> None:
    from delayd.protocol import JoinGroup, Pull, PullResult

    count = int(args.latency_s * 1000 / args.interval_ms)
    consumer = RawClient(broker.address, "latency-consumer")
    consumer.request(JoinGroup("lat", "latency", "c1"))
    producer = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "latency-producer",
            "--address",
            "{}:{}".format(*broker.address),
            "--count",
            str(count),
            "--interval-ms",
            str(args.interval_ms),
        ],
        env=dict(os.environ, PYTHONPATH=str(args.repo)),
        cwd="/",
    )
    fsyncs_before = fsyncs(consumer)
    latencies: list[int] = []
    while len(latencies) < count:
        answer = consumer.request(Pull("latency", "lat", "c1", 100, 2000))
        now = time.monotonic_ns()
        assert isinstance(answer, PullResult), answer
        if not answer.messages and producer.poll() is not None:
            break
        latencies += [now - int.from_bytes(m.body, "little") for m in answer.messages]
    producer.wait()
    if len(latencies) < count:
        raise RuntimeError(f"received {len(latencies)} of {count} messages")
    # Skip the first second: connection set-up and warm-up.
    steady = sorted(latencies[int(1000 / args.interval_ms) :])
    q = statistics.quantiles(steady, n=1000)
    emit(
        case="latency",
        messages=len(steady),
        rate_per_s=round(1000 / args.interval_ms),
        p50_ms=round(q[499] / 1e6, 3),
        p90_ms=round(q[899] / 1e6, 3),
        p99_ms=round(q[989] / 1e6, 3),
        p999_ms=round(q[998] / 1e6, 3),
        max_ms=round(steady[-1] / 1e6, 3),
        fsyncs=fsyncs(consumer) - fsyncs_before,
    )
    consumer.close()


def procs(args: argparse.Namespace) -> None:
    pin(1)
    data = tempfile.mkdtemp(prefix="profile-broker-", dir=args.dir)
    broker = BrokerProcess(args.repo, data, args.broker_arg, args.broker_profile)
    try:
        emit(case="setup", repo=str(args.repo), broker_address="{}:{}".format(*broker.address))
        for round_ in range(args.rounds):
            subject = f"bench{round_}"
            if args.messages:
                bench_produce(broker, args, subject)
                bench_consume(broker, args, subject)
        if args.latency_s:
            bench_latency(broker, args)
    finally:
        broker.stop()
        shutil.rmtree(data, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inproc", help="in-process profile of the embedded broker")
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--in-flight", type=int, default=8, help="SEND_BATCH frames per fsync")
    p.add_argument("--cache-bytes", type=int, default=64 * 1024 * 1024)
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--latency-s", type=float, default=0.0, help="then the latency case")
    p.add_argument("--checkpoint-ms", type=int, default=1000, help="reput checkpoint interval")
    p.add_argument("--interval-ms", type=float, default=1.0)
    p.add_argument("--dir", default=None, help="where the data directory goes")
    p = sub.add_parser("procs", help="a broker process and a raw client process")
    p.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    p.add_argument("--messages", type=int, default=300_000)
    p.add_argument("--in-flight", type=int, default=8, help="SEND_BATCH frames in flight")
    p.add_argument("--pulls", type=int, default=2, help="PULLs in flight")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--latency-s", type=float, default=20.0)
    p.add_argument("--interval-ms", type=float, default=1.0)
    p.add_argument("--broker-arg", action="append", default=[], help="extra broker flag")
    p.add_argument("--broker-profile", help="run the broker under cProfile, stats to this file")
    p.add_argument("--dir", default=None, help="where the data directory goes")
    sub.add_parser("codec", help="the protocol codec alone, best-of timings")
    p = sub.add_parser("latency-producer")
    p.add_argument("--address", required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--interval-ms", type=float, default=1.0)
    args = parser.parse_args()
    if args.command == "inproc":
        import trio

        trio.run(inproc, args)
    elif args.command == "procs":
        procs(args)
    elif args.command == "codec":
        codec(args)
    else:
        latency_producer(args)


if __name__ == "__main__":
    main()
