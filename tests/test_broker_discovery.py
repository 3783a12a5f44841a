"""Broker groups found in etcd, end to end, with real processes and a real etcd: a delay
server with ``[delivery] broker_groups_from = "etcd"`` delivers to the broker groups of
its cluster, consumers of ``etcd://H:P/CLUSTER/*`` share them, a broker group added
mid-run takes deliveries and is consumed, a broker group leader killed with kill -9 is
followed by the sender and the consumers; the checker counts 0 lost, 0 early, 0 seen
twice and every cancel honoured.

On 127.0.0.1, not on netns hosts: what is tested is discovery and following a leader
after a kill -9, and a killed process refuses connections on loopback as on a host of
its own; the partitions a namespace makes possible are not part of it (the fault suite
has them).
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trio

from delayd.cluster.broker_groups import read_broker_groups
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.members import cluster_prefix
from tests.broker_support import BrokerProcess
from tests.delivery_support import now_ms, poll
from tests.etcd_support import EtcdServer
from tests.fault_checker import History, check
from tests.fault_load import LoadProcess
from tests.intake_support import ServeProcess, write_config
from tests.process_support import DELAYD, ROOT, child_env

pytestmark = pytest.mark.slow

MEMBER_ENV = {
    "DELAYD_CLUSTER_REPLICATION_LISTEN": "127.0.0.1:0",  # the default port would collide
    "DELAYD_CLUSTER_LEASE_TTL_MS": "1000",  # a killed leader replaced in about a second
    "DELAYD_CLUSTER_ACK": "leader",  # a lone delay member does not wait for a follower
}
SETTLE_S = 10.0  # after the last due time, for the consumers to see everything


class Loopback:
    """The host tests.fault_load's processes run on: this one."""

    def popen(self, args, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(args, **kwargs)


class Cluster:
    """A cluster of its own on the session's etcd: broker groups and one delay server."""

    def __init__(self, tmp_path: Path, etcd: EtcdServer) -> None:
        self.name = f"c{uuid.uuid4().hex[:10]}"
        self.etcd = etcd
        self.tmp_path = tmp_path
        self.brokers: dict[str, list[BrokerProcess]] = {}
        self.processes: list[BrokerProcess | ServeProcess] = []

    @property
    def every_group(self) -> str:
        return f"etcd://{self.etcd.url.removeprefix('http://')}/{self.name}/*"

    def broker(self, group: str, member: str) -> BrokerProcess:
        flags = ("--etcd", self.etcd.url, "--group", group, "--cluster", self.name)
        process = BrokerProcess(self.tmp_path / f"{group}-{member}", *flags)
        self.brokers.setdefault(group, []).append(process)
        self.processes.append(process)
        return process.start()

    def delay_server(self) -> ServeProcess:
        config = write_config(
            self.tmp_path / "serve.toml",
            "[replay]\ncheckpoint_interval_ms = 100\n"
            "[wheel]\nload_ahead_ms = 300\n"
            "[delivery]\nmax_batch = 32\ndispatch_flush_interval_ms = 100\n"
            'broker_groups_from = "etcd"\nbroker_groups_refresh_ms = 200\n',
        )
        process = ServeProcess(
            self.tmp_path / "delay",
            "--config",
            config,
            "--etcd",
            self.etcd.url,
            "--group",
            "delay",
            "--cluster",
            self.name,
            env=MEMBER_ENV,
        )
        self.processes.append(process)
        return process.start()

    def groups(self) -> dict[str, tuple[str, ...]]:
        async def read() -> dict[str, tuple[str, ...]]:
            async with EtcdClient([self.etcd.url]) as etcd:
                found = await read_broker_groups(etcd, cluster_prefix(self.name))
            return {group.name: group.addresses for group in found}

        return trio.run(read)

    def leader_of(self, group: str) -> BrokerProcess:
        leader = self.groups()[group][0]
        return next(b for b in self.brokers[group] if f"127.0.0.1:{b.address[1]}" == leader)

    def close(self) -> None:
        for process in self.processes:
            process.close()


@pytest.fixture
def cluster(
    tmp_path: Path, etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Cluster]:
    for name, value in MEMBER_ENV.items():
        monkeypatch.setenv(name, value)  # the broker processes inherit them
    made = Cluster(tmp_path, etcd_server)
    yield made
    made.close()


def sent_to(server: ServeProcess, group: str) -> float:
    return server.metrics().get(f'delayd_delivery_sent_messages_total{{group="{group}"}}', 0.0)


def members(broker: BrokerProcess, group: str = "check") -> int:
    """The members of consumer group ``group`` the broker has."""
    with broker.client() as client:
        return int(client.stats().get(f"group_members/{group}/orders", 0))


def claimed_back(broker: BrokerProcess) -> None:
    """Every queue of the consumer group was held by the broker, which began to lead,
    until a consumer that rejoined claimed it: none went out unclaimed."""
    with broker.client() as client:
        stats = client.stats()
    shown = {k: v for k, v in stats.items() if "promotion" in k or "group" in k or "lag" in k}
    assert stats["broker.promotion_held_queues_total"] >= 4, shown  # 4 queues a promotion
    assert stats["broker.promotion_unclaimed_queues_total"] == 0, shown


def lag(broker: BrokerProcess, group: str = "check") -> int:
    """Messages of the broker that consumer group ``group`` has not committed."""
    with broker.client() as client:
        stats = client.stats()
    return sum(int(v) for k, v in stats.items() if k.startswith(f"consumer_lag_messages/{group}/"))


def test_a_delay_server_delivers_to_the_broker_groups_in_etcd_and_consumers_share_them(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A broker group added mid-run is joined by both consumers while the producer
    goes on: a queue moves between them only once its old owner let go of it
    (docs/broker.md, "Rebalancing"). b2's leader is killed (kill -9) while the producer
    goes on and the consumers have its messages in hand: the restarted leader gives each
    queue back to the consumer that says it holds it (docs/broker.md, "In a replicated
    group"), so neither reads what the other has in hand."""
    cluster.broker("b1", "a")
    cluster.broker("b2", "a")
    poll(lambda: len(cluster.groups().get("b2", ())) == 1, 20, "b2's first member leads")
    cluster.broker("b2", "b")
    poll(lambda: len(cluster.groups().get("b2", ())) == 2, 20, "b2 has two members")
    server = cluster.delay_server()
    host = Loopback()
    address = f"127.0.0.1:{server.address[1]}"

    def load(role: str, name: str, target: str, *args: str) -> LoadProcess:
        return LoadProcess(host, role, target, tmp_path / f"{name}.jsonl", "--prefix", name, *args)

    def joined(group: str) -> None:
        leader = cluster.leader_of(group)
        poll(lambda: members(leader) == 2, 30, f"both consumers joined {group}")

    consumers = [load("consume", f"c{n}", cluster.every_group) for n in (1, 2)]
    joined("b1")
    joined("b2")
    producer = load("produce", "p", address, "--max-delay-ms", "1000")
    processes = [producer, *consumers]
    seen = lambda: {e["id"] for c in consumers for e in c.events("seen")}  # noqa: E731

    try:
        producer.wait_for("acked", 200)
        poll(lambda: sent_to(server, "b1") > 0 and sent_to(server, "b2") > 0, 10, "both used")

        cluster.broker("b3", "a")  # a third broker group, mid-run
        joined("b3")
        poll(lambda: sent_to(server, "b3") > 0, 10, "the new group takes deliveries")

        def restart_b2_leader() -> None:
            killed = cluster.leader_of("b2")
            old_leader = f"127.0.0.1:{killed.address[1]}"
            killed.kill()  # kill -9
            poll(lambda: len(cluster.groups()["b2"]) == 1, 10, "b2's leader is gone")
            # Back on its port, as the same member, the group leads again (the follower
            # alone does not take over: a broker group's in-sync set is the leader).
            killed.extra += ["--listen", old_leader]
            killed.start()
            joined("b2")
            claimed_back(cluster.leader_of("b2"))

        restart_b2_leader()
        before = sent_to(server, "b2")
        poll(lambda: sent_to(server, "b2") > before, 20, "b2 takes deliveries again")
        producer.wait_for("acked", len(producer.events("acked")) + 200)
        producer.stop()
        last_due = max(e["due_ms"] for e in producer.events("acked"))
        acked = {e["id"] for e in producer.events("acked")} - cancelled(producer)
        seen_all(acked, seen, (last_due - now_ms()) / 1000 + SETTLE_S)
        for consumer in consumers:
            consumer.stop()
        history = History.from_events(e for p in processes for e in p.events())
        check(history, due_by_ms=last_due).assert_clean()
        assert all(c.events("seen") for c in consumers), "both consumers share the groups"
    finally:
        for process in processes:
            if process.process.poll() is None:
                process.process.kill()

    # `delayd consume` over the whole cluster: a new consumer group reads every group
    # from the start (three broker groups, and the delay group's embedded broker).
    # Until it printed as many as the consumers saw (3 s without a message is not the
    # end on a loaded machine: a group's join may take longer); 30 s of silence, should
    # one be missing.
    flags = ["--broker", cluster.every_group, "--subject", "orders", "--group", "cli"]
    flags += ["--count", str(len(seen())), "--timeout", "30"]
    out = subprocess.run(
        [*DELAYD, "consume", *flags, "--json"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    printed = {json.loads(line)["id"] for line in out.stdout.splitlines()}
    assert printed == seen()


def seen_all(acked: set[str], seen: Callable[[], set[str]], wait_s: float) -> None:
    """Wait until the consumers saw every id of ``acked``: ``wait_s``, and longer while
    they still see new ones (on a loaded machine they work through the backlog a
    failover left at their pace, each message committed before the next); fail once
    they saw nothing new for SETTLE_S."""
    deadline, count = time.monotonic() + wait_s, 0
    while not acked <= (now := seen()):
        if len(now) > count:
            count, deadline = len(now), max(deadline, time.monotonic() + SETTLE_S)
        missing = sorted(acked - now)
        assert time.monotonic() < deadline, (
            f"{len(missing)} acknowledged messages not seen ({missing[:5]}...), none new "
            f"seen for {SETTLE_S} s"
        )
        time.sleep(0.1)


def cancelled(producer: LoadProcess) -> set[str]:
    return {e["id"] for e in producer.events("cancel") if e.get("outcome") == "CANCELLED"}


def test_a_draining_group_gets_no_new_deliveries(cluster: Cluster, tmp_path: Path) -> None:
    """``delayd cluster drain`` sets the registry status; the sender honours it."""
    from delayd.cluster.registry import GroupStatus, set_status

    cluster.broker("b1", "a")
    cluster.broker("b2", "a")
    poll(lambda: set(cluster.groups()) >= {"b1", "b2"}, 20, "both groups registered")
    server = cluster.delay_server()

    async def drain() -> None:
        async with EtcdClient([cluster.etcd.url]) as etcd:
            await set_status(etcd, cluster_prefix(cluster.name), "b2", GroupStatus.DRAINING, 0)

    producer = LoadProcess(
        Loopback(),
        "produce",
        f"127.0.0.1:{server.address[1]}",
        tmp_path / "p.jsonl",
        "--max-delay-ms",
        "200",
    )
    try:
        poll(lambda: sent_to(server, "b1") > 0 and sent_to(server, "b2") > 0, 10, "both used")
        trio.run(drain)

        def b2_quiet() -> bool:
            before = sent_to(server, "b1"), sent_to(server, "b2")
            time.sleep(0.5)
            return sent_to(server, "b1") > before[0] and sent_to(server, "b2") == before[1]

        # The next registry read (every 200 ms) and the batches in flight: a fixed second
        # is too short on a loaded machine.
        poll(b2_quiet, 20, "a half second of deliveries to b1 only")
        b1, b2 = sent_to(server, "b1"), sent_to(server, "b2")
        poll(lambda: sent_to(server, "b1") > b1 + 100, 10, "deliveries go on to b1")
        assert sent_to(server, "b2") == b2
    finally:
        producer.process.kill()
