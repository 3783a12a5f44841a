"""A broker with a ReplicationGate (delayd.broker.gate), over a fake gate whose
acknowledged offsets the test moves by hand: store acks and offset commits wait for
the group, a member that stops leading answers NOT_LEADER, and PULL serves only what
the group acknowledged (the high watermark), a held PULL waking when it moves. The
real gate, over replication, is tested with processes in tests/test_cluster_brokers.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from delayd.broker.broker import Broker, open_broker
from delayd.broker.config import BrokerConfig
from delayd.broker.server import serve_broker
from delayd.client import Consumer
from delayd.errors import NotLeaderError
from delayd.protocol import (
    CommitOffset,
    CommitOffsetOk,
    Error,
    ErrorCode,
    Message,
    SendBatch,
    SendBatchResult,
)
from delayd.protocol.codes import ResultCode
from delayd.sender.targets import EmbeddedTarget, NotLeaderTarget
from tests.broker_support import RawClient

CONFIG = BrokerConfig(queues_per_subject=1, checkpoint_interval_ms=60_000)


class FakeGate:
    """The group's acknowledged offsets, as the test sets them; ``leading`` False
    makes every wait answer False (the member stepped down)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.commitlog = 0
        self.offsets: dict[int, int] = {}
        self.leading = True
        self.waits: list[tuple[str, int]] = []
        self._moved = trio.Event()

    def move(self, commitlog: int | None = None, offsets: dict[int, int] | None = None) -> None:
        if commitlog is not None:
            self.commitlog = commitlog
            self.broker.high_watermark_moved()
        self.offsets.update(offsets or {})
        self._moved.set()
        self._moved = trio.Event()

    def step_down(self) -> None:
        self.leading = False
        self.move()

    def commitlog_acked(self) -> int:
        return self.commitlog

    async def wait_commitlog(self, offset: int) -> bool:
        self.waits.append(("commitlog", offset))
        while self.leading and self.commitlog < offset:
            await self._moved.wait()
        return self.leading

    async def wait_offsets(self, generation: int, offset: int) -> bool:
        self.waits.append((f"offsets/{generation}", offset))
        while self.leading and self.offsets.get(generation, 0) < offset:
            await self._moved.wait()
        return self.leading


@asynccontextmanager
async def gated_broker(tmp_path: Path) -> AsyncIterator[tuple[Broker, FakeGate]]:
    """A running broker with a fake gate attached."""
    async with open_broker(str(tmp_path), CONFIG) as broker:
        gate = FakeGate(broker)
        broker.attach_gate(gate)
        yield broker, gate


def messages(prefix: str, count: int) -> list[Message]:
    return [Message(f"{prefix}-{i}", "orders", body=b"x" * 10) for i in range(count)]


async def test_a_store_ack_waits_until_the_group_acknowledged_the_batch(
    tmp_path: Path,
) -> None:
    async with gated_broker(tmp_path) as (broker, gate):
        answered: list[list] = []

        async def send() -> None:
            answered.append(await broker.send_batch(messages("a", 3)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            await trio.sleep(0.05)
            assert answered == []  # durable on the leader, not acknowledged by the group
            end = broker.store.commitlog.end_offset
            assert gate.waits == [("commitlog", end)]
            gate.move(commitlog=end - 1)
            await trio.sleep(0.02)
            assert answered == []  # the last record is not the group's yet
            gate.move(commitlog=end)
        assert [r.code for r in answered[0]] == [ResultCode.OK] * 3


async def test_a_member_that_stops_leading_answers_not_leader_never_ok(tmp_path: Path) -> None:
    async with gated_broker(tmp_path) as (broker, gate):
        target = EmbeddedTarget("embedded", broker)
        refused: list[NotLeaderTarget] = []

        async def send() -> None:
            with pytest.raises(NotLeaderTarget, match="no longer leads") as caught:
                await target.send_batch(messages("b", 2))
            refused.append(caught.value)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send)
            await trio.sleep(0.02)
            assert refused == []  # stored, waiting for the group
            gate.step_down()
        assert len(refused) == 1  # the sender writes no dispatch_log entry for it
        with pytest.raises(NotLeaderError):
            await broker.send_batch(messages("c", 1))


async def test_pull_serves_only_records_the_group_acknowledged(tmp_path: Path) -> None:
    async with gated_broker(tmp_path) as (broker, gate):
        broker.join("g", "orders", "c1", None, broker.monotonic_ms())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(broker.send_batch, messages("first", 2))
            await trio.sleep(0.05)
            first_end = broker.store.commitlog.end_offset
            gate.move(commitlog=first_end)
            await trio.sleep(0.01)
            nursery.start_soon(broker.send_batch, messages("second", 2))
            await trio.sleep(0.05)
            assert broker.store.commitlog.durable_offset > first_end
            got = await broker.pull("orders", "g", "c1", 10, 0)
            # Durable on the leader, but the group has only the first batch.
            assert [m.message_id for m in got] == ["first-0", "first-1"]
            assert broker.query("orders", message_id="second-0") == []

            held: list[list[Message]] = []

            async def long_poll() -> None:
                held.append(await broker.pull("orders", "g", "c1", 10, 5_000))

            nursery.start_soon(long_poll)
            await trio.sleep(0.05)
            assert held == []  # nothing acknowledged to hand out: the PULL is held
            gate.move(commitlog=broker.store.commitlog.end_offset)
            await trio.sleep(0.01)
            assert [m.message_id for m in held[0]] == ["second-0", "second-1"]


async def test_the_tcp_server_answers_sends_and_commits_once_the_group_has_them(
    tmp_path: Path,
) -> None:
    async with gated_broker(tmp_path) as (broker, gate), trio.open_nursery() as nursery:
        addresses = await nursery.start(serve_broker, broker, "127.0.0.1", 0)
        client = await trio.to_thread.run_sync(RawClient, addresses[0])
        answers: dict[int, object] = {}

        async def read_answers() -> None:
            while True:
                event = await trio.to_thread.run_sync(client.next_event, abandon_on_cancel=True)
                answers[event.request_id] = event

        nursery.start_soon(read_answers)

        async def ask(request: object) -> int:
            rid = await trio.to_thread.run_sync(client.send, request)
            await trio.sleep(0.05)
            return rid

        async def answer(rid: int) -> object:
            with trio.fail_after(5):
                while rid not in answers:
                    await trio.sleep(0.005)
            return answers[rid]

        rid = await ask(SendBatch(messages("m", 2)))
        assert rid not in answers  # durable here, not the group's yet
        gate.move(commitlog=broker.store.commitlog.end_offset)
        sent = await answer(rid)
        assert isinstance(sent, SendBatchResult)
        assert [r.code for r in sent.results] == [ResultCode.OK] * 2

        # Not flagged durable, yet a member's commit waits for the group, on disk.
        rid = await ask(CommitOffset("g", "orders", 0, 1, durable=False))
        with trio.fail_after(5):  # the server may take longer than ask's pause to read it
            while not gate.waits[-1][0].startswith("offsets/"):
                await trio.sleep(0.005)
        assert rid not in answers
        generation, end = broker.offsets.position()
        assert gate.waits[-1] == (f"offsets/{generation}", end)
        assert broker.offsets.saved_version == broker.offsets.version
        gate.move(offsets={generation: end})
        assert isinstance(await answer(rid), CommitOffsetOk)

        rid = await ask(CommitOffset("g", "orders", 0, 2, durable=False))
        sent_rid = await ask(SendBatch(messages("n", 1)))
        gate.step_down()
        for waiting in (rid, sent_rid):
            refused = await answer(waiting)
            assert isinstance(refused, Error) and refused.code is ErrorCode.NOT_LEADER
        client.close()
        nursery.cancel_scope.cancel()


async def test_a_consumer_gets_its_next_messages_before_the_group_acknowledged_its_commit(
    tmp_path: Path,
) -> None:
    """The blocking consumer sends its commits in the write of its next PULL; in a group
    a commit is answered once the followers have it, and the pulled messages must not
    wait for that answer (it would add a follower's round trip to every message's
    lateness). The commit counts once answered; closing waits for it."""
    async with gated_broker(tmp_path) as (broker, gate), trio.open_nursery() as nursery:
        addresses = await nursery.start(serve_broker, broker, "127.0.0.1", 0)
        sending = trio.Event()

        async def send() -> None:
            await broker.send_batch(messages("m", 3))
            sending.set()

        nursery.start_soon(send)
        await trio.sleep(0.05)
        gate.move(commitlog=broker.store.commitlog.end_offset)
        await sending.wait()
        consumer = Consumer(
            f"127.0.0.1:{addresses[0][1]}", subject="orders", group="g", max_messages=1,
            pull_wait_ms=100, timeout_s=10,
        )  # fmt: skip
        try:
            first = await trio.to_thread.run_sync(consumer.receive, 5)
            assert first is not None and first.message_id == "m-0"
            with trio.fail_after(3):  # not the consumer's 10 s: the commit is never answered
                second = await trio.to_thread.run_sync(consumer.receive, 5)
            assert second is not None and second.message_id == "m-1"
            assert broker.offsets.get("g", "orders", 0) == 1  # sent, applied, unanswered
            with trio.fail_after(5):  # its answer waits for the group, which never comes
                while not any(kind.startswith("offsets/") for kind, _ in gate.waits):
                    await trio.sleep(0.01)

            async def acknowledge() -> None:  # the followers have every commit from now on
                while True:
                    gate.move(offsets=dict([broker.offsets.position()]))
                    await trio.sleep(0.01)

            nursery.start_soon(acknowledge)
            third = await trio.to_thread.run_sync(consumer.receive, 5)
            assert third is not None and third.message_id == "m-2"
        finally:
            await trio.to_thread.run_sync(consumer.close)
        assert broker.offsets.get("g", "orders", 0) == 3  # the last commit, at close
        nursery.cancel_scope.cancel()
