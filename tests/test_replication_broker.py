"""A broker group's replication end to end: a leader broker with producers and a
consumer committing, a follower broker copying its commitlog and its offsets log over
real TCP on 127.0.0.1 and deriving its consume queues, index, idempotency window and
offsets table with the code a restart uses; promotion; a divergent tail cut."""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from delayd.broker.broker import Broker, open_broker
from delayd.broker.config import BrokerConfig
from delayd.broker.replica import BrokerReplica, broker_epoch_history_path
from delayd.errors import RejectedError
from delayd.protocol.codes import ResultCode
from delayd.protocol.events import Message
from delayd.replication import COMMITLOG, EpochHistory, Follower, Leader
from delayd.replication.streams import BrokerStreams
from storage.crashfs import MODES, CrashSimFileSystem, crash_points, run_to_crash

GROUP = "bg"
SUBJECTS = ("orders", "payments")
CONFIG = BrokerConfig(
    queues_per_subject=3, segment_size=8192, checkpoint_interval_ms=50, dedupe_max_ids=4096
)


class BrokerMember:
    """A broker with its data directory, its streams and its epoch history."""

    def __init__(self, broker: Broker, data_dir: str) -> None:
        self.broker = broker
        self.data_dir = data_dir
        self.replica = BrokerReplica(broker)
        self.streams = BrokerStreams(self.replica.commitlog, broker.offsets)
        self.replica.signal_growth(self.streams.grew)
        self.history = EpochHistory.open(broker_epoch_history_path(data_dir))

    async def send(self, prefix: str, count: int) -> list[str]:
        """Store ``count`` messages over both subjects (some keyed); their ids."""
        messages = [
            Message(
                f"{prefix}-{i}",
                SUBJECTS[i % 2],
                body=f"{prefix} body {i}".encode() * (i % 5 + 1),
                key=None if i % 3 else f"k{i % 7}",
            )
            for i in range(count)
        ]
        results = await self.broker.send_batch(messages)
        assert {r.code for r in results} == {ResultCode.OK}
        return [m.message_id for m in messages]

    async def consume(self, group: str, count: int) -> int:
        """Join ``group`` on the first subject, pull up to ``count`` messages and commit
        each queue after them, as a consumer does; how many it got."""
        broker = self.broker
        subject = SUBJECTS[0]
        broker.join(group, subject, "c1", "conn", Broker.monotonic_ms())
        got = await broker.pull(subject, group, "c1", count, 0, "conn")
        ends: dict[int, int] = {}
        for message in got:
            ends[message.queue] = message.queue_offset + 1
        for queue, offset in ends.items():
            broker.commit(group, subject, queue, offset)
        return len(got)


@asynccontextmanager
async def running(data_dir: Path, config: BrokerConfig = CONFIG) -> AsyncIterator[BrokerMember]:
    async with open_broker(str(data_dir), config) as broker:
        member = BrokerMember(broker, str(data_dir))
        try:
            yield member
        finally:
            member.history.close()


def follower_of(member: BrokerMember, name: str, leader: Leader) -> tuple[Follower, BrokerReplica]:
    replica = member.replica
    replica.follow()
    follower = Follower(
        member.streams,
        member.history,
        group=GROUP,
        member=name,
        leader=leader.addresses[0],
        on_truncated=replica.on_truncated,
        on_durable=replica.on_durable,
        min_backoff_ms=10,
        max_backoff_ms=50,
    )
    return follower, replica


async def copy_until_caught_up(
    leading: BrokerMember, following: BrokerMember, *, epoch: int
) -> BrokerReplica:
    """``following`` copies from a Leader of ``leading`` at ``epoch`` until it caught
    up; then the leader stops. The follower's replica, to promote."""
    leader = Leader(leading.streams, leading.history, epoch, group=GROUP)
    async with trio.open_nursery() as nursery:
        await nursery.start(leader.run, "127.0.0.1", 0)
        follower, replica = follower_of(following, "b", leader)
        nursery.start_soon(follower.run)
        await caught_up(following, leading)
        nursery.cancel_scope.cancel()
    return replica


async def caught_up(follower: BrokerMember, leader: BrokerMember) -> None:
    """Wait (real time, bounded) until the follower holds and has derived everything
    the leader has."""
    with trio.fail_after(10):
        while True:
            ends = leader.streams.ends()
            copied = follower.streams.names() == list(ends) and all(
                follower.streams.get(n).durable_offset == e for n, e in ends.items()
            )
            store = follower.broker.store
            if (
                copied
                and store.reput_offset == leader.broker.store.commitlog.end_offset
                and follower.broker.offsets.items() == leader.broker.offsets.items()
            ):
                return
            await trio.sleep(0.005)


def stream_files(data_dir: Path) -> dict[str, bytes]:
    """The commitlog and offsets log files, by path relative to the data directory."""
    found = {}
    for sub in ("broker/commitlog", "broker/offsets"):
        directory = data_dir / sub
        for name in sorted(os.listdir(directory)):
            if name.isdigit():
                found[f"{sub}/{name}"] = (directory / name).read_bytes()
    return found


def queue_contents(broker: Broker) -> dict[tuple[str, int], list[tuple[int, bytes]]]:
    """Every consume queue's messages: (queue offset, delivered bytes) each."""
    out = {}
    for subject, queue in sorted(broker.store.queues):
        end = broker.store.queue_end(subject, queue)
        after, records = broker.store.read_queue(subject, queue, 0, end + 1, 1 << 30)
        assert after == end
        out[(subject, queue)] = list(enumerate(records))
    return out


def assert_same_broker(follower: BrokerMember, leader: BrokerMember, tmp_path: Path) -> None:
    assert stream_files(Path(follower.data_dir)) == stream_files(Path(leader.data_dir))
    assert sorted(follower.broker.offsets.items()) == sorted(leader.broker.offsets.items())
    assert queue_contents(follower.broker) == queue_contents(leader.broker)
    assert follower.broker.store.next_queue_offset == leader.broker.store.next_queue_offset


async def test_a_follower_copies_the_commitlog_and_offsets_and_derives_the_rest(
    tmp_path: Path,
) -> None:
    async with running(tmp_path / "a") as a, running(tmp_path / "b") as b:
        ids = await a.send("early", 40)  # before the follower comes: the backlog
        await a.consume("g1", 15)
        leader = Leader(a.streams, a.history, 5, group=GROUP, chunk_bytes=4096)
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            follower, replica = follower_of(b, "b", leader)
            nursery.start_soon(follower.run)
            for round_ in range(4):  # records stream to the follower as they happen
                ids += await a.send(f"r{round_}", 25)
                await a.consume("g1", 10)
                await a.consume("g2", 30)
                generation, end = a.broker.offsets.position()
                with trio.fail_after(5):
                    await leader.wait_acknowledged(COMMITLOG, a.broker.store.commitlog.end_offset)
                    await leader.wait_acknowledged(f"offsets/{generation:020d}", end)
            await caught_up(b, a)
            nursery.cancel_scope.cancel()
        assert_same_broker(b, a, tmp_path)
        assert b.broker.store.queues, "the follower derived consume queues"
        for message_id in ids:  # the follower's dedupe window and index know every id
            assert b.broker.window.find(message_id.encode()) == a.broker.window.find(
                message_id.encode()
            )
        assert [m.message_id for m in b.broker.query(SUBJECTS[1], message_id="r3-1")] == ["r3-1"]
        with pytest.raises(RejectedError, match="follows"):
            await b.broker.send_batch([Message("x", SUBJECTS[0], body=b"x")])
        with pytest.raises(RejectedError, match="follows"):
            b.broker.commit("g1", SUBJECTS[0], 0, 1)

        # Promotion: a consumer that rejoins (saying it holds the queues it read from the
        # old leader) resumes from the replicated offsets, and a producer's retry of a
        # stored id is a duplicate.
        replica.promote()
        committed = {q: b.broker.offsets.get("g1", SUBJECTS[0], q) for q in range(3)}
        assert committed == {q: a.broker.offsets.get("g1", SUBJECTS[0], q) for q in range(3)}
        b.broker.join("g1", SUBJECTS[0], "c9", "conn9", Broker.monotonic_ms(), held=(0, 1, 2))
        resumed = await b.broker.pull(SUBJECTS[0], "g1", "c9", 1000, 0, "conn9")
        first = {}
        for message in resumed:
            first.setdefault(message.queue, message.queue_offset)
        ends = {q: b.broker.store.queue_end(SUBJECTS[0], q) for q in range(3)}
        assert first == {q: o for q, o in committed.items() if o < ends[q]}
        again = await b.broker.send_batch([Message("r2-3", SUBJECTS[1], body=b"retry")])
        assert again[0].code is ResultCode.DUPLICATE


async def test_an_empty_follower_catches_up_across_offsets_compactions(tmp_path: Path) -> None:
    async with running(tmp_path / "a") as a:
        a.broker.offsets.compact_bytes = 600  # compact every few commits
        await a.send("m", 120)
        for round_ in range(12):
            await a.consume(f"g{round_ % 4}", 7)
            await a.broker.make_offsets_durable()  # compacts a grown generation
        compacted = a.broker.offsets.generations()
        assert compacted[0] > 0 and len(compacted) == 1, compacted
        leader = Leader(a.streams, a.history, 3, group=GROUP, chunk_bytes=512)
        async with running(tmp_path / "b") as b, trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            follower, _ = follower_of(b, "b", leader)
            nursery.start_soon(follower.run)
            await caught_up(b, a)
            for round_ in range(12):  # compactions while it follows
                await a.consume(f"g{round_ % 5}", 5)
                await a.broker.make_offsets_durable()  # compacts a grown generation
            await caught_up(b, a)
            with trio.fail_after(5):
                while b.broker.offsets.generations() != a.broker.offsets.generations():
                    await trio.sleep(0.005)  # the superseded generations go on b too
            assert a.broker.offsets.generations()[0] > compacted[0]
            assert leader.in_sync == {"b"}, "a removed generation holds nobody back"
            nursery.cancel_scope.cancel()
            assert_same_broker(b, a, tmp_path)
    # What the follower derived is what a restart of it derives.
    async with running(tmp_path / "b") as b, running(tmp_path / "a") as a:
        assert_same_broker(b, a, tmp_path)


async def test_a_divergent_tail_is_cut_and_its_derived_state_rebuilt(tmp_path: Path) -> None:
    """b followed a (epoch 5), then led epoch 6 alone and wrote a tail nobody has
    (messages, commits). a leads epoch 7 and writes other records at those offsets; b
    comes back as a's follower: it cuts the tail and what it derived from it."""
    async with running(tmp_path / "a") as a, running(tmp_path / "b") as b:
        await a.send("shared", 30)
        await a.consume("g1", 12)
        replica = await copy_until_caught_up(a, b, epoch=5)
        replica.promote()
        b.history.begin(6, b.streams.ends())
        tail_ids = await b.send("b-tail", 20)
        await b.consume("g1", 20)
        await b.consume("g-only-b", 5)
        assert b.broker.window.find(tail_ids[0].encode()) is not None
        leader = Leader(a.streams, a.history, 7, group=GROUP)
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            await a.send("a-new", 8)  # other records at the offsets of b's tail
            await a.consume("g1", 3)
            follower, _ = follower_of(b, "b", leader)
            nursery.start_soon(follower.run)
            await caught_up(b, a)
            nursery.cancel_scope.cancel()
        assert_same_broker(b, a, tmp_path)
        for message_id in tail_ids:
            assert b.broker.window.find(message_id.encode()) is None, "the cut ids are gone"
        assert b.broker.offsets.get("g-only-b", SUBJECTS[0], 0) is None
        assert b.broker.query(SUBJECTS[0], message_id=tail_ids[0]) == []
    async with running(tmp_path / "b") as b, running(tmp_path / "a") as a:
        assert_same_broker(b, a, tmp_path)  # the cut is durable: a restart agrees


async def test_promotion_derives_what_was_received_but_not_yet_flushed(tmp_path: Path) -> None:
    """Records a follower appended before it stopped, not yet flushed nor derived, are
    in their queues before the promoted broker's first append takes queue offsets."""
    async with running(tmp_path / "a") as a, running(tmp_path / "b") as b:
        await a.send("first", 20)
        replica = await copy_until_caught_up(a, b, epoch=3)
        start = b.broker.store.commitlog.end_offset
        await a.send("received", 12)
        data = a.broker.store.commitlog.read_raw(start, 1 << 20)
        b.streams.get(COMMITLOG).append_raw(start, data)  # the session ended here
        replica.promote()
        results = await b.broker.send_batch([Message("new", SUBJECTS[0], body=b"n")])
        assert results[0].code is ResultCode.OK
        end = b.broker.store.queue_end(SUBJECTS[0], results[0].queue)
        assert results[0].queue_offset == end - 1
        contents = queue_contents(b.broker)
        assert sum(map(len, contents.values())) == 33
        assert (
            contents[(SUBJECTS[0], results[0].queue)][-1][1]
            == b.broker.store.read_queue(SUBJECTS[0], results[0].queue, end - 1, 1, 1 << 20)[1][0]
        )


async def test_a_wiped_follower_resyncs_its_broker(tmp_path: Path) -> None:
    async with running(tmp_path / "a") as a:
        await a.send("m", 50)
        await a.consume("g1", 20)
        leader = Leader(a.streams, a.history, 2, group=GROUP)
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            async with running(tmp_path / "b") as b, trio.open_nursery() as following:
                follower, _ = follower_of(b, "b", leader)
                following.start_soon(follower.run)
                await caught_up(b, a)
                following.cancel_scope.cancel()
            shutil.rmtree(tmp_path / "b")  # the disk is wiped
            await a.send("more", 10)
            await a.consume("g2", 10)
            async with running(tmp_path / "b") as b, trio.open_nursery() as following:
                assert b.history.last_epoch() == 0
                follower, _ = follower_of(b, "b", leader)
                following.start_soon(follower.run)
                await caught_up(b, a)
                following.cancel_scope.cancel()
                assert_same_broker(b, a, tmp_path)
            nursery.cancel_scope.cancel()


# --- a power loss while a follower cuts its tail ------------------------------------------

CRASH_CONFIG = BrokerConfig(
    queues_per_subject=3,
    segment_size=4096,
    index_slot_count=64,
    index_max_entries=256,
    dedupe_max_ids=1024,  # the window's table is allocated whole: keep it small
)
NOW_MS = 1_800_000_000_000


def stored(broker: Broker, prefix: str, count: int) -> None:
    """Append ``count`` messages, make them durable and reput them, synchronously."""
    messages = [
        Message(f"{prefix}-{i}", SUBJECTS[i % 2], body=b"x" * (i % 40)) for i in range(count)
    ]
    assert {r.code for r in broker.append_batch(messages, NOW_MS)} == {ResultCode.OK}
    broker.store.commitlog.flush()
    broker.store.reput_durable()


def truncation_workload(fs: CrashSimFileSystem, cut_only: bool = False) -> None:
    """A broker with a reput checkpoint past ``cut`` cuts its commitlog back to it."""
    fs.mkdir("/data")
    fs.fsync_dir("/")
    broker = Broker.open("/data", CRASH_CONFIG, fs=fs, clock=lambda: NOW_MS)
    stored(broker, "kept", 30)
    cut = broker.store.commitlog.end_offset
    stored(broker, "cut", 30)
    broker.store.flush_derived(broker.store.checkpoint_snapshot(broker.window.oldest_offset))
    if cut_only:
        return
    broker.truncate_commitlog(cut)
    broker.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_power_loss_while_a_follower_cuts_its_tail_leaves_a_broker_that_opens(
    tmp_path: Path, mode: str
) -> None:
    """At every crash point of Broker.truncate_commitlog the broker reopens (no reput
    checkpoint, queue or index ahead of the commitlog), its queues hold exactly the
    commitlog's records and its dedupe window exactly their ids (a follower cut part
    way is cut again by its next session)."""
    before = crash_points(lambda fs: truncation_workload(fs, cut_only=True))
    after = crash_points(truncation_workload)
    assert after > before + 5
    for k in range(before, after + 1):
        fs = run_to_crash(truncation_workload, k, page_size=512)
        dest = tmp_path / f"{mode}-{k}"
        fs.materialize(str(dest), mode, random.Random(k))
        broker = Broker.open(str(dest / "data"), CRASH_CONFIG, clock=lambda: NOW_MS)
        try:
            records = list(broker.store.commitlog.iter_from(0))
            # The commitlog is whole, cut, or cut part way (its newest segments gone).
            assert 30 <= len(records) <= 60, k
            queued = sum(len(entries) for entries in queue_contents(broker).values())
            assert queued == len(records), k
            held = {f"kept-{i}" for i in range(30)} | {f"cut-{i}" for i in range(len(records) - 30)}
            known = {
                message_id
                for message_id in [f"kept-{i}" for i in range(30)] + [f"cut-{i}" for i in range(30)]
                if broker.window.find(message_id.encode()) is not None
            }
            assert known == held, k
        finally:
            broker.close()


async def test_a_leader_that_followed_for_a_while_leads_again(tmp_path: Path) -> None:
    """A leader steps down (a lease renewal unanswered, say), follows the new leader for
    a while, and leads again: the records it put as a follower are in its queues, so its
    next sends continue them, and every PULL, served from its cache of recent records
    or from its consume queues, gives each record once, in queue order."""
    async with running(tmp_path / "a") as a, running(tmp_path / "b") as b:
        ids = await a.send("first", 20)  # a leads: its reput caches what it puts
        end = a.broker.store.commitlog.end_offset
        b.replica.follow()
        b.streams.get(COMMITLOG).append_raw(0, a.broker.store.commitlog.read_raw(0, 1 << 20))
        b.replica.promote()
        ids += await b.send("second", 20)  # b leads now
        a.replica.follow()
        data = b.broker.store.commitlog.read_raw(end, 1 << 20)
        a.streams.get(COMMITLOG).append_raw(end, data)
        a.replica.promote()  # a leads again
        ids += await a.send("third", 20)
        pulled = []
        for subject in SUBJECTS:
            a.broker.join("g", subject, "c1", "conn", Broker.monotonic_ms())
            pulled += await a.broker.pull(subject, "g", "c1", 1000, 0, "conn")
        assert sorted(m.message_id for m in pulled) == sorted(ids)
        for subject, queue in a.broker.store.queues:
            offsets = [m.queue_offset for m in pulled if (m.subject, m.queue) == (subject, queue)]
            assert offsets == list(range(len(offsets)))
