"""A consumer of ``etcd://H:P/CLUSTER/*`` against real ``delayd broker`` groups in a real
etcd, under trio and asyncio: it reads every broker group as one stream, commits each
message to the group it came from, picks up a group registered while it runs, and
leaves a group that is retired."""

from __future__ import annotations

import uuid
from pathlib import Path

import anyio
import pytest
import trio

import delayd
from delayd.client._cluster_consumer import ClusterConsumer
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.group_state import lookup_group
from delayd.cluster.members import cluster_prefix
from delayd.cluster.registry import GroupStatus, set_status
from delayd.errors import RejectedError, UnreachableError
from delayd.group_address import GroupAddress
from tests.broker_support import BrokerProcess, messages
from tests.delivery_support import poll
from tests.etcd_support import EtcdServer

pytestmark = pytest.mark.slow

BACKENDS = ["trio", "asyncio"]


class Brokers:
    def __init__(self, tmp_path: Path, etcd: EtcdServer) -> None:
        self.cluster = f"c{uuid.uuid4().hex[:10]}"
        self.etcd = etcd
        self.tmp_path = tmp_path
        self.processes: dict[str, BrokerProcess] = {}

    @property
    def every_group(self) -> str:
        return f"etcd://{self.etcd.url.removeprefix('http://')}/{self.cluster}/*"

    def start(self, group: str) -> BrokerProcess:
        flags = ("--etcd", self.etcd.url, "--group", group, "--cluster", self.cluster)
        process = BrokerProcess(self.tmp_path / group, *flags).start()
        self.processes[group] = process
        address = GroupAddress(etcd=(self.etcd.url,), group=group, cluster=self.cluster)
        # 20 s: an election right after a start may take seconds on a loaded machine.
        poll(lambda: trio.run(lookup_group, address).leader is not None, 20, f"{group} leads")
        return process

    def send(self, group: str, prefix: str, count: int) -> set[str]:
        batch = messages(prefix, count)
        with self.processes[group].client() as client:
            assert all(r.code.name == "OK" for r in client.send_batch(batch))
        return {m.message_id for m in batch}

    async def retire(self, group: str) -> None:
        async with EtcdClient([self.etcd.url]) as etcd:
            prefix = cluster_prefix(self.cluster)
            await set_status(etcd, prefix, group, GroupStatus.RETIRED, 0)

    def close(self) -> None:
        for process in self.processes.values():
            process.close()


@pytest.fixture
def brokers(tmp_path: Path, etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("DELAYD_CLUSTER_REPLICATION_LISTEN", "127.0.0.1:0")
    monkeypatch.setenv("DELAYD_CLUSTER_ACK", "leader")
    made = Brokers(tmp_path, etcd_server)
    yield made
    made.close()


async def receive_ids(consumer: ClusterConsumer, count: int) -> set[str]:
    got: set[str] = set()
    with anyio.fail_after(20):
        while len(got) < count:
            message = await consumer.receive(timeout_s=1)
            if message is not None:
                got.add(message.message_id)
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_consumer_of_every_group_reads_them_as_one(brokers: Brokers, backend: str) -> None:
    brokers.start("b1")
    brokers.start("b2")
    sent = brokers.send("b1", "one", 30) | brokers.send("b2", "two", 30)

    async def scenario() -> None:
        options = {"subject": "orders", "group": "g", "pull_wait_ms": 200}
        async with delayd.open_consumer(brokers.every_group, **options) as consumer:
            assert isinstance(consumer, ClusterConsumer)
            assert await receive_ids(consumer, 60) == sent
            assert consumer.groups == ["b1", "b2"]
            assert sorted(consumer.queues) == ["b1", "b2"]
            # A group registered while consuming is read from the next refresh on.
            consumer.refresh_s = 0.2
            await anyio.to_thread.run_sync(brokers.start, "b3")  # it polls etcd with trio.run
            third = brokers.send("b3", "three", 10)
            assert await receive_ids(consumer, 10) == third
            # A retired group is left: its consumer commits and closes.
            await brokers.retire("b3")
            with anyio.fail_after(10):
                while "b3" in consumer.groups:
                    await anyio.sleep(0.05)
        # Every commit went to the group its message came from: only new ones come.
        more = brokers.send("b1", "four", 5) | brokers.send("b2", "five", 5)
        async with delayd.open_consumer(brokers.every_group, **options) as again:
            assert await receive_ids(again, 10) == more
            assert await again.receive(timeout_s=0.5) is None

    anyio.run(scenario, backend=backend)


def received(consumer, count: int) -> set[str]:
    """The ids of the next ``count`` messages of a blocking consumer."""
    got = set()
    while len(got) < count:
        message = consumer.receive(timeout_s=10)
        assert message is not None
        got.add(message.message_id)
    return got


def test_the_blocking_consumer_of_every_group(brokers: Brokers) -> None:
    brokers.start("b1")
    brokers.start("b2")
    sent = brokers.send("b1", "one", 20) | brokers.send("b2", "two", 20)
    options = {"subject": "orders", "group": "g", "pull_wait_ms": 200, "commit": "sync"}
    with delayd.Consumer(brokers.every_group, **options) as consumer:
        assert received(consumer, 40) == sent
        assert consumer.groups == ["b1", "b2"]
    more = brokers.send("b1", "three", 5) | brokers.send("b2", "four", 5)
    with delayd.Consumer(brokers.every_group, **options) as again:
        assert received(again, 10) == more


def test_an_address_of_every_group_is_checked_at_once() -> None:
    with pytest.raises(ValueError, match="commit must be one of"):
        delayd.Consumer("etcd://127.0.0.1:1/*", subject="s", group="g", commit="never")
    unreachable = delayd.Consumer(
        "etcd://127.0.0.1:1/*", subject="s", group="g", retry_first_connect=False
    )
    with pytest.raises(UnreachableError, match="cannot read the groups"):
        unreachable.connect()


def test_a_refused_subscription_is_raised_by_receive(brokers: Brokers) -> None:
    brokers.start("b1")

    async def scenario() -> None:
        async with delayd.open_consumer(brokers.every_group, subject="no spaces", group="g") as c:
            with pytest.raises(RejectedError, match="subject"):
                await c.receive(timeout_s=10)

    anyio.run(scenario, backend="trio")


def test_a_message_whose_handler_raised_comes_again(brokers: Brokers) -> None:
    brokers.start("b1")
    sent = brokers.send("b1", "one", 5)
    options = {"subject": "orders", "group": "g", "pull_wait_ms": 200}
    failing = pytest.raises(ValueError, match="handler")
    with failing, delayd.Consumer(brokers.every_group, **options) as consumer:
        first = consumer.receive(timeout_s=10)
        assert first is not None
        raise ValueError("the handler failed")
    with delayd.Consumer(brokers.every_group, **options) as again:
        got = received(again, 5)
    assert got == sent and first.message_id in got
