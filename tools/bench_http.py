"""HTTP API benchmark: acknowledged schedule throughput over HTTP (one message per
request, and batches of 100), and the binary intake with the HTTP listener off
against on and idle.

Prints one JSON object per figure on stdout:
    {"bench": "http", "metric": ..., "value": ..., "unit": ..., ...}

    python tools/bench_http.py            # the figures of docs/benchmarks.md
    python tools/bench_http.py --quick    # the same cases, smaller (< 1 minute)

As tools/bench_intake.py: sync flush, 100-byte bodies, delays spread over an hour, the
server pinned to CPU 0 and the client to CPU 1 (``taskset``). The HTTP client is
httpx on trio with ``--in-flight`` requests outstanding over keep-alive connections;
it is Python too, so ``server_cpu_per_message`` (the server's own CPU time) is the
figure that says what the HTTP path costs. The idle comparison runs bench_intake's raw
binary client against a server without the HTTP listener and one with it listening
(nobody connects), alternating, and reports each run and the medians.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_common
import bench_intake

ROOT = Path(__file__).resolve().parent.parent
SERVER_CPU, CLIENT_CPU = bench_intake.SERVER_CPU, bench_intake.CLIENT_CPU
HOUR_MS = 3_600_000
BODY = "b" * 100
HTTP = re.compile(r"delayd serve http on (http://\S+:\d+)/v1")

emit = bench_common.emitter("http")


# ----------------------------------------------------------------------------- client


def http_client_main(args: argparse.Namespace) -> None:
    """Send ``args.messages`` messages in requests of ``args.batch`` (1: POST
    /v1/messages, else POST /v1/batches), ``args.in_flight`` at a time; prints the
    count acknowledged and the seconds it took."""
    import httpx
    import trio

    rng = random.Random(2)
    requests = []
    for n in range(args.messages // args.batch):
        messages = [
            {"subject": "bench", "id": f"h-{n}-{i}", "delay": rng.randrange(HOUR_MS), "body": BODY}
            for i in range(args.batch)
        ]
        if args.batch == 1:
            requests.append(("/v1/messages", json.dumps(messages[0]).encode()))
        else:
            requests.append(("/v1/batches", json.dumps({"messages": messages}).encode()))
    acked = 0

    async def worker(client: httpx.AsyncClient, queue: list) -> None:
        nonlocal acked
        headers = {"Content-Type": "application/json"}
        while queue:
            path, body = queue.pop()
            response = await client.post(path, content=body, headers=headers)
            if response.status_code not in (200, 201):
                raise RuntimeError(f"{path}: {response.status_code} {response.text}")
            acked += args.batch if args.batch == 1 else response.json()["scheduled"]

    async def run() -> float:
        limits = httpx.Limits(max_connections=args.in_flight)
        async with httpx.AsyncClient(base_url=args.addr, limits=limits, timeout=60) as client:
            warmup = requests[:5]
            del requests[:5]
            async with trio.open_nursery() as nursery:
                for _ in range(min(len(warmup), args.in_flight)):
                    nursery.start_soon(worker, client, warmup)
            nonlocal acked
            acked = 0
            started = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for _ in range(args.in_flight):
                    nursery.start_soon(worker, client, requests)
            return time.perf_counter() - started

    seconds = trio.run(run)
    print(json.dumps({"acked": acked, "seconds": seconds}))


def run_http_client(url: str, messages: int, batch: int, in_flight: int) -> dict:
    args = [sys.executable, __file__, "http-client", "--addr", url, "--messages",
            str(messages), "--batch", str(batch), "--in-flight", str(in_flight)]  # fmt: skip
    return bench_intake.run_pinned_client(CLIENT_CPU, args)


# ----------------------------------------------------------------------------- server


def start_delayd(data: str, http: bool) -> tuple[subprocess.Popen, str, str | None]:
    """``delayd serve`` pinned to SERVER_CPU; (process, binary address, HTTP base URL)."""
    extra = ("--http-listen", "127.0.0.1:0") if http else ()
    proc, addr, out = bench_intake.launch_delayd(data, extra=extra)
    url = HTTP.search(out)
    return proc, addr, url.group(1) if url else None


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


# ----------------------------------------------------------------------------- figures


def bench_http_throughput(cases: list[tuple[int, int, int]]) -> None:
    """(batch, in_flight, messages) per case, each on a fresh server."""
    for batch, in_flight, messages in cases:
        with tempfile.TemporaryDirectory(prefix="bench-http-") as data:
            proc, _, url = start_delayd(data, http=True)
            assert url is not None
            try:
                cpu_before = bench_intake.cpu_seconds(proc.pid)
                result = run_http_client(url, messages, batch, in_flight)
                cpu = bench_intake.cpu_seconds(proc.pid) - cpu_before
            finally:
                stop(proc)
        name = "one_per_request" if batch == 1 else f"batches_of_{batch}"
        emit(f"http_acked_throughput_{name}", result["acked"] / result["seconds"], "msg/s",
             in_flight_requests=in_flight, messages=result["acked"])  # fmt: skip
        emit(f"http_server_cpu_per_message_{name}", cpu / result["acked"] * 1e6, "us",
             in_flight_requests=in_flight)  # fmt: skip


def bench_binary_with_http_idle(rounds: int, messages: int) -> None:
    """bench_intake's binary client (16 batches of 100 in flight) against a server
    with the HTTP listener off and one with it on and idle, alternating."""
    figures: dict[str, list[float]] = {"off": [], "on_idle": []}
    cpu: dict[str, list[float]] = {"off": [], "on_idle": []}
    for round_number in range(rounds):
        for mode in ("off", "on_idle") if round_number % 2 == 0 else ("on_idle", "off"):
            with tempfile.TemporaryDirectory(prefix="bench-http-idle-") as data:
                proc, addr, _ = start_delayd(data, http=mode == "on_idle")
                try:
                    cpu_before = bench_intake.cpu_seconds(proc.pid)
                    result = bench_intake.run_client("client", addr, messages, 16)
                    used = bench_intake.cpu_seconds(proc.pid) - cpu_before
                finally:
                    stop(proc)
            throughput = result["acked"] / result["seconds"]
            figures[mode].append(throughput)
            cpu[mode].append(used / result["acked"] * 1e6)
            emit("binary_acked_throughput", throughput, "msg/s", http_listener=mode,
                 round=round_number, in_flight_batches=16)  # fmt: skip
    for mode in figures:
        emit("binary_acked_throughput_median", statistics.median(figures[mode]), "msg/s",
             http_listener=mode, rounds=rounds)  # fmt: skip
        emit("binary_server_cpu_per_message_median", statistics.median(cpu[mode]), "us",
             http_listener=mode, rounds=rounds)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", nargs="?", default="bench", choices=["bench", "http-client"])
    parser.add_argument("--quick", action="store_true", help="smaller runs (< 1 minute)")
    parser.add_argument("--addr", help=argparse.SUPPRESS)
    parser.add_argument("--messages", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--in-flight", type=int, default=16, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode == "http-client":
        http_client_main(args)
        return
    bench_common.emit_host_speed(emit)
    scale = 1 if args.quick else 5
    bench_http_throughput([(1, 16, 2_000 * scale), (100, 4, 20_000 * scale)])
    bench_binary_with_http_idle(rounds=4 if args.quick else 10, messages=20_000 * scale)


if __name__ == "__main__":
    main()
