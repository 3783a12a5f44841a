"""Consumers across a failover of their broker, over real TCP with the public async
consumer: a message one consumer has in hand, not yet committed, is not handed to the
other when both join the new leader (docs/broker.md, "In a replicated group").

In process: one broker stands in for the old leader and the new one — it stops serving
(every connection closes, as at a kill -9 of the leader), follows, and is promoted
(what it held in memory is forgotten, as a new leader never had it), then serves on the
same port again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import pytest
import trio

import delayd
from delayd.broker import BrokerConfig, open_broker
from delayd.broker.server import serve_broker
from delayd.protocol import Message

CONFIG = BrokerConfig(queues_per_subject=4, heartbeat_timeout_ms=5000)
MESSAGES = 40  # 10 in each queue


async def serving(broker, port: int, nursery: trio.Nursery) -> tuple[trio.CancelScope, int]:
    """Serve ``broker`` on ``port`` (0: any) until the returned scope is cancelled;
    the port bound."""
    scope = trio.CancelScope()

    async def serve(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await serve_broker(broker, "127.0.0.1", port, task_status=task_status)

    bound = await nursery.start(serve)
    return scope, bound[0][1]


class InThread:
    """A blocking ``delayd.Consumer`` driven from trio: each call in a worker thread."""

    def __init__(self, consumer: delayd.Consumer) -> None:
        self.consumer = consumer

    @property
    def queues(self) -> tuple[int, ...]:
        return self.consumer.queues

    async def receive(self, timeout_s: float) -> Message | None:
        return await trio.to_thread.run_sync(self.consumer.receive, timeout_s)

    async def commit(self, message: Message) -> None:
        await trio.to_thread.run_sync(self.consumer.commit, message)


@asynccontextmanager
async def consumer(kind: str, port: int, name: str) -> AsyncIterator:
    """A consumer ``name`` of group g (``kind``: async or blocking), committing each
    message durably when told to, heartbeating every 0.1 s."""
    options = dict(subject="orders", group="g", auto_commit=False, commit="sync")
    address, heartbeats = f"127.0.0.1:{port}", dict(heartbeat_interval_s=0.1)
    if kind == "async":
        async with delayd.open_consumer(address, consumer_id=name, **heartbeats, **options) as c:
            yield c
        return
    blocking = delayd.Consumer(address, consumer_id=name, **heartbeats, **options)
    await trio.to_thread.run_sync(blocking.connect)
    try:
        yield InThread(blocking)
    finally:
        await trio.to_thread.run_sync(blocking.close)


async def receive_all(consumer, count: int) -> list[Message]:
    """``count`` messages (each committed), then none for half a second. Each may take
    10 s: after the failover the consumer waits out a back-off, connects and joins
    again, later on a loaded machine (a quiet second was not the end)."""
    got = []
    while len(got) < count:
        message = await consumer.receive(timeout_s=10)
        assert message is not None, f"{len(got)} of {count} received: {got}"
        got.append(message)
        await consumer.commit(message)
    assert await consumer.receive(timeout_s=0.5) is None
    return got


@pytest.mark.parametrize("kind", ["async", "blocking"])
async def test_a_message_in_a_consumers_hand_is_not_handed_to_another_after_a_failover(
    tmp_path: Path, kind: str
) -> None:
    """c1 (``kind``) has a message in hand when the broker fails over; c2 (async)
    joins the new leader first."""
    async with open_broker(str(tmp_path), CONFIG) as broker, trio.open_nursery() as nursery:
        server, port = await serving(broker, 0, nursery)
        async with AsyncExitStack() as stack:
            c1 = await stack.enter_async_context(consumer(kind, port, "c1"))
            c2 = await stack.enter_async_context(consumer("async", port, "c2"))
            with trio.fail_after(5):
                while broker.groups.in_handover("g", "orders") or c1.queues != (0, 1):
                    await trio.sleep(0.05)
            await broker.send_batch([Message(f"m-{i}", "orders") for i in range(MESSAGES)])
            in_hand = await c1.receive(timeout_s=5)
            assert in_hand is not None and in_hand.queue in (0, 1)

            server.cancel()  # the leader dies: every connection closes
            await trio.sleep(0.1)
            broker.follow()
            broker.promote()
            await serving(broker, port, nursery)

            # c2 joins the new leader first. Were every queue handed out at once, it
            # would read c1's from the committed offset: in_hand among them.
            seen_by_c2 = await receive_all(c2, MESSAGES // 2)
            assert {m.queue for m in seen_by_c2} == {2, 3}
            await c1.commit(in_hand)  # c1 joins again, gets 0 and 1 back, commits there
            seen_by_c1 = [in_hand, *await receive_all(c1, MESSAGES // 2 - 1)]
        ids_c1 = [m.message_id for m in seen_by_c1]
        ids_c2 = [m.message_id for m in seen_by_c2]
        assert not set(ids_c1) & set(ids_c2)
        assert sorted(ids_c1 + ids_c2) == sorted(f"m-{i}" for i in range(MESSAGES))
        assert broker.stats()["broker.promotion_unclaimed_queues_total"] == 0
        nursery.cancel_scope.cancel()
