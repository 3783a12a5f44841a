"""A snapshot taken just after a bucket was retired (docs/replication.md, "Resync from a
snapshot"): the leader's replay checkpoint P was written before a RESCHEDULE moved a
message out of bucket B and before B's RETIRE_BUCKET record; the replay of that record
deletes B's files. A member that installs a snapshot replays from the snapshot's
checkpoint: had the snapshot said P and left B out, the replay of the reschedule would
find nothing to copy and the moved message would never be delivered.

The retirement is replayed before the snapshot is taken, or while it is (just after it
read its checkpoint, or just after it listed schedule_log: the two points where a
deletion could slip past it), with B open when P was written (P names its length) or
not (a restart closed it: P does not name it); or after (the snapshot holds B, and the
member deletes it at the record). No sockets: the snapshot's files go through a
SnapshotReceiver as the follower's would."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import trio.testing

import delayd.server.snapshot as snapshot_module
from delayd.logs import layout, message_log, retirement, tombstone
from delayd.logs.buckets import bucket_name
from delayd.replay import Replayer, open_replayer
from delayd.replay.state import read_replay_checkpoint
from delayd.replication.snapshot import Snapshot, SnapshotError, SnapshotReceiver, read_chunk
from delayd.server.config import RetentionConfig
from delayd.server.retention import Retention
from delayd.server.snapshot import DelaySnapshots, install_received_snapshot
from storage.fs import REAL_FS
from storage.segmented_log import SegmentedLog
from tests.delivery_pipeline import T0, Pipeline, RecordingTarget
from tests.test_replay_determinism import files_of, lookups
from tests.test_retirement_crash import message

MINUTE = 60_000
B = T0  # the bucket retired
B1 = T0 + 2 * MINUTE  # filled after a restart, so that P names only it
B2 = T0 + 4 * MINUTE  # where the reschedule moves the message
MOVED = "m1"  # the message in B that a reschedule moves to B2
MOVED_DUE = B2 + 20


class LeaderData:
    """A leader's data directory, replayed by a replayer without a canceller (as every
    member derives schedule_log: the leader's canceller appends the same copies)."""

    def __init__(self, data: str) -> None:
        self.data = data
        self.sequence = 0
        self.dues: dict[str, int] = {}
        self.log = SegmentedLog.open(layout.message_log_dir(data))
        self.replayer = self._open_replayer()

    def _open_replayer(self) -> Replayer:
        return open_replayer(self.data, self.log, segment_scale=1)

    def schedule(self, due_ms: int) -> str:
        """Append a message due at ``due_ms``; its id."""
        self.sequence += 1
        self.log.append_batch([message(self.sequence, due_ms)], message_log.TYPE_MESSAGE)
        message_id = f"m{self.sequence}"
        self.dues[message_id] = due_ms
        return message_id

    def reschedule(self, message_id: str, due_ms: int) -> None:
        stone = tombstone.Tombstone(message_id, T0, due_ms)
        self.log.append_batch([tombstone.encode(stone)], stone.rtype)
        self.dues[message_id] = due_ms

    def retire(self, start_ms: int) -> None:
        """Append the retirement retention appends for the (delivered) bucket."""
        path = os.path.join(layout.schedule_log_dir(self.data), bucket_name(start_ms))
        record = retirement.Retirement(start_ms, os.path.getsize(path), T0)
        self.log.append_batch([retirement.encode(record)], message_log.TYPE_RETIRE_BUCKET)

    def replay(self) -> None:
        self.log.flush()
        while self.replayer.replay_available():  # a step ends where a retirement begins
            pass

    def restart(self) -> None:
        self.replayer.checkpoint()
        self.replayer.close()
        self.replayer = self._open_replayer()

    def close(self) -> None:
        self.replay()
        self.replayer.checkpoint()
        self.replayer.close()
        self.log.close()


def retired_after_checkpoint(data: str, *, named: bool) -> tuple[LeaderData, int]:
    """Checkpoint P (naming B when ``named``), then a reschedule of B's message into B2,
    replayed, then B's retirement, appended but not replayed. Returns P too."""
    leader = LeaderData(data)
    leader.schedule(T0 + 30_000)  # in B: the message moved
    leader.schedule(B2 + 10)
    leader.replay()
    if not named:
        leader.restart()  # nothing open: the next checkpoint names only B1
        leader.schedule(B1)
        leader.replay()
    leader.replayer.checkpoint()
    position = leader.replayer.checkpointed_position
    assert (B in read_replay_checkpoint(leader.log.fs, data).bucket_sizes) is named
    leader.reschedule(MOVED, MOVED_DUE)
    leader.replay()  # the copy is in B2 now, the checkpoint still at P
    leader.retire(B)
    assert leader.replayer.checkpointed_position == position
    return leader, position


def install(snapshot: Snapshot, member: str) -> None:
    """What a follower does with the snapshot it is sent, then its start."""
    receiver = SnapshotReceiver(layout.received_snapshot_dir(member))
    receiver.begin(snapshot.manifest())
    for index, file in enumerate(snapshot.files):
        receiver.write(index, 0, read_chunk(file.path, 0, file.size))
    receiver.finish()
    receiver.close()
    snapshot.release()
    install_received_snapshot(member)


def follow_and_replay(leader: str, member: str) -> None:
    """Copy message_log from the snapshot's checkpoint on (every segment is byte-identical
    to the leader's up to where the member's ends) and replay as a follower does."""
    segments = layout.message_log_dir(member)
    shutil.copytree(layout.message_log_dir(leader), segments, dirs_exist_ok=True)
    follower = LeaderData(member)
    assert follower.replayer.on_tombstones is None
    follower.close()


def once_after(name: str, action: Callable[[], None], monkeypatch) -> None:
    """Run ``action`` right after the first call of ``delayd.server.snapshot``'s
    ``name`` returns (the point of DelaySnapshots.take it stands for)."""
    original = getattr(snapshot_module, name)
    pending = [action]

    def then_act(*args, **kwargs):
        result = original(*args, **kwargs)
        while pending:
            pending.pop()()
        return result

    monkeypatch.setattr(snapshot_module, name, then_act)


MOMENTS = {
    "before the snapshot": None,
    "after the snapshot read its checkpoint": "decode_replay_checkpoint",
    "after the snapshot listed schedule_log": "bucket_starts",
}


@pytest.mark.parametrize("moment", list(MOMENTS))
@pytest.mark.parametrize("named", [True, False], ids=["named", "not-named"])
async def test_a_snapshot_taken_around_a_retirement_keeps_a_moved_message(
    tmp_path: Path, autojump_clock, monkeypatch, moment: str, named: bool
) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    leader, position = retired_after_checkpoint(a, named=named)
    bucket_file = os.path.join(layout.schedule_log_dir(a), bucket_name(B))
    snapshots = DelaySnapshots(a)
    hooked = MOMENTS[moment]
    if hooked is None:
        leader.replay()
    else:
        once_after(hooked, leader.replay, monkeypatch)
    snapshot = snapshots.take()
    assert not os.path.exists(bucket_file)  # the retirement was replayed: B is gone
    assert leader.replayer.retired_total == 1
    leader.close()
    # The retirement's replay made B unneeded by every checkpoint before deleting it:
    # the snapshot's checkpoint is past the reschedule.
    assert snapshot.meta["position"] > position
    install(snapshot, b)
    follow_and_replay(a, b)
    await assert_member_holds_and_delivers(leader, b)


async def test_a_bucket_a_snapshot_holds_goes_on_the_member_at_its_retirement(
    tmp_path: Path, autojump_clock
) -> None:
    """Retired after the snapshot was taken: the snapshot, at P, holds B; the member's
    replay copies the moved message from it and deletes it at the record, as the
    leader did."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    leader, position = retired_after_checkpoint(a, named=False)
    snapshot = DelaySnapshots(a).take()
    assert snapshot.meta["position"] == position
    assert f"{layout.SCHEDULE_LOG}/{bucket_name(B)}" in {file.name for file in snapshot.files}
    leader.close()  # replays the retirement
    assert leader.replayer.retired_total == 1
    install(snapshot, b)
    follow_and_replay(a, b)
    await assert_member_holds_and_delivers(leader, b)


async def assert_member_holds_and_delivers(leader: LeaderData, member: str) -> None:
    """``member`` derived the leader's schedule_log and id index, B gone and the moved
    message in B2; promoted, it delivers every message once, none early."""
    assert files_of(layout.schedule_log_dir(member)) == files_of(
        layout.schedule_log_dir(leader.data)
    )
    assert bucket_name(B) not in os.listdir(layout.schedule_log_dir(member))
    assert lookups(member, list(leader.dues)) == lookups(leader.data, list(leader.dues))
    assert [bucket for bucket, _, _ in lookups(member, [MOVED])[MOVED]] == [B2]

    target = RecordingTarget("b")
    with Pipeline(member, [target]) as promoted:
        await promoted.run_until(
            MOVED_DUE + 1000, done=lambda: len(target.received) >= len(leader.dues)
        )
    got = sorted(r.message.message_id for r in target.received)
    assert got == sorted(leader.dues)  # every message once, the moved one too
    assert all(r.at_ms >= leader.dues[r.message.message_id] for r in target.received)


def test_a_snapshot_is_refused_while_its_checkpoint_names_a_bucket_that_is_gone(
    tmp_path: Path,
) -> None:
    """Data whose bucket went before a checkpoint stopped naming it (deleted by hand, or
    by a version that deleted before it checkpointed): no snapshot without the bucket;
    the leader says why, and sends one once its replayer checkpoints again."""
    a = str(tmp_path / "a")
    leader, _ = retired_after_checkpoint(a, named=True)
    os.unlink(os.path.join(layout.schedule_log_dir(a), bucket_name(B)))
    with pytest.raises(SnapshotError, match=f"names schedule_log bucket {bucket_name(B)}"):
        DelaySnapshots(a).take()
    assert os.listdir(layout.outgoing_snapshots_dir(a)) == []  # no links left behind
    leader.log.close()
    leader.replayer.close()


async def test_a_server_checkpoints_at_a_retirement_before_it_deletes_the_bucket(
    tmp_path: Path, clock
) -> None:
    """The server's replay task (retention's on_retire, the canceller's before_checkpoint)
    makes the durable checkpoint stop naming the bucket, at the retirement record,
    before the bucket's files go."""
    data = str(tmp_path / "a")
    pipeline = Pipeline(data, [RecordingTarget("a")])
    config = RetentionConfig(interval_ms=1000, bucket_ms=0, message_log_ms=3_600_000)
    retention = Retention(config, pipeline.log, pipeline.replayer, pipeline.delivery)
    pipeline.schedule([T0 + 1000, T0 + 4 * MINUTE])
    bucket_file = os.path.join(layout.schedule_log_dir(data), bucket_name(B))
    when_deleted = []

    async def delete_retired(starts: list[int]) -> None:
        checkpoint = read_replay_checkpoint(REAL_FS, data)
        when_deleted.append((starts, checkpoint, os.path.exists(bucket_file)))
        await retention.delete_retired(starts)

    pipeline.replayer.on_retire = delete_retired
    async with pipeline.running():
        await trio.sleep(3 * MINUTE / 1000)  # delivered, COMPLETE, the loader past it
        named = read_replay_checkpoint(REAL_FS, data).bucket_sizes
        assert B in named  # open since it was filled: the checkpoints name it
        for _ in range(10):
            await retention.run_pass()
            await trio.sleep(1)
            if when_deleted:
                break
        await pipeline.stop()
    pipeline.close()
    with SegmentedLog.open(layout.message_log_dir(data)) as log:
        (retired_at,) = [
            r.offset for r in log.iter_from(0) if r.type == message_log.TYPE_RETIRE_BUCKET
        ]
    ((starts, checkpoint, still_there),) = when_deleted
    assert starts == [B] and still_there
    assert checkpoint.position == retired_at
    assert B not in checkpoint.bucket_sizes
    assert not os.path.exists(bucket_file)
