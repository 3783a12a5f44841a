"""Broker groups that come and go while the sender runs: a group added takes its share,
a drained group gets no new batch, a message whose send went unanswered waits for its
group (doubt_hold_ms) — in-process on trio's clock (delivery_pipeline: the real sender,
recording targets) — and what BrokerDiscovery makes of the registry in a real etcd.
The process test is tests/test_broker_discovery.py."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections import Counter
from dataclasses import dataclass, field

import pytest
import trio

from delayd.cluster.broker_groups import BrokerGroup, read_broker_groups
from delayd.cluster.config import ClusterConfig
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.members import GroupKeys, MemberInfo
from delayd.cluster.registry import GroupKind, GroupStatus, register, set_status
from delayd.sender.discovery import BrokerDiscovery
from delayd.sender.retry import RetryPolicy
from delayd.sender.sender import SenderConfig
from delayd.sender.targets import RemoteTarget, TargetUnavailable
from delayd.server.config import ConfigError, config_from_mapping
from delayd.server.delivery import build_targets
from tests.delivery_pipeline import T0, Pipeline, RecordingTarget, received_ids
from tests.etcd_support import EtcdServer, dead_url
from tests.process_support import ROOT

FAST = SenderConfig(
    failure_threshold=2, open_ms=200, max_open_ms=400, retry=RetryPolicy(base_ms=10)
)


@dataclass
class TriedTarget(RecordingTarget):
    """A RecordingTarget that also records the ids of every batch it was sent."""

    tried: list[str] = field(default_factory=list)

    async def send_batch(self, messages):
        self.tried += [m.message_id for m in messages]
        return await super().send_batch(messages)


@pytest.mark.instant_autojump  # recording targets: nothing real to wait for
async def test_a_group_added_while_running_takes_its_share(tmp_path, clock):
    a, b = RecordingTarget("a"), RecordingTarget("b")
    with Pipeline(str(tmp_path), [a]) as pipeline:
        sender = pipeline.delivery.sender
        first = pipeline.schedule([T0 + 1000 + i for i in range(200)])
        later = pipeline.schedule([T0 + 5000 + i for i in range(200)])
        async with pipeline.running():
            await trio.sleep_until(3)
            assert sorted(received_ids([a])) == sorted(first)
            b.clock = a.clock
            sender.add_group(b)
            await trio.sleep_until(8)
            await pipeline.stop()
        assert Counter(received_ids([a, b])) == Counter(first + later)
        assert 50 < len(b.received) < 150  # about half of what came due after it joined


@pytest.mark.instant_autojump  # recording targets: nothing real to wait for
async def test_without_a_group_messages_wait_for_the_first_one(tmp_path, clock):
    """Groups found in etcd may not be known when the sender starts."""
    a = RecordingTarget("a")
    with Pipeline(str(tmp_path), []) as pipeline:
        ids = pipeline.schedule([T0 + 1000 + i for i in range(50)])
        async with pipeline.running():
            await trio.sleep_until(3)
            assert pipeline.delivery.sender.parked == 50
            a.clock = pipeline.delivery.ticker.now_ms
            pipeline.delivery.sender.add_group(a)
            await trio.sleep_until(6)
            await pipeline.stop()
        assert sorted(received_ids([a])) == sorted(ids)


@pytest.mark.instant_autojump  # recording targets: nothing real to wait for
async def test_a_drained_group_gets_no_new_batch(tmp_path, clock):
    a, b = RecordingTarget("a"), RecordingTarget("b")
    with Pipeline(str(tmp_path), [a, b]) as pipeline:
        sender = pipeline.delivery.sender
        first = pipeline.schedule([T0 + 1000 + i for i in range(100)])
        later = pipeline.schedule([T0 + 5000 + i for i in range(100)], key="k")
        async with pipeline.running():
            await trio.sleep_until(3)
            assert a.received and b.received
            drained = "a" if a.received[0].message.key is None else "b"
            sender.set_accepting("a", False)
            sent_to_a = len(a.received)
            await trio.sleep_until(8)
            assert len(a.received) == sent_to_a  # nothing new, keyed messages included
            sender.set_accepting("a", True)
            await pipeline.stop()
        assert drained
        assert Counter(received_ids([a, b])) == Counter(first + later)
        assert {r.message.message_id for r in b.received} >= set(later)


@pytest.mark.instant_autojump  # recording targets: nothing real to wait for
async def test_an_unanswered_message_waits_for_its_group(tmp_path, clock):
    """Its broker may have stored it: sent to another group it could be stored twice."""
    down = TriedTarget("a", unavailable=True)
    up = RecordingTarget("b")
    with Pipeline(str(tmp_path), [down, up], sender=FAST) as pipeline:
        ids = pipeline.schedule([T0 + 1000 + i for i in range(100)])
        async with pipeline.running():
            await trio.sleep_until(5)
            tried = set(down.tried)
            assert tried and not tried & set(received_ids([up]))
            down.unavailable = False
            await trio.sleep_until(10)
            await pipeline.stop()
        assert Counter(received_ids([down, up])) == Counter(ids)
        assert tried <= set(received_ids([down]))
        dead = sum(g.dead_lettered for g in pipeline.delivery.sender.group_statistics())
        assert dead == 0  # waiting for the group is not the message's failure


@pytest.mark.instant_autojump  # recording targets: nothing real to wait for
async def test_a_drained_group_takes_the_resends_of_what_it_may_hold(tmp_path, clock):
    """Drained while its sends went unanswered: it still runs, and may have stored them;
    sent to another group they could be stored (and consumed) twice."""
    down = TriedTarget("a", unavailable=True)
    up = RecordingTarget("b")
    with Pipeline(str(tmp_path), [down, up], sender=FAST) as pipeline:
        sender = pipeline.delivery.sender
        ids = pipeline.schedule([T0 + 1000 + i for i in range(100)])
        later = pipeline.schedule([T0 + 7000 + i for i in range(50)])
        async with pipeline.running():
            await trio.sleep_until(5)
            tried = set(down.tried)
            assert tried
            sender.set_accepting("a", False, takes_resends=True)  # draining
            down.unavailable = False
            await trio.sleep_until(10)
            await pipeline.stop()
        assert Counter(received_ids([down, up])) == Counter(ids + later)
        assert tried <= set(received_ids([down])) and not tried & set(received_ids([up]))
        assert not set(later) & set(received_ids([down]))  # nothing new went to a


@dataclass
class RefusingTarget(TriedTarget):
    """A group that cannot be reached: nothing it is sent is stored."""

    async def send_batch(self, messages):
        self.tried += [m.message_id for m in messages]
        raise TargetUnavailable(f"{self.name}: connection refused (test)", nothing_stored=True)


@pytest.mark.instant_autojump  # recording targets: nothing real to wait for
async def test_a_batch_that_was_certainly_not_stored_goes_elsewhere_at_once(tmp_path, clock):
    down, up = RefusingTarget("a"), RecordingTarget("b")
    with Pipeline(str(tmp_path), [down, up], sender=FAST) as pipeline:
        ids = pipeline.schedule([T0 + 1000 + i for i in range(100)])
        await pipeline.run_until(T0 + 3000)
        assert down.tried
        assert sorted(received_ids([up])) == sorted(ids)


@pytest.mark.instant_autojump  # recording targets: nothing real to wait for
async def test_past_doubt_hold_an_unanswered_message_goes_elsewhere(tmp_path, clock):
    down, up = TriedTarget("a", unavailable=True), RecordingTarget("b")
    config = dataclasses.replace(FAST, doubt_hold_ms=0)
    with Pipeline(str(tmp_path), [down, up], sender=config) as pipeline:
        ids = pipeline.schedule([T0 + 1000 + i for i in range(100)])
        await pipeline.run_until(T0 + 6000)
        assert down.tried
        assert sorted(received_ids([up])) == sorted(ids)


def group(name: str, kind: GroupKind, status: GroupStatus, *addresses: str) -> BrokerGroup:
    return BrokerGroup(name, kind, status, addresses)


async def test_discovery_brings_the_sender_in_step_with_the_registry(tmp_path):
    with Pipeline(str(tmp_path), []) as pipeline:
        sender = pipeline.delivery.sender
        discovery = BrokerDiscovery(sender, ["http://127.0.0.1:1"], "/x", RemoteTarget)
        active, draining = GroupStatus.ACTIVE, GroupStatus.DRAINING
        broker, delay = GroupKind.BROKER, GroupKind.DELAY
        discovery.apply(
            [
                group("b1", broker, active, "127.0.0.1:7001"),
                group("b2", broker, draining, "127.0.0.1:7002"),
                group("b3", broker, active),  # no member up: nothing to connect to yet
                group("d1", delay, active, "127.0.0.1:7003"),  # an embedded broker
                group("a-name-longer-than-16", broker, active, "127.0.0.1:7004"),
            ]
        )
        assert sender.group_names == ["b1"]  # dispatch_log records 16 bytes of a name
        assert discovery.refused == {"a-name-longer-than-16"}
        discovery.apply(
            [
                group("b1", broker, draining, "127.0.0.1:7011", "127.0.0.1:7001"),
                group("b2", broker, active, "127.0.0.1:7002"),
            ]
        )
        assert sender.group_names == ["b1", "b2"]
        accepting = {g.name: g.accepting for g in sender._groups.values()}
        assert accepting == {"b1": False, "b2": True}
        assert discovery.targets["b1"].addresses == ("127.0.0.1:7011", "127.0.0.1:7001")
        discovery.apply([group("b1", broker, active, "127.0.0.1:7011")])  # b2 unregistered
        accepting = {g.name: g.accepting for g in sender._groups.values()}
        assert accepting == {"b1": True, "b2": False}
        await discovery.aclose()


async def test_the_broker_groups_of_a_cluster_in_etcd(etcd_server: EtcdServer, etcd_prefix: str):
    async with EtcdClient([etcd_server.url]) as etcd:
        for name, kind in [("b1", GroupKind.BROKER), ("b2", GroupKind.BROKER)]:
            await register(etcd, etcd_prefix, name, kind, 0)
        await register(etcd, etcd_prefix, "b3", GroupKind.BROKER, 0)
        await set_status(etcd, etcd_prefix, "b3", GroupStatus.RETIRED, 1)
        await register(etcd, etcd_prefix, "d1", GroupKind.DELAY, 0)
        await register(etcd, etcd_prefix, "d2", GroupKind.DELAY, 0)
        keys = GroupKeys(etcd_prefix, "b1")
        members = [MemberInfo("m1", broker="10.0.0.1:1"), MemberInfo("m2", broker="10.0.0.2:1")]
        for member in members:
            await etcd.put(keys.member(member.member_id), member.to_json())
        await etcd.put(keys.leader, members[1].to_json())
        d1 = GroupKeys(etcd_prefix, "d1")
        embedded = MemberInfo("m3", intake="10.0.0.3:1", broker="10.0.0.3:2")
        await etcd.put(d1.member("m3"), embedded.to_json())
        d2 = GroupKeys(etcd_prefix, "d2")  # a delay group without a broker listener
        await etcd.put(d2.member("m4"), MemberInfo("m4", intake="10.0.0.4:1").to_json())
        found = await read_broker_groups(etcd, etcd_prefix)
    assert found == [
        group("b1", GroupKind.BROKER, GroupStatus.ACTIVE, "10.0.0.2:1", "10.0.0.1:1"),
        group("b2", GroupKind.BROKER, GroupStatus.ACTIVE),  # registered, nobody up
        group("d1", GroupKind.DELAY, GroupStatus.ACTIVE, "10.0.0.3:2"),
    ]
    assert [g.takes_deliveries for g in found] == [True, True, False]


@pytest.mark.parametrize(
    ("document", "error"),
    [
        ({"delivery": {"broker_groups_from": "zookeeper"}}, "must be one of config, etcd"),
        (
            {
                "delivery": {"broker_groups_from": "etcd"},
                "broker_groups": [{"name": "east", "addresses": ["10.0.0.5:20811"]}],
            },
            "remove the [[broker_groups]] list",
        ),
    ],
)
def test_the_switch_refuses_what_cannot_be_meant(document, error):
    with pytest.raises(ConfigError, match=re.escape(error)):
        config_from_mapping(document)


def test_broker_groups_from_etcd_needs_the_cluster():
    config = config_from_mapping({"delivery": {"broker_groups_from": "etcd"}})
    with pytest.raises(ConfigError, match=r"give \[cluster\] etcd and group"):
        config.check_complete()
    cluster = ClusterConfig(etcd=("http://127.0.0.1:2379",), group="d1")
    dataclasses.replace(config, cluster=cluster).check_complete()
    assert build_targets(dataclasses.replace(config, cluster=cluster), None) == []  # type: ignore[arg-type]


def test_the_examples_of_the_docs_configure_what_they_say():
    """The ``toml`` blocks that set ``broker_groups_from`` in docs/cluster.md and
    docs/configuration.md."""
    found = 0
    for page in ("cluster.md", "configuration.md"):
        text = (ROOT / "docs" / page).read_text()
        for block in re.findall(r"```toml\n(.*?)```", text, re.S):
            if "broker_groups_from" not in block:
                continue
            config = config_from_mapping(tomllib.loads(block), source=page)
            config.check_complete()
            assert config.discovers_broker_groups and config.cluster.name == "prod"
            found += 1
    assert found == 2


async def test_a_read_that_fails_changes_nothing(tmp_path, etcd_server: EtcdServer, etcd_prefix):
    with Pipeline(str(tmp_path), []) as pipeline:
        sender = pipeline.delivery.sender
        discovery = BrokerDiscovery(sender, [etcd_server.url], etcd_prefix, RemoteTarget)
        async with EtcdClient([etcd_server.url]) as etcd:
            await register(etcd, etcd_prefix, "b1", GroupKind.BROKER, 0)
            member = MemberInfo("m1", broker="127.0.0.1:7001")
            await etcd.put(GroupKeys(etcd_prefix, "b1").member("m1"), member.to_json())
            await discovery.refresh(etcd)
            assert sender.group_names == ["b1"] and not discovery.failing
            await etcd.put(f"{etcd_prefix}/registry/broken", b"{not json")
            await discovery.refresh(etcd)  # logged, not raised: the sender keeps b1
            assert discovery.failing and sender.group_names == ["b1"]
        async with EtcdClient([dead_url()]) as gone:
            await discovery.refresh(gone)
        assert discovery.failing and sender.group_names == ["b1"]
        await discovery.aclose()
