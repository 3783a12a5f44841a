"""Burst across a cluster (issue 21): N messages due in the same second, spread over 2
delay groups, delivered to 2 broker groups the delay servers find in etcd; how long
after the due second the last one is stored in a broker (target: 1,000,000 within 10 s).

Prints one JSON object per figure on stdout:
    {"bench": "brokerdisc", "metric": ..., "value": ..., "unit": ..., ...}

    python tools/bench_brokerdisc.py            # 1,000,000 messages (500,000 per delay group)
    python tools/bench_brokerdisc.py --quick    # 100,000 (about a minute)

Processes, none pinned (2 delay servers, 2 brokers and etcd share the host's cores): an
etcd (tests/etcd_support.py), two ``delayd broker`` groups of one member each
(``--etcd --group bN --cluster C``), two ``delayd serve`` delay groups of one member each
with ``[delivery] broker_groups_from = "etcd"``. The messages are sent through each delay
server's intake (public blocking Producer, batches of 10,000, both delay groups at once),
due within one second that starts a margin after the sends are expected to end. "Stored"
is read from the brokers' STATS (``broker.messages_stored_total``, polled every 50 ms):
the figure is the first poll that finds them all, minus the start of the due second.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import bench_common

from delayd.address import parse_address
from delayd.bench.delivery import CONFIG, Server, cpu_seconds, load_average, now_ms, send_all
from delayd.bench.raw_client import RawClient
from tests.etcd_support import EtcdServer

emit = bench_common.emitter("brokerdisc")
CLUSTER = "bench"
BROKER_READY = re.compile(r"delayd broker listening on (\S+):(\d+)")
MEMBER_ENV = {
    "DELAYD_CLUSTER_REPLICATION_LISTEN": "127.0.0.1:0",  # two members per host
    "DELAYD_CLUSTER_ACK": "leader",  # a group of one member acknowledges alone
    # Five processes on a shared host: a leader starved of CPU for a second must not
    # step down in the middle of the burst (each group has one member: nobody to fail
    # over to anyway).
    "DELAYD_CLUSTER_LEASE_TTL_MS": "10000",
}
SEND_RATE = 25_000  # msg/s per delay group assumed when placing the due second
MARGIN_MS = 8_000


def log(text: str) -> None:
    print(f"# {text}", file=sys.stderr, flush=True)


class Broker:
    """One ``delayd broker`` process, a broker group of one member."""

    def __init__(self, data: Path, group: str, etcd: str) -> None:
        args = [sys.executable, "-m", "delayd", "broker", "--data", str(data),
                "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--log-level", "warning",
                "--etcd", etcd, "--group", group, "--cluster", CLUSTER]  # fmt: skip
        env = {**os.environ, **MEMBER_ENV}
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, env=env)
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline().decode() if ready else ""
        match = BROKER_READY.search(line)
        if match is None:
            self.proc.kill()
            raise RuntimeError(f"delayd broker did not start: {line!r}")
        self.address = f"{match.group(1)}:{match.group(2)}"

    def stored(self) -> int:
        with RawClient(*parse_address(self.address), "bench-brokerdisc") as client:
            return int(client.stats()["broker.messages_stored_total"])

    def stop(self) -> None:
        bench_common.stop_process(self.proc, 30)


def bench(count: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-brokerdisc-") as data:
        root = Path(data)
        etcd = EtcdServer(root / "etcd").start()
        brokers: list[Broker] = []
        servers: list[Server] = []
        try:
            brokers = [Broker(root / f"b{n}", f"b{n}", etcd.url) for n in (1, 2)]
            config = CONFIG + '[delivery]\nbroker_groups_from = "etcd"\n'
            for n in (1, 2):
                (root / f"d{n}").mkdir()
                flags = ("--etcd", etcd.url, "--group", f"d{n}", "--cluster", CLUSTER)
                server = Server(
                    str(root / f"d{n}"),
                    config=config,
                    extra=flags,
                    env={**os.environ, **MEMBER_ENV},
                    cpu=None,
                )
                server.start()
                servers.append(server)
            half = count // 2
            due = int(now_ms()) + half * 1000 // SEND_RATE + MARGIN_MS
            seconds: list[float] = []

            def send(server: Server, prefix: str) -> None:
                at_ms = lambda i: due + i * 1000 // half  # noqa: E731
                seconds.append(send_all(server.intake, range(half), at_ms, prefix))

            threads = [
                threading.Thread(target=send, args=(server, f"d{n}"))
                for n, server in enumerate(servers, 1)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            ahead_s = (due - now_ms()) / 1000
            log(f"sent {count:,} in {max(seconds):.2f} s; due in {ahead_s:.2f} s")
            if ahead_s < 1:
                log("WARNING the sends ran into the due second")
            for server in servers:
                server.wait_replayed()
            pids = [s.pid for s in servers] + [b.proc.pid for b in brokers]
            cpu_before = sum(cpu_seconds(pid) for pid in pids)
            stored = [0, 0]
            deadline = due + 120_000
            while sum(stored) < count and now_ms() < deadline:
                time.sleep(0.05)  # polling counters of other processes
                stored = [broker.stored() for broker in brokers]
            last = now_ms() - due
            cpu = sum(cpu_seconds(pid) for pid in pids) - cpu_before
        finally:
            for server in servers:
                server.stop()
            for broker in brokers:
                broker.stop()
            etcd.stop()
    common = {"messages": count, "delay_groups": 2, "broker_groups": 2}
    common["load_average"] = load_average()
    emit("cluster_burst_last_stored_after_due", last / 1000, "s", target="<= 10", **common)
    emit("cluster_burst_missing", count - sum(stored), "messages", target="0", **common)
    for n, value in enumerate(stored, 1):
        emit("cluster_burst_stored_in_group", value, "messages", group=f"b{n}", **common)
    what = "both delay servers and both brokers, from the due second to the last stored"
    emit("cluster_burst_cpu_per_message", cpu / count * 1e6, "us", what=what)
    emit("cluster_burst_send_rate", count / max(seconds), "msg/s", **common)


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "100,000 messages instead of 1,000,000")
    parser.add_argument("--messages", type=int, help="messages in the burst (both groups)")
    args = parser.parse_args()
    bench_common.emit_host_speed(emit)
    bench(args.messages or (100_000 if args.quick else 1_000_000))


if __name__ == "__main__":
    main()
