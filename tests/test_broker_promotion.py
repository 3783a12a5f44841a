"""A broker member's high watermark at a promotion (delayd.server.broker_member), in
process: the follower's commitlog is copied byte for byte from a leader broker's, as
replication copies it, and a fake member runner says what the old leader told it the
group acknowledged. Promoted, it shows consumers (PULL, QUERY) only that much; the rest
once its own Leader says the in-sync followers have it too (Kafka's rule): a record
copied to this member only may still be cut by a later leader."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing

from delayd.broker.acked_checkpoint import AckedCheckpoint
from delayd.broker.broker import Broker, open_broker
from delayd.broker.config import BrokerConfig
from delayd.protocol import Message
from delayd.replication import COMMITLOG, EpochHistory, LeaderStopped
from delayd.replication.streams import EMBEDDED_BROKER_PREFIX, MESSAGE_LOG
from delayd.server.broker_member import ReplicatedBroker
from storage.errors import CorruptionError

CONFIG = BrokerConfig(queues_per_subject=1, checkpoint_interval_ms=60_000)
SUBJECT = "orders"


class FakeMember:
    """The member runner as ReplicatedBroker uses it: every wait acknowledged at once;
    ``told_acked`` as the old leader's RECORDS frames set it."""

    def __init__(self) -> None:
        self.told_acked: dict[str, int] = {}
        self.follower: FakeFollower | None = None

    def grew(self) -> None:
        pass

    async def wait_acknowledged(self, offset: int, *, stream: str) -> bool:
        return True


class FakeFollower:
    """The member's Follower: the acknowledged offsets its leader's frames carried."""

    def __init__(self, acked: dict[str, int]) -> None:
        self.acked = acked


class FakeLeader:
    """The new Leader's acknowledged commitlog offset, as the test moves it."""

    def __init__(self) -> None:
        self.acked = 0
        self._moved = trio.Event()

    def move(self, acked: int) -> None:
        self.acked = acked
        self._moved.set()
        self._moved = trio.Event()

    async def wait_acknowledged_past(self, stream: str, offset: int) -> int:
        while self.acked <= offset:
            await self._moved.wait()
        return self.acked


async def store(broker: Broker, prefix: str) -> int:
    """Three messages stored on the old leader; its commitlog end after them."""
    results = await broker.send_batch([Message(f"{prefix}-{i}", SUBJECT) for i in range(3)])
    assert all(r.code.is_success for r in results)
    return broker.store.commitlog.durable_offset


def copy_commitlog(source: Broker, target: ReplicatedBroker) -> None:
    """What a Follower does: the leader's bytes appended raw, fsynced, derived."""
    data = source.store.commitlog.read_raw(0, 1 << 20)
    stream = target.streams.get(COMMITLOG)
    stream.append_raw(0, data)
    stream.flush()
    target.broker.apply_replicated()


async def pulled_ids(broker: Broker, consumer: str) -> list[str]:
    """A new member of group ``c``: what a PULL that does not wait gives it."""
    broker.join("c", SUBJECT, consumer, consumer, broker.monotonic_ms())
    return [m.message_id for m in await broker.pull(SUBJECT, "c", consumer, 100, 0, consumer)]


async def test_a_promoted_member_shows_only_what_its_old_leader_said_was_acknowledged(
    tmp_path: Path,
) -> None:
    async with (
        open_broker(str(tmp_path / "old"), CONFIG) as old,
        open_broker(str(tmp_path / "new"), CONFIG) as new,
    ):
        acknowledged = await store(old, "a")  # the group had these
        copied_here_only = await store(old, "b")  # then the old leader died
        member = FakeMember()
        replicated = ReplicatedBroker(new)
        replicated.join(member, "")  # type: ignore[arg-type]
        replicated.following()
        copy_commitlog(old, replicated)
        member.told_acked[COMMITLOG] = acknowledged

        replicated.promoted()
        assert replicated.high_watermark == acknowledged
        assert await pulled_ids(new, "c-1") == ["a-0", "a-1", "a-2"]
        assert new.query(SUBJECT, message_id="b-0") == []  # QUERY stops there too
        assert [m.message_id for m in new.query(SUBJECT, message_id="a-0")] == ["a-0"]

        leader = FakeLeader()
        got: list[str] = []

        async def held_pull() -> None:
            messages = await new.pull(SUBJECT, "c", "c-1", 100, 10_000, "c-1")
            got.extend(m.message_id for m in messages)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(replicated.follow_high_watermark, leader)
            nursery.start_soon(held_pull)
            await trio.sleep(0.05)
            assert got == []  # held: nothing the group acknowledged is unread
            # The new leader's in-sync followers have the rest: it is the group's now.
            leader.move(copied_here_only)
            with trio.fail_after(5):
                while not got:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        assert got == ["b-0", "b-1", "b-2"]
        assert replicated.high_watermark == copied_here_only
        assert [m.message_id for m in new.query(SUBJECT, message_id="b-0")] == ["b-0"]


async def test_a_member_restarted_then_promoted_goes_by_its_acked_checkpoint(
    tmp_path: Path,
) -> None:
    """Told what the group acknowledged while it followed, then restarted and promoted
    before it copied anything again: its acked checkpoint, not its commitlog's end."""
    async with open_broker(str(tmp_path / "old"), CONFIG) as old:
        acknowledged = await store(old, "a")
        await store(old, "b")  # copied, never acknowledged
        async with open_broker(str(tmp_path / "new"), CONFIG) as new:
            member = FakeMember()
            replicated = ReplicatedBroker(new)
            replicated.join(member, "")  # type: ignore[arg-type]
            replicated.following()
            copy_commitlog(old, replicated)
            member.follower = FakeFollower({COMMITLOG: acknowledged})
            await replicated.durable({COMMITLOG: new.store.commitlog.durable_offset})
        async with open_broker(str(tmp_path / "new"), CONFIG) as restarted:
            replicated = ReplicatedBroker(restarted)
            replicated.join(FakeMember(), "")  # type: ignore[arg-type]
            replicated.following()
            replicated.promoted()
            assert replicated.high_watermark == acknowledged
            assert await pulled_ids(restarted, "c-1") == ["a-0", "a-1", "a-2"]


async def test_a_member_never_told_shows_the_commitlog_it_holds(tmp_path: Path) -> None:
    """Promoted never having followed, with no acked checkpoint: nothing to go by but
    its commitlog (a member whose commitlog predates its group)."""
    async with (
        open_broker(str(tmp_path / "old"), CONFIG) as old,
        open_broker(str(tmp_path / "new"), CONFIG) as new,
    ):
        end = await store(old, "a")
        replicated = ReplicatedBroker(new)
        replicated.join(FakeMember(), "")  # type: ignore[arg-type]
        replicated.following()
        copy_commitlog(old, replicated)
        replicated.promoted()
        assert replicated.high_watermark == end
        assert await pulled_ids(new, "c-1") == ["a-0", "a-1", "a-2"]


async def test_a_member_whose_history_predates_the_broker_streams_follows_with_none(
    tmp_path: Path,
) -> None:
    """A delay member upgraded from before its embedded broker was replicated: what its
    broker holds was delivered into it while it led alone, no copy of any leader's.
    Kept, the leader's records would be copied after its own (mixed, or refused
    forever at an offset that is no record boundary): it follows with nothing."""
    async with open_broker(str(tmp_path / "member"), CONFIG) as broker:
        replicated = ReplicatedBroker(broker)
        replicated.join(FakeMember(), EMBEDDED_BROKER_PREFIX)  # type: ignore[arg-type]
        await store(broker, "own")
        broker.join("c", SUBJECT, "c-1", "c-1", broker.monotonic_ms())
        broker.commit("c", SUBJECT, 0, 2)
        await broker.make_offsets_durable()
        history = EpochHistory.open(str(tmp_path / "epochs"))
        try:
            # No history: the leader cuts every stream to nothing (last epoch 0).
            assert not replicated.predates_replication(history)
            history.begin(7, {MESSAGE_LOG: 100})  # written before the broker joined
            assert replicated.predates_replication(history)
            replicated.following()
            await replicated.forget_own_records()
            assert broker.store.commitlog.end_offset == 0
            assert replicated.streams.ends() == dict.fromkeys(replicated.streams.names(), 0)
            assert broker.query(SUBJECT, message_id="own-0") == []
            assert broker.offsets.get("c", SUBJECT, 0) is None
            history.begin(
                8,
                {
                    MESSAGE_LOG: 100,
                    **{EMBEDDED_BROKER_PREFIX + name: 0 for name in replicated.streams.names()},
                },
            )
            assert not replicated.predates_replication(history)  # from then on it copies
        finally:
            history.close()


async def test_the_acked_checkpoint_saves_forward_at_most_once_an_interval(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    path = str(tmp_path / "broker" / "replication" / "acked")
    checkpoint = AckedCheckpoint(path, interval_s=1.0)
    assert checkpoint.read() is None
    await checkpoint.save(100)
    await checkpoint.save(200)  # too soon: the file may lag, never lead
    assert checkpoint.read() == 100
    await trio.sleep(1.0)
    await checkpoint.save(50)  # never backwards
    assert checkpoint.read() == 100
    await checkpoint.save(300)
    assert AckedCheckpoint(path).read() == 300
    with open(path, "r+b") as file:  # damaged: said so, not read as 0
        file.truncate(0)
    with pytest.raises(CorruptionError):
        checkpoint.read()


async def test_following_the_high_watermark_ends_quietly_when_the_leader_stops(
    tmp_path: Path,
) -> None:
    """The role loop runs it beside each Leader: the Leader's stop ends it, without an
    error (one would stop the server)."""

    class StoppingLeader:
        async def wait_acknowledged_past(self, stream: str, offset: int) -> int:
            await trio.sleep(0.01)
            raise LeaderStopped("the leader of group g was stopped")

    async with open_broker(str(tmp_path / "b"), CONFIG) as broker:
        replicated = ReplicatedBroker(broker)
        replicated.join(FakeMember(), "")  # type: ignore[arg-type]
        with trio.fail_after(5):
            await replicated.follow_high_watermark(StoppingLeader())  # type: ignore[arg-type]
