"""Intake benchmark: acknowledged throughput of ``delayd serve`` (sync flush), replay
catch-up, and the same workload on Redis (ZADD + HSET, appendfsync always).

Prints one JSON object per figure on stdout:
    {"bench": "intake", "metric": ..., "value": ..., "unit": ..., ...}

    python tools/bench_intake.py            # the figures of docs/benchmarks.md
    python tools/bench_intake.py --quick    # the same cases, smaller (< 1 minute)

Workload: 100-byte bodies, batches of 100 messages, delays spread over one hour (60
buckets at segment_scale 1), one client process. The server runs pinned to one CPU with
``taskset`` and the client to another (placement alone moves figures ~2x on a 2-CPU
machine), and so do redis-server and its client. The delayd client is a raw protocol
client that encodes its frames before the clock starts and keeps ``--in-flight``
SEND_BATCHes outstanding on one connection: the figure is the server's. Redis gets
one pipeline of 100 messages (200 commands) per round trip; with ``appendfsync
always`` it fsyncs once per event-loop pass, as delayd's group commit does.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_common

ROOT = bench_common.ROOT

from delayd.address import parse_address  # noqa: E402
from delayd.bench.raw_client import RawClient  # noqa: E402
from delayd.protocol import (  # noqa: E402
    Message,
    ResultCode,
    SendBatch,
    SendBatchResult,
    encode_event,
)

BODY = b"b" * 100
BATCH = 100
SERVER_CPU = "0"
CLIENT_CPU = "1"
READY = re.compile(r"delayd serve listening on (\S+):(\d+)")
HOUR_MS = 3_600_000


emit = bench_common.emitter("intake")


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU time of process ``pid`` so far (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc), in seconds."""
    return sum(cpu_times(pid))


def pinned(cpu: str, args: list[str]) -> list[str]:
    return ["taskset", "-c", cpu, *args] if shutil.which("taskset") else args


def run_pinned_client(cpu: str, args: list[str]) -> dict:
    """Run a benchmark's client process pinned to ``cpu``; the JSON result it printed
    last. A client that fails stops the benchmark with the client's own error (its
    stderr), not only its exit status."""
    done = subprocess.run(pinned(cpu, args), capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"client {args[2:4]} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- client


class IntakeClient(RawClient):
    """The raw client, plus pipelined SEND_BATCH frames encoded before the clock starts."""

    def frames(self, count: int, seed: int, delays_from_ms: int = 0) -> list[bytes]:
        """``count`` SEND_BATCH frames of BATCH messages with unique ids, delays spread
        over the hour that begins ``delays_from_ms`` from now."""
        rng = random.Random(seed)
        out = []
        for _ in range(count):
            request_id = self.next_request_id()
            messages = [
                Message(f"m-{seed}-{request_id}-{i}", "orders", body=BODY,
                        delay_ms=delays_from_ms + rng.randrange(HOUR_MS))
                for i in range(BATCH)
            ]  # fmt: skip
            out.append(encode_event(SendBatch(messages, request_id=request_id)))
        return out

    def send_all(self, frames: list[bytes], in_flight: int) -> tuple[int, float]:
        """Send every frame keeping ``in_flight`` outstanding; (messages acked, seconds)."""
        acked = 0
        sent = 0
        pending = 0
        started = time.perf_counter()
        while sent < len(frames) or pending:
            while pending < in_flight and sent < len(frames):
                self.sock.sendall(frames[sent])
                sent += 1
                pending += 1
            answer = self.receive()
            assert isinstance(answer, SendBatchResult), answer
            pending -= 1
            acked += sum(1 for r in answer.results if r.code is ResultCode.OK)
        return acked, time.perf_counter() - started


def client_main(args: argparse.Namespace) -> None:
    client = IntakeClient(*parse_address(args.addr), "bench-intake", tls_ca=args.tls_ca)
    # Ids carry the seed: each run against one server sends new ones (the server answers
    # a repeated id DUPLICATE, which the figure does not count).
    warmup = client.frames(20, seed=-args.seed, delays_from_ms=args.delays_from_ms)
    client.send_all(warmup, args.in_flight)
    frames = client.frames(args.messages // BATCH, args.seed, args.delays_from_ms)
    acked, seconds = client.send_all(frames, args.in_flight)
    last_ack = time.perf_counter()
    lag_at_end = client.stats()["replay.lag_records"]
    while client.stats()["replay.lag_records"]:
        pass
    caught_up = time.perf_counter() - last_ack
    print(json.dumps({"acked": acked, "seconds": seconds, "lag_at_end": lag_at_end,
                      "catch_up_s": caught_up}))  # fmt: skip


def redis_client_main(args: argparse.Namespace) -> None:
    import redis

    r = redis.Redis(port=parse_address(args.addr).port)
    rng = random.Random(3)
    now = int(time.time() * 1000)
    rounds = [
        [(f"m-{n}-{i}", now + rng.randrange(HOUR_MS)) for i in range(BATCH)]
        for n in range(args.messages // BATCH)
    ]
    started = time.perf_counter()
    for batch in rounds:
        pipe = r.pipeline(transaction=False)
        for message_id, due in batch:
            pipe.zadd("delayd:due", {message_id: due})
            pipe.hset("delayd:body", message_id, BODY)
        pipe.execute()
    seconds = time.perf_counter() - started
    print(json.dumps({"acked": len(rounds) * BATCH, "seconds": seconds}))


_seeds = itertools.count(2)  # one per client run by this process


def run_client(
    mode: str,
    addr: str,
    messages: int,
    in_flight: int = 1,
    tls_ca: str | None = None,
    cpu: str = CLIENT_CPU,
    delays_from_ms: int = 0,
) -> dict:
    """Run the client ``mode`` in a process of its own pinned to ``cpu``; its result.
    Each call sends new message ids (a server answers a repeated one DUPLICATE), due
    over the hour that begins ``delays_from_ms`` from now."""
    args = [sys.executable, __file__, mode, "--addr", addr, "--messages", str(messages),
            "--in-flight", str(in_flight), "--seed", str(next(_seeds)),
            "--delays-from-ms", str(delays_from_ms)]  # fmt: skip
    if tls_ca is not None:
        args += ["--tls-ca", tls_ca]
    return run_pinned_client(cpu, args)


# ----------------------------------------------------------------------------- servers


def start_delayd(
    data: str, repo: Path = ROOT, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str]:
    """``delayd serve`` from checkout ``repo`` with the flags ``extra``, pinned to
    SERVER_CPU; (process, address)."""
    proc, addr, _ = launch_delayd(data, repo, extra)
    return proc, addr


def launch_delayd(
    data: str, repo: Path = ROOT, extra: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, str, str]:
    """As start_delayd, and what the server printed until it listened (the addresses
    of its other listeners)."""
    config = Path(data) / "bench.toml"
    config.write_text("[intake]\nmax_pending_acks = 1000000\nmax_replay_lag_records = 10000000\n")
    args = [sys.executable, "-m", "delayd", "serve", "--data", str(Path(data) / "d"),
            "--config", str(config), "--listen", "127.0.0.1:0", "--broker-listen", "off",
            "--log-level", "warning", *extra]  # fmt: skip
    for flag in ("--metrics-listen", "--http-listen"):  # the default ports may be taken
        if flag not in extra and flag in _serve_help(repo):
            args += [flag, "off"]
    env = dict(os.environ, PYTHONPATH=str(repo))
    proc = subprocess.Popen(pinned(SERVER_CPU, args), cwd=repo, stdout=subprocess.PIPE, env=env)
    out = ""
    deadline = time.monotonic() + 30
    while (match := READY.search(out)) is None:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            proc.kill()
            raise RuntimeError(f"delayd serve did not start: {out!r}")
        data = os.read(proc.stdout.fileno(), 65536)
        if not data:
            proc.wait()
            raise RuntimeError(f"delayd serve exited ({proc.returncode}) before listening: {out!r}")
        out += data.decode()
    return proc, f"{match.group(1)}:{match.group(2)}", out


def _serve_help(repo: Path) -> str:
    """``delayd serve --help`` of checkout ``repo`` (older checkouts lack some flags)."""
    env = dict(os.environ, PYTHONPATH=str(repo))
    args = [sys.executable, "-m", "delayd", "serve", "--help"]
    return subprocess.run(args, cwd=repo, env=env, capture_output=True, text=True).stdout


def bench_delayd(messages: int, in_flight_cases: list[tuple[int, int]], repo: Path = ROOT) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-intake-") as data:
        proc, addr = start_delayd(data, repo)
        try:
            for in_flight, count in [(16, messages), *in_flight_cases]:
                cpu_before = cpu_seconds(proc.pid)
                result = run_client("client", addr, count, in_flight)
                cpu = cpu_seconds(proc.pid) - cpu_before
                emit("acked_throughput_sync", result["acked"] / result["seconds"], "msg/s",
                     in_flight_batches=in_flight, messages=result["acked"])  # fmt: skip
                # Independent of what else runs on the machine: the server's own cost.
                emit("server_cpu_per_message", cpu / result["acked"] * 1e6, "us",
                     in_flight_batches=in_flight)  # fmt: skip
                emit(
                    "replay_catch_up_after_senders_stop",
                    result["catch_up_s"],
                    "s",
                    lag_records_at_last_ack=result["lag_at_end"],
                    in_flight_batches=in_flight,
                )
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def bench_redis(messages: int) -> None:
    server = shutil.which("redis-server")
    try:
        import redis  # noqa: F401
    except ImportError:
        server = None
    if server is None:
        print("redis comparison skipped: redis-server or the redis package is missing "
              "(apt-get install -y redis-server; pip install redis)", file=sys.stderr)  # fmt: skip
        emit("redis_zadd_hset_throughput", 0, "msg/s", skipped="redis-server not installed")
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="bench-redis-") as data:
        args = [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", data,
                "--save", "", "--appendonly", "yes", "--appendfsync", "always"]  # fmt: skip
        proc = subprocess.Popen(pinned(SERVER_CPU, args), stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port)).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)  # polling a port coming up; nothing to wait on
            cpu_before = cpu_seconds(proc.pid)
            result = run_client("redis-client", f"127.0.0.1:{port}", messages)
            cpu = cpu_seconds(proc.pid) - cpu_before
            emit("redis_zadd_hset_throughput", result["acked"] / result["seconds"], "msg/s",
                 appendfsync="always", per_round_trip=BATCH, messages=result["acked"])  # fmt: skip
            emit("redis_server_cpu_per_message", cpu / result["acked"] * 1e6, "us")
        finally:
            bench_common.stop_process(proc, 30)


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "smaller runs (< 1 minute)")
    parser.add_argument("mode", nargs="?", default="bench",
                        choices=["bench", "client", "redis-client"])  # fmt: skip
    parser.add_argument("--addr", help=argparse.SUPPRESS)
    parser.add_argument("--messages", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--in-flight", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--tls-ca", help=argparse.SUPPRESS)
    parser.add_argument("--delays-from-ms", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--repo",
        type=Path,
        default=ROOT,
        help="run the server from this checkout (before/after comparisons)",
    )
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis comparison")
    parser.add_argument(
        "--only-16", action="store_true", help="only the 16-in-flight case (A/B runs)"
    )
    args = parser.parse_args()
    if args.mode == "client":
        client_main(args)
        return
    if args.mode == "redis-client":
        redis_client_main(args)
        return
    bench_common.emit_host_speed(emit)
    messages, cases, redis_messages = 2_000_000, [(1, 100_000), (4, 300_000)], 300_000
    if args.quick:
        messages, cases, redis_messages = 300_000, [(1, 30_000)], 50_000
    bench_delayd(messages, [] if args.only_16 else cases, args.repo)
    if not args.no_redis:
        bench_redis(redis_messages)


if __name__ == "__main__":
    main()
