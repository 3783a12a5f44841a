"""The broker's side of a rebalance: a queue that moves is served to its new owner only
once the old owner let go of it (its HEARTBEAT's held queues), left, or overstayed
``heartbeat_timeout_ms``; the new owner starts at the committed offset. trio's
autojump clock stands in for time."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import trio

from delayd.broker import Broker, BrokerConfig, open_broker
from delayd.protocol import Message

CONFIG = BrokerConfig(index_slot_count=1009, index_max_entries=50, heartbeat_timeout_ms=3000)


async def two_members(broker: Broker) -> tuple[tuple[int, ...], dict[int, list[int]]]:
    """ "a" reads 40 messages of every queue and commits the first of each; then "b"
    joins. Returns b's target queues, and the offsets a was handed per queue."""
    await broker.send_batch([Message(f"m-{i}", "orders") for i in range(40)])
    broker.join("g", "orders", "a", "conn-a", broker.monotonic_ms())
    handed: dict[int, list[int]] = defaultdict(list)
    for m in await broker.pull("orders", "g", "a", 100, 0):
        handed[m.queue].append(m.queue_offset)
    for queue in handed:
        broker.commit("g", "orders", queue, 1)
    return broker.join("g", "orders", "b", "conn-b", broker.monotonic_ms()), handed


async def pull_b(broker: Broker, wait_ms: int = 0) -> list[Message]:
    return await broker.pull("orders", "g", "b", 100, wait_ms, "conn-b")


async def test_the_new_owner_reads_a_queue_once_the_old_one_let_go(tmp_path):
    async with open_broker(str(tmp_path), CONFIG) as broker:
        b_queues, handed = await two_members(broker)
        assert b_queues and set(b_queues) <= set(handed)
        assert await pull_b(broker) == []  # a still holds them
        a_queues = broker.heartbeat("g", "orders", "a", "conn-a", broker.monotonic_ms(), held=())
        assert not set(a_queues) & set(b_queues)
        got = await pull_b(broker)
        # From the committed offset (1): what a was handed and did not commit comes to
        # b, as a confirmed it dropped them unseen.
        assert sorted((m.queue, m.queue_offset) for m in got) == sorted(
            (q, o) for q in b_queues for o in handed[q] if o >= 1
        )
        assert broker.stats()["broker.rebalance_handovers_total"] == len(b_queues)


async def test_a_held_pull_of_the_new_owner_is_woken_by_the_hand_over(tmp_path, clock):
    async with open_broker(str(tmp_path), CONFIG) as broker:
        b_queues, _ = await two_members(broker)
        got: list[Message] = []
        async with trio.open_nursery() as nursery:

            async def pull() -> None:
                got.extend(await pull_b(broker, wait_ms=30_000))

            nursery.start_soon(pull)
            await trio.sleep(1)
            assert got == []
            start = trio.current_time()
            broker.heartbeat("g", "orders", "a", "conn-a", broker.monotonic_ms(), held=())
        assert got and {m.queue for m in got} <= set(b_queues)
        assert trio.current_time() - start < 0.1


async def test_an_old_owner_that_never_lets_go_is_overruled_after_the_timeout(tmp_path, clock):
    async with open_broker(str(tmp_path), CONFIG) as broker:
        b_queues, _ = await two_members(broker)
        revoked_at = trio.current_time()
        got: list[Message] = []
        async with trio.open_nursery() as nursery:

            async def stubborn_a() -> None:
                every = list(range(broker.queue_count("orders")))
                while True:  # alive, but holding on to every queue
                    broker.heartbeat("g", "orders", "a", "conn-a", broker.monotonic_ms(), every)
                    await trio.sleep(1)

            async def pull() -> None:
                got.extend(await pull_b(broker, wait_ms=60_000))
                nursery.cancel_scope.cancel()

            nursery.start_soon(stubborn_a)
            nursery.start_soon(pull)
        waited = trio.current_time() - revoked_at
        assert 3.0 <= waited < 3.2  # heartbeat_timeout_ms
        assert got and {m.queue for m in got} <= set(b_queues)
        assert broker.groups.members("g", "orders") == ["a", "b"]


async def test_a_version_1_heartbeat_lets_go_at_once(tmp_path):
    async with open_broker(str(tmp_path), CONFIG) as broker:
        b_queues, _ = await two_members(broker)
        broker.heartbeat("g", "orders", "a", "conn-a", broker.monotonic_ms(), held=None)
        assert {m.queue for m in await pull_b(broker)} == set(b_queues)


async def test_a_leaving_owner_lets_go_and_a_revoked_queue_given_back_restarts(tmp_path):
    config = dataclasses.replace(CONFIG, heartbeat_timeout_ms=60_000)
    async with open_broker(str(tmp_path), config) as broker:
        b_queues, handed = await two_members(broker)
        broker.connection_closed("conn-b")  # b leaves before a let go: a keeps them
        # a's cursors of the queues it was told it lost restarted at the committed
        # offset (it drops what it prefetched of them when it reads the revoke), so
        # those messages come again; its other queues go on where they were.
        again = await broker.pull("orders", "g", "a", 100, 0, "conn-a")
        assert sorted((m.queue, m.queue_offset) for m in again) == sorted(
            (q, o) for q in b_queues for o in handed[q] if o >= 1
        )
        broker.join("g", "orders", "b", "conn-b", broker.monotonic_ms())
        broker.connection_closed("conn-a")  # a leaves while holding b's queues
        got = await pull_b(broker)
        assert {m.queue for m in got} == set(handed)  # all of them, at once


async def failed_over(broker: Broker) -> None:
    """The group fails over to this broker: it followed, and leads again (in process,
    one broker stands in for the old leader and the new one: what it held in memory
    is forgotten at the promotion, as a new leader never had it)."""
    broker.follow()
    broker.promote()


async def test_a_promoted_broker_gives_each_queue_back_to_the_member_that_holds_it(tmp_path):
    async with open_broker(str(tmp_path), CONFIG) as broker:
        await broker.send_batch([Message(f"m-{i}", "orders") for i in range(40)])
        for member in ("a", "b"):
            broker.join("g", "orders", member, f"conn-{member}", broker.monotonic_ms())
        a_queues = broker.heartbeat("g", "orders", "a", "conn-a", broker.monotonic_ms(), held=())
        b_queues = broker.heartbeat("g", "orders", "b", "conn-b", broker.monotonic_ms(), held=())
        in_hand = await broker.pull("orders", "g", "a", 100, 0, "conn-a")  # not committed
        assert {m.queue for m in in_hand} == set(a_queues)
        await failed_over(broker)
        # b rejoins first: its queues come back to it, a's wait for a (b's PULL would
        # otherwise read what a has in hand).
        now = broker.monotonic_ms()
        assert broker.join("g", "orders", "b", "conn-b2", now, held=b_queues) == tuple(range(4))
        assert {m.queue for m in await broker.pull("orders", "g", "b", 100, 0, "conn-b2")} == set(
            b_queues
        )
        broker.join("g", "orders", "a", "conn-a2", broker.monotonic_ms(), held=a_queues)
        assert await broker.pull("orders", "g", "b", 100, 0, "conn-b2") == []
        again = await broker.pull("orders", "g", "a", 100, 0, "conn-a2")
        assert sorted(m.message_id for m in again) == sorted(m.message_id for m in in_hand)
        stats = broker.stats()
        assert stats["broker.promotion_held_queues_total"] == 4
        assert stats["broker.promotion_held_queues"] == 0
        assert stats["broker.promotion_unclaimed_queues_total"] == 0


async def test_a_queue_nobody_claims_goes_out_after_the_heartbeat_timeout(tmp_path, clock):
    async with open_broker(str(tmp_path), CONFIG) as broker:
        await broker.send_batch([Message(f"m-{i}", "orders") for i in range(40)])
        broker.join("g", "orders", "a", "conn-a", broker.monotonic_ms())
        await failed_over(broker)
        promoted_at = trio.current_time()
        broker.join("g", "orders", "b", "conn-b", broker.monotonic_ms(), held=())
        assert broker.stats()["broker.promotion_held_queues"] == 4
        got = await pull_b(broker, wait_ms=30_000)  # woken when the claims end
        assert 3.0 <= trio.current_time() - promoted_at < 3.1  # heartbeat_timeout_ms
        assert {m.queue for m in got} == set(range(4))
        stats = broker.stats()
        assert stats["broker.promotion_unclaimed_queues_total"] == 4
        assert stats["broker.promotion_held_ms_total"] == 4 * 3000
