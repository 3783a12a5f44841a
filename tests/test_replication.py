"""Replication's data path end to end: a leader and followers in one trio process, each
with its own data directory, over real TCP on 127.0.0.1, with real files (and the crash
simulator for a follower that loses power)."""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import trio
import trio.testing

from delayd.logs import layout
from delayd.replication import (
    MESSAGE_LOG,
    DelayStreams,
    EpochHistory,
    Follower,
    FollowRefused,
    Leader,
    LeaderFenced,
    LeaderStopped,
    dispatch_stream,
)
from delayd.replication.metrics import ReplicationCollector
from storage.crashfs import CrashSimFileSystem, SimulatedCrash
from storage.fs import FileSystem

GROUP = "g1"
BUCKETS = ["202611221530", "202611221531", "202611221545"]
SEGMENT_SIZE = 4096  # small: the copies roll segments


class Member:
    """A member's data directory with its streams and epoch history open."""

    def __init__(self, data_dir: Path | str, fs: FileSystem | None = None) -> None:
        self.data_dir = str(data_dir)
        options = {} if fs is None else {"fs": fs}
        self.streams = DelayStreams(self.data_dir, segment_size=SEGMENT_SIZE, **options)
        self.history = EpochHistory.open_in(self.data_dir, **options)

    def close(self) -> None:
        self.streams.close()
        self.history.close()

    def append_messages(self, count: int, tag: bytes = b"m") -> int:
        """Append ``count`` message_log records as intake does (batch, flush, notify);
        returns the new end."""
        rng = random.Random(f"{tag!r}:{self.streams.message_log.end_offset}")
        payloads = [tag + rng.randbytes(rng.randint(10, 400)) for _ in range(count)]
        log = self.streams.message_log
        log.append_batch(payloads)
        log.flush()
        self.streams.grew()
        return log.end_offset

    def append_dispatch(self, bucket: str, count: int) -> int:
        file = self.streams.get(dispatch_stream(bucket))
        file.append_batch([os.urandom(32) for _ in range(count)], 2)
        file.flush()
        self.streams.grew()
        return file.end_offset


def log_files(data_dir: str) -> dict[str, bytes]:
    """Every stream file of a data directory, by path relative to it."""
    found = {}
    for directory in (layout.message_log_dir(data_dir), layout.dispatch_log_dir(data_dir)):
        if not os.path.isdir(directory):
            continue
        for name in sorted(os.listdir(directory)):
            if name.isdigit():
                path = os.path.join(directory, name)
                with open(path, "rb") as file:
                    found[os.path.relpath(path, data_dir)] = file.read()
    return found


async def caught_up(follower: Member, leader: Member) -> None:
    """Wait (real time, bounded) until the follower holds the leader's ends durably."""
    with trio.fail_after(10):
        while True:
            ends = leader.streams.ends()
            if all(follower.streams.get(n).durable_offset == e for n, e in ends.items()):
                return
            await trio.sleep(0.005)


async def in_sync(leader: Leader, followers: set[str]) -> None:
    """Wait (real time, bounded) until the leader's in-sync set is ``followers``."""
    with trio.fail_after(5):
        while leader.in_sync != followers:
            await trio.sleep(0.005)


@contextmanager
def members(tmp_path: Path, *names: str) -> Iterator[list[Member]]:
    opened = [Member(tmp_path / name) for name in names]
    try:
        yield opened
    finally:
        for member in opened:
            member.close()


def follower_of(member: Member, name: str, leader: Leader, **options) -> Follower:
    return Follower(
        member.streams,
        member.history,
        group=GROUP,
        member=name,
        leader=leader.addresses[0],
        min_backoff_ms=10,
        max_backoff_ms=50,
        **options,
    )


async def test_copies_are_byte_identical_as_streams_grow(tmp_path: Path) -> None:
    with members(tmp_path, "a", "b") as (a, b):
        a.append_messages(30)  # before the follower comes: the backlog
        a.append_dispatch(BUCKETS[0], 5)
        leader = Leader(a.streams, a.history, 5, group=GROUP, chunk_bytes=2048)
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            nursery.start_soon(follower_of(b, "b", leader).run)
            await caught_up(b, a)
            for round_ in range(5):  # appends stream to the follower as they happen
                end = a.append_messages(7)
                a.append_dispatch(BUCKETS[round_ % len(BUCKETS)], 3)  # new buckets appear
                with trio.fail_after(5):
                    await leader.wait_acknowledged(MESSAGE_LOG, end)
                assert b.streams.message_log.durable_offset >= end
            await caught_up(b, a)
            assert leader.in_sync == {"b"}
            nursery.cancel_scope.cancel()
        assert b.history.last_epoch() == 5
    copied = log_files(str(tmp_path / "b"))
    assert len([p for p in copied if p.startswith("delay/message_log")]) > 3  # rolled
    assert len([p for p in copied if p.startswith("delay/dispatch_log")]) == len(BUCKETS)
    assert copied == log_files(str(tmp_path / "a"))


async def test_a_wiped_follower_resyncs_in_full(tmp_path: Path) -> None:
    with members(tmp_path, "a") as (a,):
        a.append_messages(20)
        a.append_dispatch(BUCKETS[1], 4)
        leader = Leader(a.streams, a.history, 3, group=GROUP)
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            b = Member(tmp_path / "b")
            following = trio.CancelScope()
            nursery.start_soon(_run_in, following, follower_of(b, "b", leader))
            await caught_up(b, a)
            following.cancel()
            b.close()
            shutil.rmtree(tmp_path / "b")  # the disk is wiped
            a.append_messages(10)
            b = Member(tmp_path / "b")
            assert b.history.last_epoch() == 0
            nursery.start_soon(follower_of(b, "b", leader).run)
            await caught_up(b, a)
            nursery.cancel_scope.cancel()
        b.close()
    assert log_files(str(tmp_path / "b")) == log_files(str(tmp_path / "a"))


async def _run_in(scope: trio.CancelScope, follower: Follower) -> None:
    with scope:
        await follower.run()


async def test_a_returning_old_leader_cuts_its_unacknowledged_tail(tmp_path: Path) -> None:
    """Old leader a (epoch 5) wrote records the group acknowledged (b has them) and a
    tail nobody else has (an unacknowledged message_log tail and a dispatch_log bucket
    b never saw). b leads epoch 8 and writes other records at those offsets; a comes
    back as b's follower: it cuts its tail and then holds b's copy exactly."""
    with members(tmp_path, "a", "b") as (a, b):
        first = a.append_messages(25)
        old = Leader(a.streams, a.history, 5, group=GROUP)
        async with trio.open_nursery() as nursery:
            await nursery.start(old.run, "127.0.0.1", 0)
            following = trio.CancelScope()
            nursery.start_soon(_run_in, following, follower_of(b, "b", old))
            with trio.fail_after(5):
                await old.wait_acknowledged(MESSAGE_LOG, first)
            following.cancel()
            acknowledged = old.acknowledged(MESSAGE_LOG)
            nursery.cancel_scope.cancel()
        assert acknowledged == a.streams.message_log.end_offset
        a.append_messages(12, b"old-tail")  # never reached b: never acknowledged
        a.append_dispatch(BUCKETS[2], 3)
        diverged_at = acknowledged
        truncated: list[tuple[str, int]] = []
        ends_before_cut: dict[str, int] = {}

        async def on_truncating(stream: str, offset: int) -> None:
            # Before the cut: the server removes what it derived first.
            ends_before_cut[stream] = a.streams.get(stream).end_offset

        async def on_truncated(stream: str, offset: int) -> None:
            truncated.append((stream, offset))

        new = Leader(b.streams, b.history, 8, group=GROUP)
        async with trio.open_nursery() as nursery:
            await nursery.start(new.run, "127.0.0.1", 0)
            b.append_messages(9, b"new")  # other records at the same offsets
            following = follower_of(
                a, "a", new, on_truncating=on_truncating, on_truncated=on_truncated
            )
            nursery.start_soon(following.run)
            await caught_up(a, b)
            end = b.append_messages(3, b"new")
            with trio.fail_after(5):
                await new.wait_acknowledged(MESSAGE_LOG, end)
            nursery.cancel_scope.cancel()
        assert sorted(truncated) == [
            (dispatch_stream(BUCKETS[2]), 0),
            (MESSAGE_LOG, diverged_at),
        ]
        assert ends_before_cut[MESSAGE_LOG] > diverged_at
        assert ends_before_cut[dispatch_stream(BUCKETS[2])] > 0
        assert [entry.epoch for entry in a.history.entries] == [5, 8]
        assert b.history.end_of(5) == {MESSAGE_LOG: diverged_at}
    copy = log_files(str(tmp_path / "a"))
    copy.pop(f"delay/dispatch_log/{BUCKETS[2]}")  # cut to nothing: an empty file is left
    assert copy == log_files(str(tmp_path / "b"))
    assert (tmp_path / "a" / "delay" / "dispatch_log" / BUCKETS[2]).stat().st_size == 0


async def test_a_leader_of_an_older_epoch_is_refused_and_fenced(tmp_path: Path) -> None:
    with members(tmp_path, "a", "b") as (a, b):
        b.history.begin(9, b.streams.ends())  # b followed epoch 9 already
        end = a.append_messages(5)
        stale = Leader(a.streams, a.history, 6, group=GROUP)
        async with trio.open_nursery() as nursery:
            await nursery.start(stale.run, "127.0.0.1", 0)
            follower = follower_of(b, "b", stale)
            nursery.start_soon(follower.run)
            with trio.fail_after(5), pytest.raises(LeaderFenced, match="seen epoch 9"):
                await stale.wait_acknowledged(MESSAGE_LOG, end)
            assert isinstance(stale.stopped, LeaderFenced)
            with trio.fail_after(5):
                while follower.last_error is None:
                    await trio.sleep(0.005)
            nursery.cancel_scope.cancel()
        assert b.streams.message_log.end_offset == 0  # nothing of the stale leader's
        assert isinstance(follower.last_error, FollowRefused)
        assert "fenced by epoch 9" in str(follower.last_error)


async def test_a_follower_refuses_a_stale_leader_by_its_own_history(tmp_path: Path) -> None:
    """Even when the stale leader does not see the newer epoch in FOLLOW (b's history
    says 9 but the leader of 6 only learns it from b's FENCED), b copies nothing."""
    with members(tmp_path, "a", "b") as (a, b):
        a.append_messages(5)
        stale = Leader(a.streams, a.history, 6, group=GROUP)
        async with trio.open_nursery() as nursery:
            await nursery.start(stale.run, "127.0.0.1", 0)
            follower = follower_of(b, "b", stale)
            b.history.begin(9, {})
            # FOLLOW is built from the history before the check: a follower whose
            # history grew meanwhile answers a TRUNCATE_TO of epoch 6 with FENCED.
            with pytest.raises(FollowRefused, match="fenced by epoch 9"):
                await follower.follow_once()
            nursery.cancel_scope.cancel()
        assert b.streams.message_log.end_offset == 0


async def test_acks_wait_for_the_slowest_in_sync_follower_and_min_in_sync(tmp_path: Path) -> None:
    """b keeps up, c stops: an ack waits for c until c leaves the in-sync set (after
    replica_lag_ms, the hook called first), then needs b only; with min_in_sync=2 acks
    wait until c catches up and is back in the set."""
    lag_ms = 300
    with members(tmp_path, "a", "b", "c") as (a, b, c):
        changes: list[tuple[float, frozenset[str]]] = []

        async def on_in_sync_change(new_set: frozenset[str]) -> None:
            await trio.sleep(0.05)  # persisting it (etcd) takes a while
            changes.append((trio.current_time(), new_set))

        leader = Leader(
            a.streams,
            a.history,
            4,
            group=GROUP,
            replica_lag_ms=lag_ms,
            min_in_sync=1,
            on_in_sync_change=on_in_sync_change,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            nursery.start_soon(follower_of(b, "b", leader).run)
            c_scope = trio.CancelScope()
            nursery.start_soon(_run_in, c_scope, follower_of(c, "c", leader))
            with trio.fail_after(5):
                while leader.in_sync != {"b", "c"}:
                    await trio.sleep(0.01)
            c_scope.cancel()  # c stops following
            appended_at = trio.current_time()
            end = a.append_messages(10)
            with trio.fail_after(5):
                await leader.wait_acknowledged(MESSAGE_LOG, end)
            acked_at = trio.current_time()
            assert c.streams.message_log.end_offset < end
            assert changes[-1][1] == {"b"}
            assert changes[-1][0] <= acked_at  # the shrink was persisted first
            assert acked_at - appended_at >= lag_ms / 1000 - 0.02  # it waited for c

            leader.tracker.min_in_sync = 2  # now acks need two followers
            end = a.append_messages(4)
            waiting = trio.Event()

            async def ack() -> None:
                await leader.wait_acknowledged(MESSAGE_LOG, end)
                waiting.set()

            nursery.start_soon(ack)
            await trio.sleep(lag_ms / 1000)
            assert not waiting.is_set()  # b has it, but one in-sync follower is too few
            assert b.streams.message_log.durable_offset >= end
            nursery.start_soon(follower_of(c, "c", leader).run)  # c comes back
            with trio.fail_after(5):
                await waiting.wait()
            assert leader.in_sync == {"b", "c"}
            assert changes[-1][1] == {"b", "c"}
            assert c.streams.message_log.durable_offset >= end
            nursery.cancel_scope.cancel()


class TaskSteps(trio.abc.Instrument):
    """Counts the steps of the tasks whose name ends in ``name``: how often they were
    woken."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task.name.endswith(self.name):
            self.steps += 1


async def test_ack_waiters_sleep_through_appends_the_group_cannot_acknowledge(
    tmp_path: Path,
) -> None:
    """Every append and flush signals growth; an ack waiter wakes only when an
    acknowledged offset moves (here: once the in-sync follower copied the records),
    not at each of them: under load the leader's event loop does not run every
    waiter at every append."""
    with members(tmp_path, "a", "b") as (a, b):
        leader = Leader(a.streams, a.history, 5, group=GROUP, in_sync=frozenset({"b"}),
                        replica_lag_ms=60_000)  # fmt: skip
        steps = TaskSteps("waiter")
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            end = a.streams.message_log.end_offset
            for _ in range(20):
                end = a.append_messages(5)
            acknowledged = trio.Event()

            async def waiter() -> None:
                await leader.wait_acknowledged(MESSAGE_LOG, end)
                acknowledged.set()

            trio.lowlevel.add_instrument(steps)
            nursery.start_soon(waiter, name="waiter")
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(20):
                a.append_messages(5)  # b is in the set and has copied nothing
                await trio.testing.wait_all_tasks_blocked()
            assert steps.steps == 1  # its first step only: no append woke it
            nursery.start_soon(follower_of(b, "b", leader).run)
            with trio.fail_after(5):
                await acknowledged.wait()
            trio.lowlevel.remove_instrument(steps)
            nursery.cancel_scope.cancel()


async def test_the_in_sync_task_sleeps_through_a_members_copying(tmp_path: Path) -> None:
    """Under load the leader grows and its in-sync follower reports thousands of times
    a second; neither can take the follower out of the set before the look the
    in-sync task has planned, so they do not wake it. A member that falls behind
    still leaves the set once replica_lag_ms has passed."""
    with members(tmp_path, "a", "b") as (a, b):
        leader = Leader(a.streams, a.history, 5, group=GROUP, replica_lag_ms=500)
        steps = TaskSteps("Leader._maintain_in_sync")
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            following = trio.CancelScope()
            nursery.start_soon(_run_in, following, follower_of(b, "b", leader))
            with trio.fail_after(5):
                end = a.append_messages(5)
                await leader.wait_acknowledged(MESSAGE_LOG, end)  # b joined the set
            trio.lowlevel.add_instrument(steps)
            for _ in range(30):
                end = a.append_messages(5)
                with trio.fail_after(5):
                    await leader.wait_acknowledged(MESSAGE_LOG, end)
            trio.lowlevel.remove_instrument(steps)
            assert leader.in_sync == {"b"}
            assert steps.steps <= 2  # 60 growths and 30 reports or more: a look at most
            following.cancel()
            a.append_messages(5)
            with trio.fail_after(5):
                while leader.in_sync:
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()


async def test_ack_leader_mode_returns_at_once_and_exports_the_lag(tmp_path: Path) -> None:
    with members(tmp_path, "a", "b") as (a, b):
        a.append_messages(3)
        leader = Leader(a.streams, a.history, 2, group=GROUP, ack="leader")
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            scope = trio.CancelScope()
            nursery.start_soon(_run_in, scope, follower_of(b, "b", leader))
            await caught_up(b, a)
            with trio.fail_after(5):
                while leader.lag() != {"b": 0}:  # b's DURABLE report arrived
                    await trio.sleep(0.005)
            scope.cancel()
            end = a.append_messages(6)
            with trio.fail_after(0.5):
                await leader.wait_acknowledged(MESSAGE_LOG, end)  # no follower needed
            assert leader.lag() == {"b": end - b.streams.message_log.end_offset}
            assert leader.lag()["b"] > 0
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("crash_at", [0.3, 0.6, 0.9])
async def test_a_follower_that_loses_power_mid_copy_recovers_and_resumes(
    tmp_path: Path, crash_at: float
) -> None:
    with members(tmp_path, "a") as (a,):
        a.append_messages(40)
        a.append_dispatch(BUCKETS[0], 6)
        leader = Leader(a.streams, a.history, 7, group=GROUP, chunk_bytes=1500)
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            # A first, complete copy counts the crash points of the follower's disk.
            setup_ops, copy_ops = await _copy_on(CrashSimFileSystem(), leader, a)
            fs = CrashSimFileSystem()
            fs.crash_after(setup_ops + int((copy_ops - setup_ops) * crash_at))
            with pytest.raises(BaseExceptionGroup) as crashed:
                await _copy_on(fs, leader, a, until_crash=True)
            assert crashed.value.split(SimulatedCrash)[0] is not None
            # What the follower had reported durable before the power went (how much
            # that is depends on how its group commits fell: timing, not the rule).
            reported = leader.tracker.durable.get("b", {}).get(MESSAGE_LOG, 0)
            root = tmp_path / "b"
            fs.materialize(str(root), "torn", random.Random(crash_at))
            b = Member(root / "data")
            durable_before = b.streams.message_log.end_offset
            assert durable_before >= reported  # nothing reported durable was lost
            nursery.start_soon(follower_of(b, "b", leader).run)
            a.append_messages(5)
            await caught_up(b, a)
            nursery.cancel_scope.cancel()
        b.close()
    assert log_files(str(root / "data")) == log_files(str(tmp_path / "a"))


async def _copy_on(
    fs: CrashSimFileSystem, leader: Leader, source: Member, until_crash: bool = False
) -> tuple[int, int]:
    """Follow ``leader`` with a member on ``fs`` until it holds ``source``'s streams
    (``until_crash``: and then more, the leader appending, until the power goes);
    returns the crash points taken by opening the member and by the whole copy."""
    fs.mkdir("/data")
    fs.fsync_dir("/")
    member = Member("/data", fs)
    setup_ops = fs.ops
    follower = follower_of(member, "b", leader)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(follower.follow_once)
        await caught_up(member, source)
        ops = fs.ops
        while until_crash:
            source.append_messages(3)
            await caught_up(member, source)
        nursery.cancel_scope.cancel()
    return setup_ops, ops


async def test_stopping_the_leader_releases_every_waiter(tmp_path: Path) -> None:
    with members(tmp_path, "a") as (a,):
        leader = Leader(a.streams, a.history, 2, group=GROUP)
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            end = a.append_messages(2)  # no follower: min_in_sync=1 is never met
            nursery.start_soon(_stop_soon, leader)
            with trio.fail_after(5), pytest.raises(LeaderStopped, match="was stopped"):
                await leader.wait_acknowledged(MESSAGE_LOG, end)
        assert leader.stopped is not None
        assert a.history.last_epoch() == 2  # run began the epoch


async def _stop_soon(leader: Leader) -> None:
    await trio.sleep(0.05)
    leader.stop()


async def test_retention_in_a_group_waits_for_the_in_sync_set_and_tells_the_followers(
    tmp_path: Path,
) -> None:
    """Leader a may delete message_log only below what its in-sync follower b has
    durable; it tells b where its copy now begins (RETAINED), and b's server deletes the
    same. c, a new member, lacks what a deleted: it is refused with the reason, a says
    so too, and a goes on serving b."""
    with members(tmp_path, "a", "b", "c") as (a, b, c):
        a.append_messages(60)
        told: list[int] = []

        async def on_retained(starts: dict[str, int]) -> None:
            told.append(starts[MESSAGE_LOG])

        leader = Leader(a.streams, a.history, 5, group=GROUP, replica_lag_ms=100_000)
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            following = trio.CancelScope()

            async def follow_b() -> None:
                with following:
                    await follower_of(b, "b", leader, on_retained=on_retained).run()

            nursery.start_soon(follow_b)
            await caught_up(b, a)
            await in_sync(leader, {"b"})
            copied = b.streams.message_log.durable_offset
            following.cancel()  # b stops; a appends more: b has not copied it
            a.append_messages(60)
            assert leader.copied_by_in_sync(MESSAGE_LOG) == copied  # b's, not a's end
            log = a.streams.message_log
            assert log.delete_before(leader.copied_by_in_sync(MESSAGE_LOG)) >= 2
            start = log.min_offset
            assert 0 < start <= copied

            nursery.start_soon(follower_of(b, "b", leader, on_retained=on_retained).run)
            await caught_up(b, a)
            with trio.fail_after(5):
                while not told:
                    await trio.sleep(0.005)
            assert told[-1] == start  # where a's copy begins: b's server trims to it

            refused = follower_of(c, "c", leader)
            nursery.start_soon(refused.run)
            with trio.fail_after(5):
                while refused.last_error is None:
                    await trio.sleep(0.005)
            assert isinstance(refused.last_error, FollowRefused)
            assert f"message_log ends at 0 here, the leader's begins at {start}" in str(
                refused.last_error
            )
            assert "cannot catch up by copying" in str(refused.last_error)
            assert leader.lacking["c"] == {MESSAGE_LOG: 0}
            lacks = "delayd_replication_follower_deleted_lag_bytes"
            assert (lacks, {"member": "c"}, start) in [
                (sample.name, sample.labels, sample.value)
                for family in ReplicationCollector(lambda: leader).collect()
                for sample in family.samples
            ]
            assert "c" not in leader.in_sync
            assert c.streams.message_log.end_offset == 0  # nothing copied

            end = a.append_messages(60)  # b is still served
            with trio.fail_after(5):
                await leader.wait_acknowledged(MESSAGE_LOG, end)
            await caught_up(b, a)
            # A deletion during b's session: the next growth tells it.
            assert log.delete_before(leader.copied_by_in_sync(MESSAGE_LOG)) >= 2
            a.append_messages(1)
            with trio.fail_after(5):
                while told[-1] != log.min_offset:
                    await trio.sleep(0.005)
            assert log.min_offset > start
            nursery.cancel_scope.cancel()


async def test_a_wiped_member_of_the_in_sync_set_leaves_it_before_it_begins_an_epoch(
    tmp_path: Path,
) -> None:
    """b, in sync, comes back wiped well within replica_lag_ms. Once truncated it begins
    an epoch in its history, and a member with a history that the group lists in sync
    may campaign: the leader must have persisted the set without b before then."""
    with members(tmp_path, "a") as (a,):
        persisted: list[frozenset[str]] = []

        async def on_in_sync_change(new_set: frozenset[str]) -> None:
            await trio.sleep(0.2)  # persisting it (etcd) takes a while
            persisted.append(new_set)

        a.append_messages(20)
        leader = Leader(
            a.streams,
            a.history,
            3,
            group=GROUP,
            replica_lag_ms=60_000,
            on_in_sync_change=on_in_sync_change,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            b = Member(tmp_path / "b")
            following = trio.CancelScope()
            nursery.start_soon(_run_in, following, follower_of(b, "b", leader))
            await in_sync(leader, {"b"})
            following.cancel()
            b.close()
            shutil.rmtree(tmp_path / "b")  # the disk is wiped
            b = Member(tmp_path / "b")
            nursery.start_soon(follower_of(b, "b", leader).run)
            with trio.fail_after(5):
                while b.history.last_epoch() == 0:
                    await trio.sleep(0.001)
            assert persisted[-1] == frozenset()  # out of the set before its epoch began
            await caught_up(b, a)
            await in_sync(leader, {"b"})  # and back in once it has everything
            nursery.cancel_scope.cancel()
        b.close()
