"""Routing benchmark: acknowledged intake of a cluster of 2 single-member delay groups
against one group, in the same run (issue 21: >= 1.6x one group).

Prints one JSON object per figure on stdout:
    {"bench": "routing", "metric": ..., "value": ..., "unit": ..., ...}

    python tools/bench_routing.py                    # the figures of docs/benchmarks.md
    python tools/bench_routing.py --quick            # the same cases, smaller (< 1 minute)
    python tools/bench_routing.py --client producer  # through the Python Producer

Setup: one real etcd; cluster ``one`` with one delay group (its member pinned to CPU 0)
and cluster ``two`` with two (pinned to CPU 0 and CPU 1); every member a single-member
group with ``ack = leader`` (no follower to wait for), all started before the first
round, the idle ones costing nothing. Rounds alternate one / two, and the figures are
the medians.

Workload: bench_intake's (100-byte bodies, delays spread over an hour). Every id is
routed by the producers' own rule (delayd/client/_routing.py, over the registry read
from etcd). Two clients:

- ``--client raw`` (default; the servers' figure): one client process per group with a
  raw protocol connection to its leader, its SEND_BATCH frames of BATCH messages encoded
  before the clock starts, IN_FLIGHT of them pipelined.
- ``--client producer``: ``--clients`` processes, each the Python blocking ``Producer``
  over the cluster's address ``etcd://H:P/CLUSTER/*``, routing every id itself and
  sending each ``send_batch`` of CHUNK messages. Its own CPU per message bounds what a
  2-CPU machine can show (docs/benchmarks.md).

With one group the clients are pinned to CPU 1, the server's free CPU; with two, both
CPUs run a server and the clients are not pinned: they share the CPUs with the servers.
Each process's user + system CPU per message of the round is reported (servers and
clients apart): two groups can reach 2x one only as far as the clients' CPU per message
is small beside the servers'.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import bench_common
import trio

ROOT = bench_common.ROOT

from bench_intake import IntakeClient, cpu_seconds, pinned  # noqa: E402

from delayd.address import parse_address  # noqa: E402
from delayd.client import Producer  # noqa: E402
from delayd.client._cluster_view import read_delay_groups  # noqa: E402
from delayd.client._routing import DelayGroups  # noqa: E402
from delayd.cluster.group_state import lookup_group  # noqa: E402
from delayd.group_address import parse_group_address  # noqa: E402
from delayd.protocol import Message, ResultCode, SendBatch, encode_event  # noqa: E402
from tests.etcd_support import EtcdServer  # noqa: E402
from tests.intake_support import ServeProcess  # noqa: E402
from tests.process_support import free_port  # noqa: E402

BODY = b"b" * 100
BATCH = 100  # messages a raw client's SEND_BATCH carries
# SEND_BATCHes a raw client keeps in flight: enough to keep its server busy (with 16 a
# lone group's server idled ~11 % of the time between answers and the next requests).
IN_FLIGHT = 64
CHUNK = 8_000  # messages a producer's send_batch call carries: 8 frames of 1,000
HOUR_MS = 3_600_000
CONFIG = "[intake]\nmax_pending_acks = 1000000\nmax_replay_lag_records = 10000000\n"
# A long lease: a loaded machine must not cost a member its leadership mid-round.
MEMBER_ENV = {"DELAYD_CLUSTER_ACK": "leader", "DELAYD_CLUSTER_LEASE_TTL_MS": "10000"}

emit = bench_common.emitter("routing")
Sends = Callable[[], int]  # sends a client's messages; how many were acknowledged


# ----------------------------------------------------------------------------- client


def client_main(args: argparse.Namespace) -> None:
    """One client process: its ids from stdin (one a line, then an empty line); prints
    "ready" once it is connected and its work is built, sends once the line "go"
    follows, then prints acked, start and end (epoch s) and its own user + system CPU
    seconds over the sends. ``--client producer``: the Python blocking Producer over
    the cluster ``--addr``; ``raw``: one raw connection to the group leader ``--addr``,
    its SEND_BATCH frames encoded before the clock starts."""
    ids = []
    for line in sys.stdin:
        if not line.strip():
            break
        ids.append(line.strip())
    rng = random.Random(args.seed)
    messages = [Message(i, "orders", body=BODY, delay_ms=rng.randrange(HOUR_MS)) for i in ids]
    send = _producer_sender if args.client == "producer" else _raw_sender
    with send(args, messages) as sends:
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        cpu_before = time.process_time()
        started = time.time()
        acked = sends()
        ended = time.time()
        cpu_s = time.process_time() - cpu_before
    print(json.dumps({"acked": acked, "started": started, "ended": ended, "cpu_s": cpu_s}))


@contextlib.contextmanager
def _producer_sender(args: argparse.Namespace, messages: list[Message]) -> Iterator[Sends]:
    with Producer(args.addr) as producer:
        warm_up = [
            Message(f"warm-{m.message_id}", "orders", body=BODY, delay_ms=HOUR_MS)
            for m in messages[:200]
        ]
        producer.send_batch(warm_up)

        def sends() -> int:
            acked = 0
            for first in range(0, len(messages), CHUNK):
                receipts = producer.send_batch(messages[first : first + CHUNK])
                acked += sum(1 for r in receipts if r.code is ResultCode.OK)
            return acked

        yield sends


@contextlib.contextmanager
def _raw_sender(args: argparse.Namespace, messages: list[Message]) -> Iterator[Sends]:
    client = IntakeClient(*parse_address(args.addr), "bench-routing")
    frames = [
        encode_event(
            SendBatch(messages[first : first + BATCH], request_id=client.next_request_id())
        )
        for first in range(0, len(messages), BATCH)
    ]
    yield lambda: client.send_all(frames, IN_FLIGHT)[0]


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


def run_round(
    cluster: Cluster, ids: list[str], kind: str, clients: int, client_cpu: str | None
) -> dict:
    """Send ``ids`` over ``cluster`` (``kind`` producer: from ``clients`` producer
    processes; raw: one raw client per group, given its group's ids), pinned to
    ``client_cpu`` unless None; the round's figures."""
    leaders = cluster.leaders()
    parts = cluster.route(ids)
    shares = {group: len(part) for group, part in sorted(parts.items())}
    if kind == "producer":
        work = [(cluster.address, ids[seed::clients]) for seed in range(clients)]
    else:
        work = [(leaders[group], part) for group, part in sorted(parts.items())]
    processes = []
    for seed, (address, part) in enumerate(work):
        args = [sys.executable, __file__, "client", "--client", kind, "--addr", address,
                "--seed", str(seed)]  # fmt: skip
        command = pinned(client_cpu, args) if client_cpu is not None else args
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )
        assert process.stdin is not None
        process.stdin.write("\n".join(part) + "\n\n")
        process.stdin.flush()
        processes.append(process)
    for process in processes:
        assert process.stdout is not None
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"client failed: {process.stdout.read()}")
    servers = {g: m.proc.pid for g, m in cluster.members.items() if m.proc}
    cpu_before = {g: cpu_seconds(pid) for g, pid in servers.items()}
    for process in processes:
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.close()
    results = []
    for process in processes:
        assert process.stdout is not None
        out = process.stdout.read()
        if process.wait() != 0:
            raise RuntimeError(f"client failed: {out}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    server_cpu = {g: cpu_seconds(pid) - cpu_before[g] for g, pid in servers.items()}
    acked = sum(r["acked"] for r in results)
    started = min(r["started"] for r in results)
    seconds = max(r["ended"] for r in results) - started
    return {
        "rate": acked / seconds,
        "acked": acked,
        "shares": shares,
        # each client's start (after the first's) and duration: a late or slow one shows
        "clients_s": [
            (round(r["started"] - started, 3), round(r["ended"] - r["started"], 3)) for r in results
        ],
        # user + system CPU per acknowledged message of the round, of each process
        "server_cpu_us": {g: round(cpu / acked * 1e6, 3) for g, cpu in server_cpu.items()},
        "client_cpu_us": [round(r["cpu_s"] / acked * 1e6, 3) for r in results],
        "servers_cpu_us": sum(server_cpu.values()) / acked * 1e6,
        "clients_cpu_us": sum(r["cpu_s"] for r in results) / acked * 1e6,
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
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--client", choices=["raw", "producer"], default="raw",
        help="raw (default): one raw protocol client per group, its frames encoded before "
        "the clock starts — the servers' figure; producer: the Python Producer over the "
        "cluster's address, routing each id itself",
    )  # fmt: skip
    parser.add_argument(
        "--clients", type=int, default=4, help="with --client producer: processes per round"
    )
    parser.add_argument("--rounds", type=int, help="rounds of each case (default 5; quick 1)")
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
    messages, rounds = (200_000, 1) if args.quick else (1_000_000, 5)
    emit_routing_cost(messages)
    rounds = args.rounds or rounds
    with tempfile.TemporaryDirectory(prefix="bench-routing-", dir=args.data_in) as work_dir:
        work = Path(work_dir)
        etcd = EtcdServer(work / "etcd").start()
        clusters = {}
        try:
            clusters["one"] = Cluster(work, etcd, "one", {"d1": "0"})
            clusters["two"] = Cluster(work, etcd, "two", {"d1": "0", "d2": "1"})
            client_cpu = {"one": "1", "two": None}
            figures: dict[str, list[dict]] = {"one": [], "two": []}
            for number in range(rounds):
                for case in ("one", "two"):
                    ids = [f"r{number}-{case}-{i}" for i in range(messages)]
                    figures[case].append(
                        run_round(clusters[case], ids, args.client, args.clients, client_cpu[case])
                    )
                    emit_round(number, case, figures[case][-1])
        finally:
            for cluster in clusters.values():
                cluster.close()
            etcd.stop()
    rates = {case: statistics.median(f["rate"] for f in figures[case]) for case in figures}
    cpu_us = {}
    for case, groups in (("one", 1), ("two", 2)):
        runs = figures[case]
        cpu_us[case] = (
            statistics.median(f["servers_cpu_us"] for f in runs),
            statistics.median(f["clients_cpu_us"] for f in runs),
        )
        emit(
            "acked_throughput",
            rates[case],
            "msg/s",
            delay_groups=groups,
            rounds=rounds,
            messages=messages,
            client=args.client,
            clients=args.clients if args.client == "producer" else groups,
            runs=[round(f["rate"]) for f in runs],
            shares=runs[-1]["shares"],
            servers_cpu_per_message_us=round(cpu_us[case][0], 3),
            clients_cpu_per_message_us=round(cpu_us[case][1], 3),
        )
    # Other work on the machine takes CPU from the pinned servers: say how much there was.
    emit("two_groups_vs_one", rates["two"] / rates["one"], "x", target=1.6,
         data_in=args.data_in or tempfile.gettempdir(),
         load_average_1m_at_end=os.getloadavg()[0])  # fmt: skip
    # What two CPUs allow by these CPU costs alone: one group is bound by the busier of
    # its server's CPU and its clients' CPU; two groups by all of it spread over both.
    (server_one, client_one), (server_two, client_two) = cpu_us["one"], cpu_us["two"]
    emit("two_groups_vs_one_by_cpu", max(server_one, client_one) * 2 / (server_two + client_two),
         "x", note="2 CPUs' worth of work, no interference between the vCPUs")  # fmt: skip


def emit_round(number: int, case: str, figures: dict) -> None:
    """One round's throughput and every process's user + system CPU per message."""
    emit("round_throughput", figures["rate"], "msg/s", round=number, case=case,
         acked=figures["acked"], shares=figures["shares"], clients_s=figures["clients_s"],
         server_cpu_per_message_us=figures["server_cpu_us"],
         client_cpu_per_message_us=figures["client_cpu_us"])  # fmt: skip


if __name__ == "__main__":
    main()
