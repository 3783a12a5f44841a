"""A delay group's failover after a broker group was added: the new leader resends what
the old one delivered but had not yet recorded, and each resend reaches the broker group
of the first send, which drops it as a duplicate (docs/cluster.md, "A resend after a
failover") — real processes, a real etcd, kill -9.

The window is made wide and certain: ``dispatch_flush_interval_ms`` is a minute, so the
old leader's DISPATCHED entries are never durable, never shipped, and the follower that
takes over resends every message; only the bucket's route set, flushed and acknowledged
before the first send, reached it. Routed by the broker groups of the moment (b1, b2
and the new b3, as before dispatch_log recorded routes), about a third of the resends
would go to b3 and be stored twice. On 127.0.0.1 (as tests/test_broker_discovery.py):
what matters is the kill -9 and the takeover, not partitions.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import pytest
import trio

import delayd
from delayd.cluster.broker_groups import read_broker_groups
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.group_state import lookup_group
from delayd.cluster.members import cluster_prefix
from delayd.group_address import GroupAddress
from tests.broker_support import BrokerProcess
from tests.delivery_support import broker_stats, consume, now_ms, poll, stored_count
from tests.etcd_support import EtcdServer
from tests.fault_checker import History, check
from tests.intake_support import ServeProcess, write_config
from tests.test_cluster_roles import addr, member_id

pytestmark = pytest.mark.slow

COUNT = 120
DELAY_MS = 1_500
BROKER_ENV = {
    "DELAYD_CLUSTER_REPLICATION_LISTEN": "127.0.0.1:0",
    "DELAYD_CLUSTER_LEASE_TTL_MS": "1000",
    "DELAYD_CLUSTER_ACK": "leader",  # single-member broker groups
}
DELAY_ENV = {**BROKER_ENV, "DELAYD_CLUSTER_ACK": "sync"}


class Cluster:
    """A cluster of its own on the session's etcd: single-member broker groups and the
    two members of delay group d1 (ack = sync), which never flush dispatch_log."""

    def __init__(self, tmp_path: Path, etcd: EtcdServer) -> None:
        self.name = f"c{uuid.uuid4().hex[:10]}"
        self.etcd = etcd
        self.tmp_path = tmp_path
        self.brokers: dict[str, BrokerProcess] = {}
        self.delay: list[ServeProcess] = []
        self.config = write_config(
            tmp_path / "serve.toml",
            "[wheel]\nload_ahead_ms = 300\n"
            "[delivery]\ndispatch_flush_interval_ms = 60000\n"
            'broker_groups_from = "etcd"\nbroker_groups_refresh_ms = 200\n',
        )

    def broker(self, group: str) -> BrokerProcess:
        flags = ("--etcd", self.etcd.url, "--group", group, "--cluster", self.name)
        process = BrokerProcess(self.tmp_path / group, *flags)
        self.brokers[group] = process
        return process.start()

    def delay_member(self, name: str) -> ServeProcess:
        process = ServeProcess(
            self.tmp_path / name,
            *("--config", self.config, "--etcd", self.etcd.url),
            *("--group", "d1", "--cluster", self.name),
            env=DELAY_ENV,
        )
        self.delay.append(process)
        return process.start()

    def broker_groups(self) -> set[str]:
        async def read() -> set[str]:
            async with EtcdClient([self.etcd.url]) as etcd:
                found = await read_broker_groups(etcd, cluster_prefix(self.name))
            return {group.name for group in found if group.addresses}

        return trio.run(read)

    def delay_leader(self) -> str | None:
        where = GroupAddress(etcd=(self.etcd.url,), group="d1", cluster=self.name)
        leader = trio.run(lookup_group, where).leader
        return leader.member_id if leader else None

    def close(self) -> None:
        for process in [*self.delay, *self.brokers.values()]:
            process.close()


@pytest.fixture
def cluster(tmp_path: Path, etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch):
    for name, value in BROKER_ENV.items():
        monkeypatch.setenv(name, value)  # the broker processes inherit them
    made = Cluster(tmp_path, etcd_server)
    yield made
    made.close()


def test_resends_after_a_failover_reach_the_broker_group_of_the_first_send(cluster: Cluster):
    cluster.broker("b1")
    cluster.broker("b2")
    # The waits after a start are 20 s: seconds each on a loaded machine.
    poll(lambda: cluster.broker_groups() == {"b1", "b2"}, 20, "b1 and b2 registered")
    leader = cluster.delay_member("a")
    poll(lambda: cluster.delay_leader() == member_id(leader), 20, "a leads d1")
    follower = cluster.delay_member("b")

    history = History()
    # Under ack = sync the first send waits for b, just started, to copy and join the
    # in-sync set: 30 s rather than the producer's default 10.
    members = f"{addr(leader.address)},{addr(follower.address)}"
    with delayd.Producer(members, timeout_s=30) as producer:
        for i in range(COUNT):
            history.sent(f"m-{i}", now_ms() + DELAY_MS)
            receipt = producer.send("orders", b"x", message_id=f"m-{i}", delay_ms=DELAY_MS)
            assert receipt.ok, receipt
            history.acked(f"m-{i}", receipt.due_ms)

    def stored(group: str) -> int:
        return stored_count(broker_stats(cluster.brokers[group].address))

    poll(lambda: stored("b1") + stored("b2") == COUNT, 20, "every message stored once")
    assert stored("b1") and stored("b2")
    found = "broker group b3 found in etcd"
    cluster.broker("b3")  # a set change between the first sends and the resends
    poll(lambda: "b3" in cluster.broker_groups(), 20, "b3 registered")
    poll(lambda: found in leader.log_path.read_text(), 20, "a uses b3")

    leader.kill()  # kill -9: its last DISPATCHED entries were never flushed nor shipped
    poll(lambda: cluster.delay_leader() == member_id(follower), 15, "b leads d1")
    found = "broker group b3 found in etcd"
    poll(lambda: found in follower.log_path.read_text(), 15, "b uses b3 too")

    def resent() -> float:
        metrics = follower.metrics()
        return sum(
            metrics.get(f'delayd_delivery_sent_messages_total{{group="{group}"}}', 0.0)
            for group in ("b1", "b2", "b3")
        )

    def pending() -> float:
        metrics = follower.metrics()
        return sum(v for k, v in metrics.items() if k.startswith("delayd_pending_messages{"))

    # What the old leader's dispatch_log did not ship: all of it, unless the flush that
    # records a batch's routes shipped an earlier batch's DISPATCHED entries too (a
    # loaded machine spreads the sends over more batches: 96 of 120 were resent once).
    poll(lambda: resent() > 0 and pending() == 0, 40, "the new leader resent what it holds")
    assert stored("b3") == 0  # nothing went to the group added after the first sends
    assert stored("b1") + stored("b2") == COUNT  # the resends were answered DUPLICATE

    received = [r for group in ("b1", "b2") for r in consume(cluster.brokers[group].address, 1)]
    assert Counter(r.message_id for r in received) == Counter(f"m-{i}" for i in range(COUNT))
    history.seen_all(r.sighting("check", committed=True) for r in received)
    check(history, due_by_ms=now_ms()).assert_clean()
