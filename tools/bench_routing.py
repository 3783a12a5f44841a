"""Routing benchmark: acknowledged intake of a cluster of 2 single-member delay groups
against one group, in the same run (issue 21: >= 1.6x one group).

Prints one JSON object per figure on stdout:
    {"bench": "routing", "metric": ..., "value": ..., "unit": ..., ...}

    python tools/bench_routing.py            # the figures of docs/benchmarks.md
    python tools/bench_routing.py --quick    # the same cases, smaller (< 1 minute)

Setup: one real etcd; cluster ``one`` with one delay group (its member pinned to CPU 0)
and cluster ``two`` with two (pinned to CPU 0 and CPU 1); every member a single-member
group with ``ack = leader`` (no follower to wait for), all started before the first
round, the idle ones costing nothing. Rounds alternate one / two, and the figures are
the medians.

Workload: bench_intake's (100-byte bodies, batches of 100, delays spread over an hour,
16 SEND_BATCHes in flight per connection). The ids are routed by the producers' own code
(delayd/client/_routing.py, over the registry read from etcd), and each group gets one
client process with a raw protocol connection to its leader, which encodes its frames
before the clock starts, so the figure is the servers' (the Python Producer routes the
same ids; its own cost is bench_intake's client side, not measured here). The one-group
client is pinned to CPU 1, the server's free CPU; with two groups both CPUs run a server
and the two clients are not pinned: they share the CPUs with the servers, and their CPU
per message is reported so that a client-bound run shows.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_common
import trio

ROOT = bench_common.ROOT

from bench_intake import IntakeClient, cpu_seconds, pinned  # noqa: E402

from delayd.address import parse_address  # noqa: E402
from delayd.client._cluster_view import read_delay_groups  # noqa: E402
from delayd.client._routing import DelayGroups  # noqa: E402
from delayd.cluster.group_state import lookup_group  # noqa: E402
from delayd.group_address import parse_group_address  # noqa: E402
from delayd.protocol import Message, SendBatch, encode_event  # noqa: E402
from tests.etcd_support import EtcdServer  # noqa: E402
from tests.intake_support import ServeProcess  # noqa: E402
from tests.process_support import free_port  # noqa: E402

BODY = b"b" * 100
BATCH = 100
IN_FLIGHT = 16
HOUR_MS = 3_600_000
CONFIG = "[intake]\nmax_pending_acks = 1000000\nmax_replay_lag_records = 10000000\n"
# A long lease: a loaded machine must not cost a member its leadership mid-round.
MEMBER_ENV = {"DELAYD_CLUSTER_ACK": "leader", "DELAYD_CLUSTER_LEASE_TTL_MS": "10000"}

emit = bench_common.emitter("routing")


# ----------------------------------------------------------------------------- client


def client_main(args: argparse.Namespace) -> None:
    """One group's client: its ids from stdin (one a line), sent from ``--start-at``
    (epoch s) on; prints acked, start and end (epoch s) and its own CPU seconds."""
    ids = sys.stdin.read().split()
    client = IntakeClient(*parse_address(args.addr), "bench-routing")
    rng = random.Random(args.seed)
    frames = []
    for first in range(0, len(ids), BATCH):
        request_id = client.next_request_id()
        messages = [
            Message(message_id, "orders", body=BODY, delay_ms=rng.randrange(HOUR_MS))
            for message_id in ids[first : first + BATCH]
        ]
        frames.append(encode_event(SendBatch(messages, request_id=request_id)))
    time.sleep(max(0.0, args.start_at - time.time()))
    cpu_before = time.process_time()
    started = time.time()
    acked, seconds = client.send_all(frames, IN_FLIGHT)
    ended = started + seconds
    print(json.dumps({"acked": acked, "started": started, "ended": ended,
                      "cpu_s": time.process_time() - cpu_before}))  # fmt: skip


# ----------------------------------------------------------------------------- cluster


class Cluster:
    """Single-member delay groups ``groups`` (name -> CPU) of the cluster ``name``."""

    def __init__(self, work: Path, etcd: EtcdServer, name: str, groups: dict[str, str]) -> None:
        self.address = f"etcd://{etcd.url.removeprefix('http://')}/{name}/*"
        self.members: dict[str, ServeProcess] = {}
        config = work / "bench.toml"
        config.write_text(CONFIG)
        for group, cpu in groups.items():
            self.members[group] = ServeProcess(
                work / f"{name}-{group}",
                "--etcd", etcd.url, "--group", group, "--cluster", name,
                "--config", str(config), "--broker-listen", "off", "--log-level", "warning",
                env={**MEMBER_ENV, "DELAYD_CLUSTER_REPLICATION_LISTEN": f"127.0.0.1:{free_port()}"},
                metrics_listen="off", command_prefix=tuple(pinned(cpu, [])),
            ).start()  # fmt: skip

    def leaders(self) -> dict[str, str]:
        """Each group's leader's intake address, once every group has one."""
        out: dict[str, str] = {}
        deadline = time.monotonic() + 30
        while len(out) < len(self.members):
            for group in self.members:
                group_address = parse_group_address(self.address.replace("*", group))
                state = trio.run(lookup_group, group_address)
                if state.leader is not None and state.leader.intake:
                    out[group] = state.leader.intake
            if time.monotonic() > deadline:
                raise RuntimeError(f"no leader in time: {sorted(set(self.members) - set(out))}")
            time.sleep(0.05)  # polling etcd for an election under way
        return out

    def route(self, ids: list[str]) -> dict[str, list[str]]:
        """``ids`` by owner, as a producer over the cluster sends them."""
        groups = trio.run(read_delay_groups, parse_group_address(self.address))
        out: dict[str, list[str]] = {}
        for group, indexes in groups.split(ids).items():
            out[group] = [ids[i] for i in indexes]
        return out

    def close(self) -> None:
        for member in self.members.values():
            member.close()


def run_round(cluster: Cluster, ids: list[str], client_cpus: dict[str, str | None]) -> dict:
    """Send ``ids`` over ``cluster``, one client per group; the round's figures."""
    leaders = cluster.leaders()
    parts = cluster.route(ids)
    start_at = time.time() + 2.0 + len(ids) / 50_000  # after every client built its frames
    cpu_before = {g: cpu_seconds(m.proc.pid) for g, m in cluster.members.items() if m.proc}
    clients = {}
    for seed, (group, part) in enumerate(sorted(parts.items())):
        args = [sys.executable, __file__, "client", "--addr", leaders[group],
                "--start-at", str(start_at), "--seed", str(seed)]  # fmt: skip
        cpu = client_cpus.get(group)
        command = pinned(cpu, args) if cpu is not None else args
        clients[group] = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        assert clients[group].stdin is not None
        clients[group].stdin.write("\n".join(part))
        clients[group].stdin.close()
    results = {}
    for group, process in clients.items():
        assert process.stdout is not None
        out = process.stdout.read()
        if process.wait() != 0:
            raise RuntimeError(f"client of {group} failed: {out}")
        results[group] = json.loads(out.strip().splitlines()[-1])
    acked = sum(r["acked"] for r in results.values())
    started = min(r["started"] for r in results.values())
    seconds = max(r["ended"] for r in results.values()) - started
    server_cpu = sum(
        cpu_seconds(m.proc.pid) - cpu_before[g] for g, m in cluster.members.items() if m.proc
    )
    return {
        "rate": acked / seconds,
        "acked": acked,
        "shares": {g: r["acked"] for g, r in sorted(results.items())},
        # each client's start (after the first's) and duration: a late or slow one shows
        "clients_s": {
            g: (round(r["started"] - started, 3), round(r["ended"] - r["started"], 3))
            for g, r in sorted(results.items())
        },
        "server_cpu_us": server_cpu / acked * 1e6,
        "client_cpu_us": sum(r["cpu_s"] for r in results.values()) / acked * 1e6,
    }


def emit_routing_cost(count: int) -> None:
    """What routing costs a producer: splitting ``count`` ids over two groups."""
    groups = DelayGroups(("d1", "d2"), ("d1", "d2"))
    ids = [f"order-{i}" for i in range(count)]
    started = time.process_time()
    groups.split(ids)
    seconds = time.process_time() - started
    emit("client_routing_cpu_per_id", seconds / count * 1e6, "us", groups=2, ids=count)


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "smaller runs (< 1 minute)")
    parser.add_argument("mode", nargs="?", default="bench", choices=["bench", "client"])
    parser.add_argument("--addr", help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, help="rounds of each case (default 3; quick 1)")
    parser.add_argument(
        "--data-in", metavar="DIR",
        help="put the servers' data directories under DIR (default: the system's temp "
        "directory); /dev/shm takes the disk's fsyncs out of the figure",
    )  # fmt: skip
    args = parser.parse_args()
    if args.mode == "client":
        client_main(args)
        return
    bench_common.emit_host_speed(emit)
    messages, rounds = (200_000, 1) if args.quick else (1_000_000, 3)
    emit_routing_cost(messages)
    rounds = args.rounds or rounds
    with tempfile.TemporaryDirectory(prefix="bench-routing-", dir=args.data_in) as work_dir:
        work = Path(work_dir)
        etcd = EtcdServer(work / "etcd").start()
        clusters = {}
        try:
            clusters["one"] = Cluster(work, etcd, "one", {"d1": "0"})
            clusters["two"] = Cluster(work, etcd, "two", {"d1": "0", "d2": "1"})
            client_cpus = {"one": {"d1": "1"}, "two": {}}
            figures: dict[str, list[dict]] = {"one": [], "two": []}
            for number in range(rounds):
                for case in ("one", "two"):
                    ids = [f"r{number}-{case}-{i}" for i in range(messages)]
                    figures[case].append(run_round(clusters[case], ids, client_cpus[case]))
                    print(json.dumps({"round": number, "case": case, **figures[case][-1]}),
                          file=sys.stderr)  # fmt: skip
        finally:
            for cluster in clusters.values():
                cluster.close()
            etcd.stop()
    rates = {case: statistics.median(f["rate"] for f in figures[case]) for case in figures}
    for case, groups in (("one", 1), ("two", 2)):
        runs = figures[case]
        emit(
            "acked_throughput",
            rates[case],
            "msg/s",
            delay_groups=groups,
            rounds=rounds,
            messages=messages,
            runs=[round(f["rate"]) for f in runs],
            shares=runs[-1]["shares"],
            server_cpu_per_message_us=statistics.median(f["server_cpu_us"] for f in runs),
            client_cpu_per_message_us=statistics.median(f["client_cpu_us"] for f in runs),
        )
    # Other work on the machine takes CPU from the pinned servers: say how much there was.
    emit("two_groups_vs_one", rates["two"] / rates["one"], "x", target=1.6,
         data_in=args.data_in or tempfile.gettempdir(),
         load_average_1m_at_end=os.getloadavg()[0])  # fmt: skip


if __name__ == "__main__":
    main()
