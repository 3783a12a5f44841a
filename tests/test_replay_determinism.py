"""A follower derives the leader's schedule_log from the logs it receives.

A leader pipeline (real message_log, replayer, canceller, wheel, sender; in-memory
broker) takes sends, cancels and reschedules — of pending, delivered, cancelled, past
due and unknown messages — and delivers. Its message_log and dispatch_log are then
copied to a second data directory, as replication leaves them, and replayed there by a
replayer without a canceller (the follower), stopped and restarted on the way. The
follower's schedule_log buckets must be byte-identical to the leader's, every id must
look up to the same records, and the follower must write nothing to dispatch_log
(docs/cancel.md, "Reschedules and replication").
"""

from __future__ import annotations

import os
import random
import shutil
import threading
from collections import Counter

import pytest
import trio
import trio.testing

from delayd.logs import layout
from delayd.logs.buckets import bucket_name
from delayd.logs.dispatch_log import EntryKind
from delayd.logs.message_log import TYPE_RETIRE_BUCKET
from delayd.protocol.codes import CancelOutcome, RescheduleOutcome
from delayd.replay import open_replayer
from delayd.server.config import RetentionConfig
from delayd.server.retention import Retention
from storage.fs import OsFileSystem
from storage.scan import FRAME_GUESS
from storage.segmented_log import SegmentedLog
from tests.delivery_pipeline import T0, Pipeline, RecordingTarget, dispatch_entries

MINUTE = 60_000
SCALE = 1  # segment_scale_minutes of ServeConfig's default
LATE_ALLOWED_MS = 5_000  # how late (virtual) a loaded machine may make a delivery here


async def cancel(pipeline: Pipeline, message_id: str) -> CancelOutcome:
    answer = await pipeline.delivery.canceller.wait(pipeline.append_tombstone(message_id))
    assert isinstance(answer.outcome, CancelOutcome)
    return answer.outcome


async def reschedule(
    pipeline: Pipeline, message_id: str, due_ms: int, *, always_copies: bool = True
) -> RescheduleOutcome:
    answer = pipeline.append_tombstone(message_id, due_ms, always_copies=always_copies)
    await pipeline.delivery.canceller.wait(answer)
    assert isinstance(answer.outcome, RescheduleOutcome)
    return answer.outcome


def copy_replicated_logs(leader: str, follower: str) -> None:
    """What replication ships: message_log and dispatch_log, byte for byte."""
    for directory in (layout.message_log_dir, layout.dispatch_log_dir):
        shutil.copytree(directory(leader), directory(follower))


def files_of(directory: str) -> dict[str, bytes]:
    if not os.path.isdir(directory):
        return {}
    names = sorted(os.listdir(directory))
    return {name: open(os.path.join(directory, name), "rb").read() for name in names}


def replay_as_follower(data: str, steps: list[int | None], rng: random.Random) -> int:
    """Replay ``data`` without a canceller, as a follower: one process per element of
    ``steps`` (records replayed by it, None: all), each ending by a clean stop
    (checkpoint) or, at random, a crash (no checkpoint: recovery cuts what it wrote
    past the last one). Returns the tombstones the last process replayed."""
    tombstones = 0
    for records in steps:
        log = SegmentedLog.open(layout.message_log_dir(data))
        replayer = open_replayer(data, log, segment_scale=SCALE)
        assert replayer.on_tombstones is None  # the follower's mode: nothing decided
        left = records
        while left is None or left > 0:  # a step stops where tombstones begin or end
            replayed = replayer.replay_available(left)
            if not replayed:
                break
            left = None if left is None else left - replayed
        tombstones = replayer.tombstones_total
        if records is None or rng.random() < 0.5:
            replayer.checkpoint()
        replayer.close()
        log.close()
    return tombstones


def lookups(data: str, message_ids: list[str]) -> dict[str, list[tuple[int, int, bytes]]]:
    """Every id's records through the id index, as (bucket, offset, payload)."""
    log = SegmentedLog.open(layout.message_log_dir(data))
    replayer = open_replayer(data, log, segment_scale=SCALE)
    try:
        assert replayer.index is not None
        return {
            message_id: sorted(
                (at.bucket_ms, at.offset, at.payload) for at in replayer.index.lookup(message_id)
            )
            for message_id in message_ids
        }
    finally:
        replayer.close()
        log.close()


def assert_follower_derives_the_same(
    leader: str, follower: str, message_ids: list[str], steps: list[int | None], seed: int = 0
) -> None:
    copy_replicated_logs(leader, follower)
    dispatch_before = files_of(layout.dispatch_log_dir(follower))
    replayed = replay_as_follower(follower, steps, random.Random(seed))
    assert replayed or len(steps) > 1
    leader_buckets = files_of(layout.schedule_log_dir(leader))
    follower_buckets = files_of(layout.schedule_log_dir(follower))
    assert list(follower_buckets) == list(leader_buckets)
    for name, data in leader_buckets.items():
        assert follower_buckets[name] == data, f"schedule_log/{name} differs"
    assert files_of(layout.dispatch_log_dir(follower)) == dispatch_before  # wrote nothing
    leader_index = lookups(leader, message_ids)
    assert lookups(follower, message_ids) == leader_index
    assert any(len(records) > 1 for records in leader_index.values())  # copies were made


async def deliver_until(pipeline: Pipeline, until_ms: int) -> None:
    """Run ``pipeline`` (a restarted or promoted member) until ``until_ms`` on the
    pipeline's clock, stop and close it."""
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        await trio.sleep_until((until_ms - T0) / 1000)
        await pipeline.stop()
        nursery.cancel_scope.cancel()
    pipeline.close()


def entry_kinds(data: str) -> Counter[EntryKind]:
    return Counter(e.kind for entries in dispatch_entries(data).values() for e in entries)


async def run_leader(data: str, *, always_copies: bool = True) -> list[str]:
    """The leader's story; returns every id it was asked about (one never sent)."""
    target = RecordingTarget("a")
    pipeline = Pipeline(data, [target])
    early, soon, pending, far, doomed, to_now, twice, past_due = pipeline.schedule(
        [
            T0 + 1000,
            T0 + 2000,
            T0 + 30_000,
            T0 + 3 * MINUTE,
            T0 + 3 * MINUTE + 5,
            T0 + 2 * MINUTE,
            T0 + 4 * MINUTE,
            T0 - 5000,  # due before it was received: at once
        ]
    )
    moved, refused, unknown = (
        RescheduleOutcome.RESCHEDULED,
        RescheduleOutcome.ALREADY_DELIVERED,
        (RescheduleOutcome.UNKNOWN),
    )

    async def move(message_id: str, due_ms: int) -> RescheduleOutcome:
        return await reschedule(pipeline, message_id, due_ms, always_copies=always_copies)

    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        await trio.sleep(5)  # early, soon and past_due are delivered
        assert await move(early, T0 + 5 * MINUTE) is refused
        assert await move(past_due, T0 + 2 * MINUTE) is refused
        assert await move(pending, T0 + 4 * MINUTE + 1) is moved  # in the wheel
        assert await move(far, T0 + 20_000) is moved  # not loaded: into a loaded bucket
        assert await cancel(pipeline, doomed) is CancelOutcome.CANCELLED
        assert await move(doomed, T0 + 4 * MINUTE) is unknown  # cancelled: not moved
        assert await move("never-sent", T0 + MINUTE) is unknown  # nothing to copy
        assert await move(to_now, pipeline.now_ms()) is moved  # a time in the past: now
        assert await move(twice, T0 + 5 * MINUTE) is moved
        assert await move(twice, T0 + 3 * MINUTE) is moved
        # Messages after the tombstones land behind the copies, in the same buckets.
        later = pipeline.schedule([T0 + 4 * MINUTE + 2, T0 + 3 * MINUTE + 9])
        assert await cancel(pipeline, twice) is CancelOutcome.CANCELLED
        assert await move(soon, T0 + MINUTE) is refused
        await trio.sleep_until(6 * MINUTE / 1000)
        assert await move(pending, T0 + 7 * MINUTE) is refused  # delivered at its new time
        await pipeline.stop()
        nursery.cancel_scope.cancel()
    delivered = sorted(r.message.message_id for r in target.received)
    assert delivered == sorted([early, soon, past_due, pending, far, to_now, *later])
    pipeline.close()
    return [early, soon, pending, far, doomed, to_now, twice, past_due, *later, "never-sent"]


async def test_a_follower_derives_byte_identical_buckets(tmp_path, clock):
    leader, follower = str(tmp_path / "leader"), str(tmp_path / "follower")
    ids = await run_leader(leader)
    counted = entry_kinds(leader)
    # Each refused reschedule of a message that had a record left a void copy.
    assert counted[EntryKind.NOT_MOVED] == 5
    assert counted[EntryKind.RESCHEDULED] == 5
    # Restarted between and inside runs of tombstones, with and without checkpoints.
    assert_follower_derives_the_same(leader, follower, ids, [5, 3, 1, 4, 2, None])


async def test_a_follower_running_the_replay_task_derives_the_same(tmp_path, clock):
    """The follower as a server runs it: ``Replayer.run`` until stopped, its tombstone
    steps under the append lock, then a checkpoint."""
    leader, follower = str(tmp_path / "leader"), str(tmp_path / "follower")
    ids = await run_leader(leader)
    copy_replicated_logs(leader, follower)
    log = SegmentedLog.open(layout.message_log_dir(follower))
    replayer = open_replayer(follower, log, segment_scale=SCALE)
    async with trio.open_nursery() as nursery:
        await nursery.start(replayer.run)
        await replayer.stop()
    assert replayer.tombstones_total == 13 and replayer.checkpointed_position == log.end_offset
    replayer.close()
    log.close()
    assert files_of(layout.schedule_log_dir(follower)) == files_of(layout.schedule_log_dir(leader))
    assert lookups(follower, ids) == lookups(leader, ids)


async def test_a_follower_replays_the_reschedules_of_an_older_version(tmp_path, clock):
    """Reschedules of type 4 (written before groups) appended their copy only when the
    message moved. A follower, or a member that rebuilds its derived state from the
    logs, copies exactly where the leader's RESCHEDULED entries say it moved: the
    data directory replays the same as when it was written."""
    leader, follower = str(tmp_path / "leader"), str(tmp_path / "follower")
    ids = await run_leader(leader, always_copies=False)
    counted = entry_kinds(leader)
    assert counted[EntryKind.NOT_MOVED] == 0  # nothing void: no copy when refused
    assert counted[EntryKind.RESCHEDULED] == 5
    assert_follower_derives_the_same(leader, follower, ids, [2, 7, None])


async def test_a_restart_that_lost_a_void_entry_voids_the_same_copy(tmp_path, clock):
    """A crash after a refused reschedule, before the replay checkpoint, that lost its
    NOT_MOVED entry: the restart replays the tombstone again, appends the same copy at
    the same offset and voids it again. Nothing is delivered twice or lost."""
    data = str(tmp_path / "data")
    pipeline = Pipeline(data, [RecordingTarget("a")])
    pipeline.replayer.checkpoint_interval_s = 3600.0
    delivered, pending = pipeline.schedule([T0 + 1000, T0 + 3 * MINUTE])
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        await trio.sleep(3)
        refused = RescheduleOutcome.ALREADY_DELIVERED
        assert await reschedule(pipeline, delivered, T0 + 2 * MINUTE) is refused
        moved = RescheduleOutcome.RESCHEDULED
        assert await reschedule(pipeline, pending, T0 + 2 * MINUTE + 1) is moved
        nursery.cancel_scope.cancel()
    assert pipeline.replayer.checkpointed_position < pipeline.log.end_offset
    pipeline.close()  # as a crash: no checkpoint past the tombstones
    buckets = files_of(layout.schedule_log_dir(data))
    void_bucket = os.path.join(layout.dispatch_log_dir(data), "202611221002")
    assert [e.kind for e in dispatch_entries(data)["202611221002"]] == [EntryKind.NOT_MOVED]
    os.truncate(void_bucket, 0)  # its only entry, lost

    target = RecordingTarget("a")
    again = Pipeline(data, [target])
    await deliver_until(again, T0 + 5 * MINUTE)
    assert [(r.message.message_id, r.at_ms) for r in target.received] == [
        (pending, T0 + 2 * MINUTE + 1)
    ]
    assert files_of(layout.schedule_log_dir(data)) == buckets  # the same copies, in place
    assert again.delivery.canceller.reschedules[refused] == 1  # replayed, refused again
    # The void copy (first in the bucket) voided again; the moved one behind it sent.
    entries = dispatch_entries(data)["202611221002"]
    assert [(e.kind, e.offset) for e in entries][:1] == [(EntryKind.NOT_MOVED, 0)]
    assert [e.offset > 0 for e in entries if e.kind is EntryKind.DISPATCHED] == [True]


@pytest.mark.parametrize("seed", range(3))
async def test_random_operations_derive_the_same_buckets(tmp_path, clock, seed):
    """Random sends, cancels and reschedules (to the past and future, of any id) while
    delivery runs; then a follower replays in random steps with random crashes."""
    rng = random.Random(seed)
    leader, follower = str(tmp_path / "leader"), str(tmp_path / "follower")
    pipeline = Pipeline(leader, [RecordingTarget("a")])
    ids: list[str] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        for _ in range(50):
            choice = rng.random()
            now = pipeline.now_ms()
            if choice < 0.35 or not ids:
                # Few distinct due times: each is a jump of the clock, after 50 ms idle.
                dues = [now + rng.randrange(-1, 24) * 10_000 for _ in range(rng.randrange(1, 4))]
                ids += pipeline.schedule(dues)
            elif choice < 0.5:
                await cancel(pipeline, rng.choice(ids))
            elif choice < 0.85:
                message_id = rng.choice([*ids, "nobody"])
                await reschedule(pipeline, message_id, now + rng.randrange(-6, 24) * 10_000)
            else:
                await trio.sleep(rng.randrange(1, 40))
        await trio.sleep(6 * MINUTE / 1000)
        await pipeline.stop()
        nursery.cancel_scope.cancel()
    pipeline.close()
    counted = entry_kinds(leader)
    assert counted[EntryKind.RESCHEDULED] and counted[EntryKind.NOT_MOVED]  # both kinds
    steps: list[int | None] = [rng.randrange(1, 20) for _ in range(rng.randrange(1, 6))]
    assert_follower_derives_the_same(leader, follower, [*ids, "nobody"], [*steps, None], seed)


async def test_a_promoted_follower_decides_what_replication_did_not_bring(tmp_path, clock):
    """The old leader decided a cancel, a move and a refused move, but none of its
    dispatch_log reached the follower. Promoted, the follower decides those tombstones
    again before it delivers (``Canceller.take_over``): the cancelled message is never
    sent, the moved one only at its new time, the delivered one's void copy never —
    it is resent once (in doubt: the old leader may have sent it; a broker answers
    DUPLICATE)."""
    leader, follower = str(tmp_path / "leader"), str(tmp_path / "follower")
    pipeline = Pipeline(leader, [RecordingTarget("a")])
    sent, doomed, moved, kept = pipeline.schedule([T0 + 1000, *[T0 + 3 * MINUTE] * 3])
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        await trio.sleep(3)
        assert await reschedule(pipeline, sent, T0 + 5 * MINUTE) is (
            RescheduleOutcome.ALREADY_DELIVERED
        )
        assert await cancel(pipeline, doomed) is CancelOutcome.CANCELLED
        assert await reschedule(pipeline, moved, T0 + 4 * MINUTE) is RescheduleOutcome.RESCHEDULED
        await pipeline.stop()
        nursery.cancel_scope.cancel()
    pipeline.close()
    shutil.copytree(layout.message_log_dir(leader), layout.message_log_dir(follower))
    replay_as_follower(follower, [None], random.Random(0))

    target = RecordingTarget("a")
    promoted = Pipeline(follower, [target])
    read_back = promoted.replayer.tombstones_between
    readers: list[threading.Thread] = []

    def tombstones_between(start: int, end: int):
        readers.append(threading.current_thread())
        return read_back(start, end)

    promoted.replayer.tombstones_between = tombstones_between  # type: ignore[method-assign]
    assert await promoted.delivery.canceller.take_over(promoted.replayer) == 3
    # message_log is read back off the event loop: a long log does not stall it.
    assert readers and threading.main_thread() not in readers
    await deliver_until(promoted, T0 + 6 * MINUTE)
    got = {r.message.message_id: r.at_ms for r in target.received}
    assert len(target.received) == len(got) == 3  # each once
    # Each at its own time, not before; a worker thread outlasting the clock's hold on
    # a loaded machine may make one late in virtual time, never early or at the other's.
    assert set(got) == {sent, moved, kept}
    assert T0 + 4 * MINUTE <= got[moved] < T0 + 4 * MINUTE + LATE_ALLOWED_MS
    assert T0 + 3 * MINUTE <= got[kept] < T0 + 3 * MINUTE + LATE_ALLOWED_MS
    assert got[sent] < T0 + 5 * MINUTE  # the resend, not the void copy


async def test_a_bucket_the_leader_retires_goes_at_the_same_record_on_a_follower(tmp_path, clock):
    """Retention on the leader retires a delivered bucket (a RETIRE_BUCKET record, whose
    replay deletes the files); a reschedule of one of its messages after that finds no
    record to copy. A follower that holds the bucket's dispatch_log replays message_log:
    it deletes the bucket's files exactly at that record, and its schedule_log stays
    byte-identical to the leader's — had it kept the bucket, the reschedule would copy
    the message there (docs/replication.md, "Retention in a group")."""
    leader, follower = str(tmp_path / "leader"), str(tmp_path / "follower")
    pipeline = Pipeline(leader, [RecordingTarget("a")])
    config = RetentionConfig(interval_ms=1000, bucket_ms=0, message_log_ms=3_600_000)
    retention = Retention(config, pipeline.log, pipeline.replayer, pipeline.delivery)
    old, pending = pipeline.schedule([T0 + 1000, T0 + 4 * MINUTE])
    name = bucket_name(T0)
    leader_bucket = os.path.join(layout.schedule_log_dir(leader), name)
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        await trio.sleep(3 * MINUTE / 1000)  # delivered, COMPLETE, the loader past it
        # The follower copied the bucket's dispatch_log before the leader retired it.
        shutil.copytree(layout.dispatch_log_dir(leader), layout.dispatch_log_dir(follower))
        assert name in os.listdir(layout.dispatch_log_dir(follower))
        for _ in range(10):
            await retention.run_pass()
            await trio.sleep(1)
            if not os.path.exists(leader_bucket):
                break
        assert not os.path.exists(leader_bucket)
        assert pipeline.replayer.retired_total == 1
        assert await reschedule(pipeline, old, T0 + 5 * MINUTE) is RescheduleOutcome.UNKNOWN
        assert await reschedule(pipeline, pending, T0 + 5 * MINUTE) is (
            RescheduleOutcome.RESCHEDULED
        )
        await pipeline.stop()
        nursery.cancel_scope.cancel()
    pipeline.close()
    assert name not in os.listdir(layout.dispatch_log_dir(leader))

    shutil.copytree(layout.message_log_dir(leader), layout.message_log_dir(follower))
    log = SegmentedLog.open(layout.message_log_dir(follower))
    (retired_at,) = [r.offset for r in log.iter_from(0) if r.type == TYPE_RETIRE_BUCKET]
    replayer = open_replayer(follower, log, segment_scale=SCALE)
    files = [
        os.path.join(directory(follower), name)
        for directory in (
            layout.schedule_log_dir,
            layout.dispatch_log_dir,
        )
    ]
    while replayer.replay_available(1):
        past = replayer.position > retired_at
        assert [os.path.exists(path) for path in files] == [not past, not past]
    assert replayer.retired_total == 1
    replayer.checkpoint()
    replayer.close()
    log.close()
    assert files_of(layout.schedule_log_dir(follower)) == files_of(layout.schedule_log_dir(leader))
    assert lookups(follower, [old, pending]) == lookups(leader, [old, pending])
    assert [bucket for bucket, _, _ in lookups(follower, [old])[old]] == []


class MessageLogReads(OsFileSystem):
    """The real file system, counting the bytes read from message_log's segments."""

    def __init__(self, data: str) -> None:
        self.directory = layout.message_log_dir(data)
        self.segment_fds: set[int] = set()
        self.bytes_read = 0

    def open(self, path: str, flags: int) -> int:
        fd = super().open(path, flags)
        if path.startswith(self.directory):
            self.segment_fds.add(fd)
        else:
            self.segment_fds.discard(fd)
        return fd

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        data = super().pread(fd, size, offset)
        if fd in self.segment_fds:
            self.bytes_read += len(data)
        return data


async def test_a_take_over_reads_the_tombstones_only_and_misses_none(tmp_path, clock):
    """A follower restarts with its replay checkpoint between two runs of tombstones
    (five cancels and a move each): the ones below it are found by the scan at start,
    which runs while replay passes (and notes) the ones above it. Promoted, it decides
    all twelve again — a missed cancel would be delivered, a missed move at its old
    time — and reads from message_log the tombstone records only, one read each, not
    the thousand messages around them."""
    leader, follower = str(tmp_path / "leader"), str(tmp_path / "follower")
    pipeline = Pipeline(leader, [RecordingTarget("a")])

    async def cancel_five_and_move_one(batch: list[str]) -> None:
        for doomed in batch[1:100:20]:
            assert await cancel(pipeline, doomed) is CancelOutcome.CANCELLED
        assert await reschedule(pipeline, batch[3], T0 + 4 * MINUTE) is (
            RescheduleOutcome.RESCHEDULED
        )

    first = pipeline.schedule([T0 + 3 * MINUTE] * 500)
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        await cancel_five_and_move_one(first)
        second = pipeline.schedule([T0 + 3 * MINUTE] * 500)
        await cancel_five_and_move_one(second)
        await pipeline.stop()
        nursery.cancel_scope.cancel()
    pipeline.close()
    shutil.copytree(layout.message_log_dir(leader), layout.message_log_dir(follower))
    with SegmentedLog.open(layout.message_log_dir(follower)) as log:
        replayer = open_replayer(follower, log, segment_scale=SCALE)
        while replayer.tombstones_total < 6 or replayer.replayed_total < 700:
            replayer.replay_available(100)
        replayer.checkpoint()
        replayer.close()

    reads = MessageLogReads(follower)
    target = RecordingTarget("a")
    promoted = Pipeline(follower, [target], fs=reads)
    promoted.delivery.derive_tombstones()  # following
    assert 0 < promoted.replayer.tombstones.replay_start < promoted.log.end_offset
    async with trio.open_nursery() as nursery:
        nursery.start_soon(promoted.replayer.scan_tombstones)
        while promoted.replayer.replay_available():
            pass
    assert promoted.replayer.tombstones_total == 6  # the rest, noted by this replay
    reads.bytes_read = 0
    decided = await promoted.delivery.canceller.take_over(promoted.replayer)
    promoted.delivery.decide_tombstones()
    assert decided == 12
    assert 0 < reads.bytes_read <= decided * FRAME_GUESS < promoted.log.end_offset / 4
    await deliver_until(promoted, T0 + 5 * MINUTE)
    got = {r.message.message_id: r.at_ms for r in target.received}
    cancelled = {*first[1:100:20], *second[1:100:20]}
    assert len(target.received) == len(got) == 1000 - len(cancelled)
    assert not cancelled & got.keys()
    # Moved: at the new time, not the old one (a worker thread outlasting the clock's
    # hold on a loaded machine may make a delivery late in virtual time, never early).
    for moved in (first[3], second[3]):
        assert T0 + 4 * MINUTE <= got[moved] < T0 + 4 * MINUTE + 30_000
