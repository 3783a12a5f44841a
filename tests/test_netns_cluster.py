"""The cluster fault test of issue 21: delay groups and broker groups as one cluster,
every member on its own host, under load, with the checker over the whole run.

Two delay groups (d1 replicated, d2 single) deliver to the broker groups found in
etcd (b1 replicated, b2 single); a producer sends over ``etcd://ETCD/CLUSTER/*`` and
two consumers of one consumer group read ``etcd://ETCD/CLUSTER/*``, each on a host of
its own (tests/fault_load.py, the public blocking clients). Mid-run a delay group d3
and a broker group b3 are added, d2 and b2 drained and retired (``delayd cluster``),
and the leaders of d1 and b1 killed with kill -9 (each fails over to its follower,
then comes back). The checker: 0 lost, 0 early, 0 seen twice, every CANCELLED
honoured.

The consumers are started first and stay for the whole run, so a consumer group's
membership changes only where a fault forces it (b1's new leader): a member that joins
or leaves makes the broker move queues, and the member that had prefetched a moved
queue's messages may hand them out after the new owner read them (the rebalance window
of docs/broker.md). So b3 is registered ``draining`` before its member starts (a
member never overwrites its group's entry), joined by both consumers while no delay
server sends to it, and only then ``delayd cluster activate``d.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

from delayd.client._routing import REFRESH_S
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.group_state import lookup_group
from delayd.cluster.members import cluster_prefix
from delayd.cluster.registry import GroupKind, GroupStatus, register, set_status
from delayd.group_address import GroupAddress
from tests.broker_support import BrokerProcess
from tests.delivery_support import now_ms, poll
from tests.intake_support import ServeProcess, write_config
from tests.netns_support import EtcdHost, Host, Network
from tests.test_broker_discovery import claimed_back, lag, members
from tests.test_netns_cluster_routing import ClusterLoad

pytestmark = [pytest.mark.netns, pytest.mark.slow]

PORT, BROKER_PORT, REPLICATION_PORT, METRICS_PORT = 7000, 7001, 7002, 7003
LEASE_TTL_MS = 3000  # a killed leader is replaced within 3 s; shorter flaps on a loaded machine
REFRESH_MS = 200  # the delay servers' read of the broker groups in etcd
SETTLED_S = REFRESH_S + 1.0  # a registry change reaches producer and consumers within this
STEP = 250  # acknowledged messages between two changes
DELAY_CONFIG = (
    "[replay]\ncheckpoint_interval_ms = 100\n"
    "[wheel]\nload_ahead_ms = 300\n"
    "[delivery]\nmax_batch = 32\ndispatch_flush_interval_ms = 100\n"
    f'broker_groups_from = "etcd"\nbroker_groups_refresh_ms = {REFRESH_MS}\n'
    "failure_threshold = 2\nopen_ms = 100\nmax_open_ms = 400\n"
    "retry_base_ms = 20\nretry_max_ms = 200\nmax_attempts = 200\n"
)


def member_env(host: Host, replicated: bool) -> dict[str, str]:
    return {
        "DELAYD_CLUSTER_REPLICATION_LISTEN": f"{host.address}:{REPLICATION_PORT}",
        "DELAYD_CLUSTER_LEASE_TTL_MS": str(LEASE_TTL_MS),
        # A replicated group acknowledges once its follower has it, so a kill -9 of its
        # leader loses nothing acknowledged; a lone member has nobody to wait for.
        "DELAYD_CLUSTER_ACK": "sync" if replicated else "leader",
    }


class Cluster(ClusterLoad):
    """One cluster of its own on the session's etcd, delay and broker groups with their
    members on hosts, and the load over all of it."""

    def __init__(self, network: Network, etcd: EtcdHost, tmp_path: Path) -> None:
        super().__init__(tmp_path, etcd)
        self.network = network
        self.broker = self.delay_server  # consumers read every group of the cluster
        self.config = write_config(tmp_path / "delay.toml", DELAY_CONFIG)
        self.delay: dict[str, list[ServeProcess]] = {}
        self.brokers: dict[str, list[BrokerProcess]] = {}

    def delay_group(self, name: str, size: int) -> list[ServeProcess]:
        """Start delay group ``name``'s ``size`` members, each on a host of its own, the
        first the leader, the others in sync."""
        for n in range(size):
            host = self.network.host(f"{name}{n}")
            member = ServeProcess(
                self.tmp_path / f"{name}-{n}",
                "--config", str(self.config),
                "--etcd", self.etcd.url, "--group", name, "--cluster", self.cluster,
                "--listen", f"{host.address}:{PORT}",
                "--broker-listen", f"{host.address}:{BROKER_PORT}",
                metrics_listen=f"{host.address}:{METRICS_PORT}",
                env=member_env(host, size > 1),
                command_prefix=tuple(host.command_prefix),
            ).start()  # fmt: skip
            self.delay.setdefault(name, []).append(member)
            self._wait_joined(name, n + 1)
        return self.delay[name]

    def broker_group(self, name: str, size: int) -> list[BrokerProcess]:
        """Start broker group ``name``'s ``size`` members (``delayd broker``), each on a
        host of its own, the first the leader, the others in sync."""
        for n in range(size):
            host = self.network.host(f"{name}{n}")
            env = [f"{k}={v}" for k, v in member_env(host, size > 1).items()]
            member = BrokerProcess(
                self.tmp_path / f"{name}-{n}",
                "--etcd", self.etcd.url, "--group", name, "--cluster", self.cluster,
                "--listen", f"{host.address}:{PORT}",
                command_prefix=(*host.command_prefix, "env", *env),
            ).start()  # fmt: skip
            self.brokers.setdefault(name, []).append(member)
            self._wait_joined(name, n + 1)
        return self.brokers[name]

    def _wait_joined(self, group: str, size: int) -> None:
        def joined() -> bool:
            state = self.state(group)
            in_sync = len(state.in_sync or ()) == size or size == 1
            return state.leader is not None and len(state.members) == size and in_sync

        poll(joined, 20, f"{group} has {size} member(s) in sync")

    def state(self, group: str):
        address = GroupAddress(etcd=(self.etcd.url,), group=group, cluster=self.cluster)
        return trio.run(lookup_group, address)

    def members_of(self, group: str) -> list:
        return [*self.delay.get(group, ()), *self.brokers.get(group, ())]

    def leader(self, group: str):
        """``group``'s leading member (a ServeProcess or a BrokerProcess), or None."""
        leader = self.state(group).leader
        for member in self.members_of(group):
            if leader is not None and leader.member_id == "{}-{}".format(*member.address):
                return member
        return None

    def fail_over(self, group: str) -> None:
        """kill -9 of ``group``'s leader; once its follower leads, the killed member
        comes back (on its host and port: the same member) and catches up."""
        killed = self.leader(group)
        killed.kill()
        poll(lambda: self.leader(group) not in (None, killed), 20, f"{group}'s follower leads")
        killed.start()
        self._wait_joined(group, len(self.members_of(group)))

    def preregister_draining(self, group: str) -> None:
        async def write() -> None:
            async with EtcdClient([self.etcd.url]) as etcd:
                prefix = cluster_prefix(self.cluster)
                await register(etcd, prefix, group, GroupKind.BROKER, now_ms())
                await set_status(etcd, prefix, group, GroupStatus.DRAINING, now_ms())

        trio.run(write)

    def sent_to(self, broker_group: str) -> float:
        """Deliveries to ``broker_group`` by every delay member (leaders and former)."""
        key = f'delayd_delivery_sent_messages_total{{group="{broker_group}"}}'
        members = [m for group in self.delay.values() for m in group if m.proc.poll() is None]
        return sum(m.metrics().get(key, 0.0) for m in members)

    def joined_by_both(self, group: str) -> None:
        try:
            poll(lambda: members(self.leader(group)) == 2, 20, f"both consumers joined {group}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.consumer_group_report(group)}") from None

    def consumer_group_report(self, group: str) -> str:
        """What each member of broker group ``group`` says of the consumer group (its
        STATS, its rebalances), and where the logs are: a failed wait for the
        consumers says why without the run's files."""
        lines = [f"leader in etcd: {self.state(group).leader}; logs under {self.tmp_path}"]
        for member in self.members_of(group):
            lines.append(f"{group} member {member.address}:")
            try:
                with member.client() as client:
                    stats = client.stats()
                lines += [f"  {k} = {v}" for k, v in sorted(stats.items()) if "group" in k]
            except Exception as exc:  # a report: say what failed, go on
                lines.append(f"  STATS failed: {exc!r}")
            log = member.log_path.read_text(errors="replace").splitlines()
            told = [line for line in log if "rebalanced" in line or " -> " in line]
            lines += [f"  {line[:300]}" for line in told[-8:]]
        return "\n".join(lines)

    def close(self) -> None:
        for member in [*(m for g in self.delay.values() for m in g),
                       *(m for g in self.brokers.values() for m in g)]:  # fmt: skip
            member.close()


def test_a_cluster_grows_shrinks_and_fails_over_under_load(
    network: Network, netns_etcd: EtcdHost, tmp_path: Path
) -> None:
    cluster = Cluster(network, netns_etcd, tmp_path)
    try:
        run(cluster, network)
    finally:
        for process in [*cluster.producers, *cluster.consumers]:
            if process.process.poll() is None:
                process.process.kill()
        cluster.close()


def run(cluster: Cluster, network: Network) -> None:
    cluster.broker_group("b1", 2)
    cluster.broker_group("b2", 1)
    cluster.delay_group("d1", 2)
    cluster.delay_group("d2", 1)
    consumers = [cluster.consumer(network.host(f"c{n}"), f"c{n}") for n in (1, 2)]
    for group in ("b1", "b2"):
        cluster.joined_by_both(group)
    p = network.host("p")
    producer = cluster.producer(p, "producer", "--seed", "21", "--timeout-s", "5")

    def more(count: int = STEP) -> None:
        producer.wait_for("acked", len(producer.events("acked")) + count, timeout_s=40)

    more()
    poll(lambda: cluster.sent_to("b1") > 0 and cluster.sent_to("b2") > 0, 10, "b1 and b2 used")

    # Added mid-run: d3 registers when its member joins; b3 is joined by the consumers
    # before it takes deliveries (the module's docstring says why).
    cluster.delay_group("d3", 1)
    cluster.preregister_draining("b3")
    cluster.broker_group("b3", 1)
    cluster.joined_by_both("b3")
    assert "active" in cluster.cli(p, "activate", "b3")
    more()
    poll(lambda: cluster.sent_to("b3") > 0, 10, "the added broker group takes deliveries")
    assert cluster.leader("d3").metrics().get("delayd_intake_accepted_messages_total", 0) > 0

    assert "draining" in cluster.cli(p, "drain", "d2")
    assert "draining" in cluster.cli(p, "drain", "b2")
    settled_ms = now_ms() + REFRESH_MS + 1000  # the delay servers' next read, batches sent
    time.sleep(SETTLED_S)  # the producer routes around d2 now
    more()

    cluster.fail_over("d1")
    more()
    # With messages in the consumers' hands: the new leader gives each queue back to the
    # consumer that says it holds it (docs/broker.md, "In a replicated group").
    cluster.fail_over("b1")
    cluster.joined_by_both("b1")
    claimed_back(cluster.leader("b1"))
    more()

    # The producers resend no id, and b2 retires once consumed to its end, after the
    # delay servers sent it nothing more: neither window need pass first.
    retire_d2 = ("retire", "d2", "--resend-window-s", "0")
    poll(lambda: "retired" in cluster.cli(p, *retire_d2, check=False), 20, "d2 retires")
    poll(lambda: lag(cluster.leader("b2")) == 0, 20, "b2 consumed to its end")
    assert "retired" in cluster.cli(p, "retire", "b2", "--doubt-hold-ms", "0")
    time.sleep(SETTLED_S)  # the consumers leave b2
    for member in [*cluster.delay["d2"], *cluster.brokers["b2"]]:
        member.close()
    more(100)  # nobody stopped: the cluster runs on without them

    report = cluster.finish()
    brokers_seen = {e["broker"] for c in consumers for e in c.events("seen")}
    assert brokers_seen == {"b1", "b2", "b3"}
    seen = [e for c in consumers for e in c.events("seen")]
    late = [e["id"] for e in seen if e["broker"] == "b2" and e["stored_ms"] > settled_ms]
    assert not late, f"the draining b2 stored new deliveries: {late[:5]}"
    assert all(c.events("seen") for c in consumers), "both consumers share the groups"
    assert report.acked >= 5 * STEP
