"""Retention in-process on trio's clock (delayd.server.retention): what is deleted,
when, and what never is — buckets that are not complete, the segment being written,
segments above the replay checkpoint — and that deleted data leaves a directory that
recovers, delivers a record filed into a deleted bucket, and answers a cancel for a
forgotten id with UNKNOWN."""

from __future__ import annotations

import os

import pytest
import trio
import trio.testing

from delayd.cli.main import main
from delayd.logs import layout, message_log, tombstone
from delayd.logs.buckets import bucket_name, bucket_of
from delayd.logs.dispatch_files import DispatchFiles
from delayd.logs.dispatch_log import EntryKind
from delayd.logs.message_log import MessageRecord
from delayd.protocol.codes import CancelOutcome
from delayd.sender.retry import RetryPolicy
from delayd.sender.sender import SenderConfig
from delayd.server.config import ConfigError, RetentionConfig, ServeConfig
from delayd.server.config_env import load_effective_config
from delayd.server.receiver import IntakeLimits
from delayd.server.retention import Retention, remove_orphans, trim_below_leader
from storage.checkpoint import write_checkpoint
from storage.fs import REAL_FS
from storage.segmented_log import RECOVERY_CHECKPOINT, SegmentedLog, is_segment_name
from tests.delivery_pipeline import T0, Pipeline, RecordingTarget, dispatch_entries, received_ids

MINUTE = 60_000
SEGMENT_BYTES = 4096  # a few dozen messages per message_log segment


def buckets(data: str) -> list[str]:
    return sorted(os.listdir(layout.schedule_log_dir(data)))


def dispatch_files(data: str) -> list[str]:
    return sorted(os.listdir(layout.dispatch_log_dir(data)))


def segments(data: str) -> list[int]:
    return sorted(int(n) for n in os.listdir(layout.message_log_dir(data)) if is_segment_name(n))


def small_segments(data: str, targets, **config) -> Pipeline:
    return Pipeline(
        data,
        targets,
        message_log_segment_bytes=SEGMENT_BYTES,
        limits=IntakeLimits(max_record_bytes=1024),
        **config,
    )


def pipeline_with_retention(
    data: str, targets, config: dict | None = None, **retention
) -> tuple[Pipeline, Retention]:
    pipeline = small_segments(data, targets, **(config or {}))
    config = RetentionConfig(**{"interval_ms": 1000, **retention})
    return pipeline, Retention(config, pipeline.log, pipeline.replayer, pipeline.delivery)


async def sleep_until_ms(epoch_ms: int) -> None:
    await trio.sleep_until((epoch_ms - T0) / 1000)


async def within(seconds: float, done, step=None) -> None:
    """Wait until ``done()``, at most ``seconds`` of virtual time, awaiting ``step()``
    (e.g. a retention pass) every virtual second. Not a fixed sleep: the autojump clock
    moves on whenever the tasks look idle, including while a worker thread (an fsync, a
    checkpoint) still runs — on a loaded machine the work a fixed sleep waited for may
    not have finished when it ends."""
    deadline = trio.current_time() + seconds
    while not done():
        assert trio.current_time() < deadline, f"not done within {seconds} s"
        if step is not None:
            await step()
        await trio.sleep(1)


def name_of(due_ms: int) -> str:
    return bucket_name(bucket_of(due_ms, 1))


async def test_delivered_buckets_and_replayed_segments_go_once_old_enough(tmp_path, clock):
    data = str(tmp_path)
    target = RecordingTarget("a")
    pipeline, retention = pipeline_with_retention(
        data, [target], bucket_ms=10 * MINUTE, message_log_ms=5 * MINUTE
    )
    with pipeline:
        early = [T0 + MINUTE + i * 300 for i in range(200)] + [T0 + 2 * MINUTE + 5]
        late = [T0 + 30 * MINUTE + 7]  # still pending when the early buckets go
        ids = pipeline.schedule(early + late)
        assert len(segments(data)) >= 3
        async with pipeline.running():
            await sleep_until_ms(T0 + 3 * MINUTE + 500)
            assert sorted(received_ids([target])) == sorted(ids[:-1])
            # Delivered and COMPLETE, but neither old enough yet: nothing goes.
            await retention.run_pass()
            assert buckets(data) == [
                name_of(T0 + MINUTE),
                name_of(T0 + 2 * MINUTE),
                name_of(late[0]),
            ]
            assert retention.deleted_files["schedule_log"] == 0
            assert retention.deleted_files["message_log"] == 0
            # message_log: its segments were sealed at T0 (receipt of the next segment's
            # first record), so after 5 minutes all but the one being written go.
            await sleep_until_ms(T0 + 5 * MINUTE + 1)
            before = segments(data)
            await retention.run_pass()
            assert segments(data) == before[-1:]
            assert retention.deleted_files["message_log"] == len(before) - 1
            assert retention.deleted_bytes["message_log"] == before[-1] - before[0]
            assert pipeline.log.min_offset == before[-1]
            # Buckets: 10 minutes after their end (T0+2min, T0+3min) each goes in turn.
            await sleep_until_ms(T0 + 12 * MINUTE + 1)
            # A pass retires the first bucket; the replay of its record deletes it.
            kept = [name_of(T0 + 2 * MINUTE), name_of(late[0])]
            await within(10, lambda: buckets(data) == kept, retention.run_pass)
            assert dispatch_files(data) == [name_of(T0 + 2 * MINUTE)]
            # Old enough, but the bucket the wheel loaded last: a record appended to a new
            # file of its name would be left to a loader that has moved on. It goes once
            # the loader begins the next bucket (2 minutes ahead of it).
            await sleep_until_ms(T0 + 13 * MINUTE + 1)
            await retention.run_pass()
            await trio.sleep(2)
            await retention.run_pass()
            assert buckets(data) == [name_of(T0 + 2 * MINUTE), name_of(late[0])]
            await sleep_until_ms(T0 + 29 * MINUTE)
            await within(10, lambda: buckets(data) == [name_of(late[0])], retention.run_pass)
            await retention.run_pass()
            assert buckets(data) == [name_of(late[0])]  # pending: kept
            assert dispatch_files(data) == []
            assert retention.deleted_files["schedule_log"] == 2
            assert retention.deleted_files["dispatch_log"] == 2
            assert retention.deleted_bytes["schedule_log"] > 0
            await pipeline.stop()

    # A restart over what retention left: the replayer's checkpoint, message_log from
    # its first kept segment, dispatch_log; the pending message is delivered, once,
    # and none of the deleted buckets' messages is sent again.
    again = RecordingTarget("a")
    with small_segments(data, [again]) as restarted:
        assert restarted.replayer.recovery.records_after_checkpoint == 0
        await run_for(restarted, 5 * MINUTE)
        assert received_ids([again]) == ids[-1:]
        assert again.received[0].at_ms == late[0]


async def run_for(pipeline: Pipeline, duration_ms: int) -> None:
    async with pipeline.running():
        await trio.sleep(duration_ms / 1000)
        await pipeline.stop()


# Minutes of retries against a dead group, and nothing real to wait for but worker
# threads: time jumps as soon as every task blocks (lateness is not measured).
@pytest.mark.instant_autojump
async def test_a_bucket_that_is_not_complete_is_never_deleted(tmp_path, clock):
    data = str(tmp_path)
    target = RecordingTarget("a", unavailable=True)  # the only broker group is down
    pipeline, retention = pipeline_with_retention(
        data,
        [target],
        {"sender": SenderConfig(retry=RetryPolicy(max_attempts=1000, max_ms=10_000))},
        bucket_ms=0,
        message_log_ms=0,
    )
    with pipeline:
        ids = pipeline.schedule([T0 + 1000, T0 + 2000, T0 + 6 * MINUTE])
        async with pipeline.running():
            # Minutes past its end, with an age of 0 and the loader past it: nothing was
            # delivered, so nothing is marked complete and nothing is deleted.
            for seconds in (270, 300, 330):
                await sleep_until_ms(T0 + seconds * 1000)
                await retention.run_pass()
                await trio.sleep(2)
                await retention.run_pass()
                assert pipeline.delivery.manager.cursors.loading.bucket_ms > bucket_of(T0, 1)
                assert buckets(data) == [name_of(T0), name_of(T0 + 6 * MINUTE)]
                assert retention.deleted_files["schedule_log"] == 0
            assert received_ids([target]) == []
            # The group comes back: delivered, COMPLETE, and then deleted.
            target.unavailable = False

            def completed() -> bool:
                entries = dispatch_entries(data).get(name_of(T0), [])
                return bool(entries) and entries[-1].kind is EntryKind.COMPLETE

            await within(60, completed)
            assert set(ids[:2]) <= set(received_ids([target]))
            # The replay of the retirement deletes schedule_log first, dispatch_log then.
            await within(
                10,
                lambda: (
                    buckets(data) == [name_of(T0 + 6 * MINUTE)]
                    and name_of(T0) not in dispatch_files(data)
                ),
                retention.run_pass,
            )
            await pipeline.stop()


async def test_the_active_segment_and_segments_above_the_checkpoint_are_kept(tmp_path, clock):
    data = str(tmp_path)
    pipeline, retention = pipeline_with_retention(data, [RecordingTarget("a")], message_log_ms=0)
    with pipeline:
        pipeline.schedule([T0 + 86_400_000 + i for i in range(300)])
        pipeline.replayer.replay_available()  # replayed, no checkpoint written yet
        before = segments(data)
        assert len(before) >= 5
        assert pipeline.replayer.checkpointed_position == 0
        await retention.run_pass()
        assert segments(data) == before  # replayed but not checkpointed: kept
        # A checkpoint part-way (as if the replayer stopped in the middle of the log): the
        # segments wholly below it go, the one holding it and those above stay.
        middle = before[3] + 10
        pipeline.replayer._checkpointed = middle
        await retention.run_pass()
        assert segments(data) == before[3:]
        pipeline.replayer.checkpoint()
        await retention.run_pass()
        assert segments(data) == before[-1:]  # the segment being written, never


async def test_a_leader_keeps_the_segments_its_in_sync_followers_have_not_copied(tmp_path, clock):
    """In a group the leader deletes a segment only once every in-sync member has
    copied past it (``replicated_floor``), whatever its own checkpoint allows."""
    data = str(tmp_path)
    pipeline, retention = pipeline_with_retention(data, [RecordingTarget("a")], message_log_ms=0)
    with pipeline:
        pipeline.schedule([T0 + 86_400_000 + i for i in range(300)])
        pipeline.replayer.replay_available()
        pipeline.replayer.checkpoint()
        before = segments(data)
        assert len(before) >= 5
        copied = before[2] + 10  # the slowest in-sync follower is in the third segment
        retention.replicated_floor = lambda: copied
        await retention.run_pass()
        assert segments(data) == before[2:]
        retention.replicated_floor = lambda: 0  # no Leader running: nothing goes
        await retention.run_pass()
        assert segments(data) == before[2:]
        retention.replicated_floor = lambda: pipeline.log.end_offset
        await retention.run_pass()
        assert segments(data) == before[-1:]


async def test_a_follower_deletes_below_its_leaders_start_once_replayed(tmp_path, clock):
    """A follower's message_log goes at the leader's word (where the leader's copy now
    begins), never past its own replay checkpoint."""
    data = str(tmp_path)
    pipeline = small_segments(data, [RecordingTarget("a")])
    with pipeline:
        pipeline.schedule([T0 + 86_400_000 + i for i in range(300)])
        pipeline.replayer.replay_available()
        before = segments(data)
        assert len(before) >= 5
        pipeline.replayer._checkpointed = before[3] + 10  # replayed to the fourth segment
        assert await trim_below_leader(pipeline.log, pipeline.replayer, before[2]) == 2
        assert segments(data) == before[2:]
        assert await trim_below_leader(pipeline.log, pipeline.replayer, before[-1]) == 1
        assert segments(data) == before[3:]  # the checkpoint holds the rest
        assert await trim_below_leader(pipeline.log, pipeline.replayer, before[1]) == 0


async def test_a_record_filed_into_a_deleted_bucket_is_delivered(tmp_path, clock):
    """Due times in the past are stored as their receipt time, so a record lands in a
    long-past bucket only when the clock was set back (or with bucket_ms = 0, when a
    record received at a bucket's last millisecond is replayed after its deletion).
    It must create a new file of that name and be delivered, not be lost."""
    data = str(tmp_path)
    target = RecordingTarget("a")
    pipeline, retention = pipeline_with_retention(data, [target], bucket_ms=0, message_log_ms=0)
    with pipeline:
        # The third message moves the loader on: the bucket it loaded last is kept.
        first = pipeline.schedule([T0 + 1000, T0 + 2000, T0 + 2 * MINUTE + 500])
        async with pipeline.running():
            await sleep_until_ms(T0 + 2 * MINUTE)
            await within(10, lambda: name_of(T0) not in buckets(data), retention.run_pass)
            assert retention.deleted_files["schedule_log"] == 1
            # A cancel for a message of the deleted bucket: its id is forgotten.
            canceller = pipeline.delivery.canceller
            stone = tombstone.Tombstone(first[0], receive_ms=pipeline.now_ms())
            pipeline.log.append_batch([tombstone.encode(stone)], message_log.TYPE_CANCEL)
            pipeline.log.flush()
            pipeline.replayer.notify(pipeline.sequence)
            await trio.sleep(1)
            assert canceller.cancels[CancelOutcome.UNKNOWN] == 1
            assert name_of(T0) not in dispatch_files(data)  # the cancel created nothing
            # A message due in the deleted bucket, received "now" by a clock set back.
            late = append_message(pipeline, due_ms=T0 + 5000, message_id="late")
            await trio.sleep(5)
            assert received_ids([target])[-1] == late
            assert name_of(T0) in buckets(data)
            entries = dispatch_entries(data)[name_of(T0)]
            # A new file: its own route set (a fresh run's), then the record's fate.
            assert [e.kind for e in entries][:2] == [EntryKind.ROUTE, EntryKind.DISPATCHED]
            assert entries[1].offset == 0
            # Its new bucket is marked COMPLETE and deleted in turn.
            await trio.sleep(60)
            await within(10, lambda: name_of(T0) not in buckets(data), retention.run_pass)
            await pipeline.stop()
    assert sorted(received_ids([target])) == sorted([*first, late])


def append_message(pipeline: Pipeline, *, due_ms: int, message_id: str) -> str:
    pipeline.sequence += 1
    record = MessageRecord(
        due_ms=due_ms,
        sequence=pipeline.sequence,
        receive_ms=due_ms,
        message_id=message_id,
        subject="orders",
        key=None,
        body=b"late",
    )
    pipeline.log.append_batch([message_log.encode_record(record)], message_log.TYPE_MESSAGE)
    pipeline.log.flush()
    pipeline.replayer.notify(pipeline.sequence)
    return message_id


async def test_a_deletion_cut_short_by_a_crash_starts_cleanly(tmp_path, clock):
    """The states a kill -9 in the middle of a pass can leave: a prefix of the
    message_log segments gone while message_log's recovery checkpoint points into
    them; a bucket's schedule_log file gone but not its dispatch_log file."""
    data = str(tmp_path)
    target = RecordingTarget("a")
    pipeline, retention = pipeline_with_retention(data, [target], bucket_ms=0, message_log_ms=0)
    with pipeline:
        first = pipeline.schedule([T0 + 1000])
        pipeline.log.close()  # writes message_log's recovery checkpoint at its end
        recovery_at = pipeline.log.end_offset
        pipeline.log = pipeline.replayer.log = retention.message_log = SegmentedLog.open(
            layout.message_log_dir(data), fs=REAL_FS, segment_size=SEGMENT_BYTES
        )
        pipeline.schedule([T0 + 3 * MINUTE + i for i in range(100)])
        await run_for(pipeline, 2 * MINUTE)
        await retention.run_pass()
        assert pipeline.log.min_offset > recovery_at
    # The crash: message_log's recovery checkpoint as it was before (below every
    # segment left), the bucket half deleted (schedule_log first, as retention does).
    write_checkpoint(
        REAL_FS,
        os.path.join(layout.message_log_dir(data), RECOVERY_CHECKPOINT),
        recovery_at.to_bytes(8, "little"),
    )
    os.unlink(os.path.join(layout.schedule_log_dir(data), name_of(T0)))
    assert name_of(T0) in dispatch_files(data)
    assert remove_orphans(data, REAL_FS) == [name_of(T0)]  # as DelayServer.open does
    assert name_of(T0) not in dispatch_files(data)

    again = RecordingTarget("a")
    with small_segments(data, [again]) as restarted:
        # Had the orphan dispatch_log stayed, it would mark offset 0 of a new file of that
        # name delivered, and the loader would skip this record.
        late = append_message(restarted, due_ms=T0 + 7000, message_id="late")
        await run_for(restarted, 5 * MINUTE)
        assert received_ids([target]) == first
        got = received_ids([again])
        assert late in got and len(got) == len(set(got)) == 101


async def test_inspect_reads_a_directory_retention_has_thinned(tmp_path, clock, capsys):
    """``delayd inspect`` over deleted segments and buckets, a dispatch_log left without
    its schedule_log (a deletion cut short) and a wheel checkpoint naming a deleted
    bucket: every subcommand answers, none fails."""
    data = str(tmp_path)
    target = RecordingTarget("a")
    pipeline, retention = pipeline_with_retention(data, [target], bucket_ms=0, message_log_ms=0)
    with pipeline:
        gone = pipeline.schedule([T0 + 1000 + i for i in range(100)])
        kept = pipeline.schedule([T0 + 3 * MINUTE + i for i in range(100)])
        async with pipeline.running():
            await sleep_until_ms(T0 + 2 * MINUTE)
            await within(10, lambda: name_of(T0) not in buckets(data), retention.run_pass)
            await pipeline.stop()
            await pipeline.delivery.stop()  # writes the wheel checkpoint
    assert name_of(T0) not in buckets(data)
    assert segments(data)[0] > 0
    # A dispatch_log without its schedule_log, as a deletion cut short leaves it.
    orphan_ms = T0 - MINUTE
    files = DispatchFiles(layout.dispatch_log_dir(data))
    files.record(orphan_ms, EntryKind.DISPATCHED, [0], T0, b"a")
    files.mark_complete(orphan_ms, 90, T0)
    files.close()
    orphan = name_of(orphan_ms)

    def inspect(*args: str) -> tuple[int, str]:
        status = main(["inspect", "--data", data, *args])
        return status, capsys.readouterr().out

    for fmt in ([], ["--json"]):
        assert inspect(*fmt, "summary")[0] == 0
        assert inspect(*fmt, "checkpoints")[0] == 0
        status, out = inspect(*fmt, "message-log")
        assert status == 0 and kept[-1] in out  # from the first segment kept
        assert inspect(*fmt, "message-log", "--from", "0")[0] in (0, 2)
        assert inspect(*fmt, "bucket", name_of(T0))[0] == 2  # no such bucket (any more)
        assert inspect(*fmt, "dispatch", name_of(T0))[0] in (0, 2)
        assert inspect(*fmt, "dispatch", orphan)[0] in (0, 2)
        assert inspect(*fmt, "bucket", orphan)[0] in (0, 2)
        assert inspect(*fmt, "find", gone[0])[0] == 1  # forgotten with its files
        status, out = inspect(*fmt, "find", kept[-1])
        assert status == 0 and kept[-1] in out


def test_retention_keys_from_the_file_and_the_environment(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[retention]\nbucket_ms = 0\ninterval_ms = 5000\n")
    env = {"DELAYD_RETENTION_MESSAGE_LOG_MS": "3_600_000", "DELAYD_RETENTION_ENABLED": "false"}
    config = load_effective_config(str(path), env).retention
    assert config == RetentionConfig(
        enabled=False, interval_ms=5000, message_log_ms=3_600_000, bucket_ms=0
    )
    assert ServeConfig().retention == RetentionConfig(
        enabled=True, interval_ms=60_000, message_log_ms=86_400_000, bucket_ms=259_200_000
    )
    for bad in ({"DELAYD_RETENTION_BUCKET_MS": "-1"}, {"DELAYD_RETENTION_INTERVAL_MS": "0"}):
        with pytest.raises(ConfigError, match="retention"):
            load_effective_config(None, bad)
