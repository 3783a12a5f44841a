"""Broker groups with real processes and a real etcd (docs/replication.md, "Broker
groups"): the embedded broker of a delay group fails over with its delay server, a
standalone ``delayd broker`` group fails over under a delay server's sender, and a
consumer never sees a record its group has not acknowledged (the high watermark).
Every run is checked by tests/fault_checker.py: 0 acknowledged messages lost, 0 early,
0 seen again after a commit covering it landed."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

import delayd
from delayd.cluster.members import MemberInfo
from delayd.protocol import Message, SendBatch, SendBatchResult
from tests.broker_support import BrokerProcess
from tests.broker_support import RawClient as BrokerClient
from tests.delivery_support import broker_stats, consume, exactly_once, now_ms, stored_count
from tests.etcd_support import EtcdServer
from tests.fault_checker import History, Sighting, check
from tests.intake_support import ServeProcess, write_config
from tests.test_cluster_replication import dispatched, in_sync_pair, sync_env, sync_group
from tests.test_cluster_roles import addr, member_id, state, wait_until

pytestmark = pytest.mark.slow

SUBJECT = "orders"


class CommittingConsumer:
    """A consumer of ``group`` in a thread, over the member list ``addresses``: it
    processes each message (records the sighting), then commits it durably; the
    sighting carries when the commit landed, so the checker counts as twice any copy
    that comes after it."""

    def __init__(self, addresses: str, group: str, history: History) -> None:
        self.addresses = addresses
        self.group = group
        self.history = history
        self.ids: set[str] = set()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.errors: list[tuple[int, BaseException]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self._consume()
            except delayd.DelaydError as exc:
                # Acks wait while the new leader has no in-sync follower: a request may
                # time out; the consumer joins again and goes on from the commits.
                self.errors.append((now_ms(), exc))
            except BaseException as exc:  # reported by the test's thread
                self.error = exc
                return

    def _consume(self) -> None:
        with delayd.Consumer(
            self.addresses,
            subject=SUBJECT,
            group=self.group,
            auto_commit=False,
            commit="sync",
            timeout_s=10,
            pull_wait_ms=200,
        ) as consumer:
            while not self.stop.is_set():
                message = consumer.receive(timeout_s=0.5)
                if message is not None:
                    self._process(consumer, message)

    def _process(self, consumer: delayd.Consumer, message: Message) -> None:
        seen_ms = now_ms()
        committed_ms = None
        try:
            consumer.commit(message)
            committed_ms = now_ms()
        except delayd.DelaydError:
            pass  # not committed: a copy may come again (at least once)
        assert message.queue is not None and message.queue_offset is not None
        self.history.seen(
            Sighting(
                message.message_id,
                seen_ms,
                dispatched_ms=message.dispatched_ms,
                due_ms=message.due_ms,
                position=(message.queue, message.queue_offset),
                group=self.group,
                committed_ms=committed_ms,
                stored_ms=message.store_ms,
            )
        )
        self.ids.add(message.message_id)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        if self.error is not None:
            raise self.error


def produce(address: str, history: History, prefix: str, count: int, delay_ms: int) -> None:
    """``count`` messages to the delay group at ``address`` (a member list), each
    recorded sent, then acknowledged when its receipt came back OK."""
    with delayd.Producer(address, timeout_s=20) as producer:
        for i in range(count):
            message_id = f"{prefix}-{i}"
            history.sent(message_id, now_ms() + delay_ms)
            receipt = producer.send(SUBJECT, b"x" * 40, message_id=message_id, delay_ms=delay_ms)
            if receipt.ok:
                history.acked(message_id, receipt.due_ms)
            time.sleep(0.004)


def acked_ids(history: History) -> set[str]:
    return {i for i, fate in history.fates.items() if fate.acked_due_ms is not None}


def test_the_embedded_broker_fails_over_with_its_delay_server(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    """kill -9 of a delay group's leader while producing and consuming: the consumer
    follows to the new leader's embedded broker and goes on from the replicated
    committed offsets; what the old leader delivered into its broker is there."""
    group = sync_group(tmp_path, etcd_server.url)
    history = History()
    consumer = None
    try:
        a, b = in_sync_pair(group)
        intake = f"{addr(a.address)},{addr(b.address)}"
        brokers = f"{addr(a.broker_address)},{addr(b.broker_address)}"
        consumer = CommittingConsumer(brokers, "c", history)
        producing = threading.Thread(target=produce, args=(intake, history, "m", 400, 300))
        producing.start()
        wait_until(lambda: len(consumer.ids) >= 100, 30, "the consumer reads from the leader")
        a.kill()
        wait_until(lambda: group.leader_id() == member_id(b), 10, "the follower leads")
        a.start()  # the new leader's acks wait for a follower (min_in_sync = 1)
        producing.join(timeout=60)
        assert not producing.is_alive()
        acked = acked_ids(history)
        assert len(acked) >= 350
        wait_until(lambda: acked <= consumer.ids, 30, "every acknowledged message is consumed")
        consumer.close()
        consumer = None
        report = check(history, due_by_ms=now_ms())
        report.assert_clean()
    finally:
        if consumer is not None:
            consumer.stop.set()
        group.close()


def broker_group(tmp_path: Path, etcd_url: str, monkeypatch: pytest.MonkeyPatch) -> list:
    """Two ``delayd broker`` members of a new group (not started), ack = sync."""
    for variable, value in sync_env().items():
        monkeypatch.setenv(variable, value)  # BrokerProcess passes its environment on
    name = f"b{uuid.uuid4().hex[:10]}"
    flags = ("--etcd", etcd_url, "--group", name)
    return [name, BrokerProcess(tmp_path / "a", *flags), BrokerProcess(tmp_path / "b", *flags)]


def broker_id(broker: BrokerProcess) -> str:
    return addr(broker.address).replace(":", "-")


def start_in_sync(etcd_url: str, name: str, first: BrokerProcess, second: BrokerProcess) -> None:
    # Each wait follows a process start: seconds on a loaded machine, so 20 s.
    first.start()
    leads = lambda: (state(etcd_url, name).leader or MemberInfo("x")).member_id  # noqa: E731
    wait_until(lambda: leads() == broker_id(first), 20, "the first broker leads")
    second.start()
    both = {broker_id(first), broker_id(second)}
    wait_until(lambda: state(etcd_url, name).in_sync == both, 20, "the follower is in sync")


def test_a_broker_member_publishes_its_metrics_address(
    tmp_path: Path, etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``delayd top --etcd`` and ``delayd cluster retire`` read a member's /metrics at
    the address it published in etcd: a ``delayd broker`` member publishes its own."""
    name, a, _ = broker_group(tmp_path, etcd_server.url, monkeypatch)
    try:
        a.start()
        wait_until(lambda: state(etcd_server.url, name).members, 10, "the broker registers")
        (info,) = state(etcd_server.url, name).members
        assert info.broker == addr(a.address)
        assert info.metrics == addr(a.metrics_address)
        assert (
            "delayd_broker_stored_messages_total"
            in httpx.get(f"http://{info.metrics}/metrics").text
        )
    finally:
        a.close()


def test_a_standalone_broker_group_fails_over_under_the_sender(
    tmp_path: Path, etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    name, a, b = broker_group(tmp_path, etcd_server.url, monkeypatch)
    server = None
    consumer = None
    history = History()
    try:
        start_in_sync(etcd_server.url, name, a, b)
        members = f"{addr(a.address)},{addr(b.address)}"
        config = write_config(
            tmp_path / "serve.toml",
            f'[[broker_groups]]\nname = "bg"\naddresses = ["{addr(a.address)}", '
            f'"{addr(b.address)}"]\n'
            "[delivery]\nfailure_threshold = 2\nopen_ms = 100\nmax_open_ms = 400\n"
            "retry_base_ms = 20\nretry_max_ms = 200\nmax_attempts = 200\n",
        )
        server = ServeProcess(tmp_path / "delay", "--config", str(config)).start()
        consumer = CommittingConsumer(members, "c", history)
        producing = threading.Thread(
            target=produce, args=(addr(server.address), history, "s", 300, 200)
        )
        producing.start()
        wait_until(lambda: len(consumer.ids) >= 80, 30, "the consumer reads from the leader")
        a.kill()
        leads = lambda: (state(etcd_server.url, name).leader or MemberInfo("x")).member_id  # noqa: E731
        wait_until(lambda: leads() == broker_id(b), 10, "the follower leads")
        a.start()  # a new port, a new member: in sync once it has copied everything
        producing.join(timeout=60)
        acked = acked_ids(history)
        assert len(acked) == 300
        wait_until(lambda: acked <= consumer.ids, 40, "every message reaches the consumer")
        consumer.close()
        consumer = None
        check(history, due_by_ms=now_ms()).assert_clean()
        # Stored once in the group: the new leader's queues hold each id once.
        assert stored_count(broker_stats(b.address)) == 300
    finally:
        if consumer is not None:
            consumer.stop.set()
        if server is not None:
            server.close()
        for broker in (a, b):
            broker.close()


def test_a_consumer_never_sees_what_a_slow_follower_lacks(
    tmp_path: Path, etcd_server: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The follower is stopped (SIGSTOP): the leader stores new messages durably but
    its group does not acknowledge them (min_in_sync = 1), so no store is answered and
    no consumer sees them; once the follower runs again and copies them, both happen."""
    name, a, b = broker_group(tmp_path, etcd_server.url, monkeypatch)
    try:
        start_in_sync(etcd_server.url, name, a, b)
        with a.client() as client:
            sent = client.send_batch([Message(f"before-{i}", SUBJECT, body=b"x") for i in range(5)])
        assert all(r.code.is_success for r in sent)
        assert b.proc is not None
        os.kill(b.proc.pid, signal.SIGSTOP)
        try:
            with BrokerClient(a.address) as producer:
                rid = producer.send(
                    SendBatch([Message(f"after-{i}", SUBJECT, body=b"y") for i in range(5)])
                )
                durable = lambda: (  # noqa: E731
                    broker_stats(a.address)["broker.commitlog_durable_offset"]
                    > broker_stats(a.address)["broker.reput_offset"]
                )
                wait_until(durable, 10, "the leader holds the new messages durable")
                with a.client() as consumer:
                    seen = consumer.drain(SUBJECT, "c", "c-1")
                    assert sorted(m.message_id for m in seen) == [f"before-{i}" for i in range(5)]
                    time.sleep(1.5)  # past replica_lag_ms: the follower leaves the set
                    assert consumer.pull(SUBJECT, "c", "c-1", 100, 0) == []
                os.kill(b.proc.pid, signal.SIGCONT)
                answer = producer.wait(rid)
                assert isinstance(answer, SendBatchResult), answer
                assert all(r.code.is_success for r in answer.results)
            with a.client() as consumer:
                consumer.join("c2", SUBJECT, "c2-1")
                later = consumer.drain(SUBJECT, "c2", "c2-1")
            assert sorted(m.message_id for m in later) == sorted(
                [f"before-{i}" for i in range(5)] + [f"after-{i}" for i in range(5)]
            )
            # The data path's metrics, as a delay member exports them.
            assert a.metrics_address is not None
            metrics = httpx.get("http://{}:{}/metrics".format(*a.metrics_address)).text
            acked = 'delayd_replication_acknowledged_offset_bytes{log="commitlog"}'
            assert acked in metrics
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
    finally:
        for broker in (a, b):
            broker.close()


def test_a_resend_of_what_the_old_leader_delivered_is_a_duplicate(
    tmp_path: Path, etcd_server: EtcdServer
) -> None:
    """The old leader delivered into its embedded broker and was killed before its
    DISPATCHED entries were flushed (a long dispatch_flush_interval_ms): the new leader
    sends the messages again, and its broker, a copy of the old one's, answers
    DUPLICATE: each message is stored once and a consumer group reads it once."""
    group = sync_group(tmp_path, etcd_server.url)
    try:
        # The old leader never flushes while the test runs; the follower flushes as
        # usual, so what it sends again is recorded at once. (A 10 s interval for both
        # left the produce and consume below only 10 s before the old leader flushed,
        # and cost 10 s of the new leader's wait, on a loaded machine too.)
        unflushed = {**sync_env(), "DELAYD_DELIVERY_DISPATCH_FLUSH_INTERVAL_MS": "600000"}
        a, b = in_sync_pair(group, first_env=unflushed)
        count = 20
        history = History()
        produce(addr(a.address), history, "r", count, 200)
        first = consume(a.broker_address, count, group="first", timeout_s=30)
        assert sorted(r.message_id for r in first) == sorted(f"r-{i}" for i in range(count))
        a.kill()
        copied = dispatched(b.data_dir)
        assert copied < count  # the entries never reached the follower
        wait_until(lambda: group.leader_id() == member_id(b), 10, "the follower leads")
        a.start()  # the new leader's acks wait for a follower (min_in_sync = 1)
        wait_until(lambda: dispatched(b.data_dir) >= count, 20, "the new leader delivers again")
        stats = broker_stats(b.broker_address)
        assert stats["broker.duplicates_total"] >= count - copied
        assert stored_count(stats) == count
        second = consume(b.broker_address, count, group="second", timeout_s=30)
        exactly_once(second)
        assert sorted(r.message_id for r in second) == sorted(f"r-{i}" for i in range(count))
    finally:
        group.close()
