"""A full disk for each log, and a failed fsync, through the crash simulator.

message_log (intake answers DISK_FULL), schedule_log (the replayer pauses and copies
each record once), dispatch_log (the sender holds delivered messages until their
entries are written), the broker's commitlog (DISK_FULL per message; a reput that finds
no space waits) — each refuses with the reason, keeps no torn record, resumes once
space returns and loses nothing acknowledged. A failed fsync stops acknowledging and is
never retried.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import trio
import trio.testing

from delayd.broker import BrokerConfig, open_broker
from delayd.logs import layout, message_log, retirement
from delayd.logs.buckets import bucket_name
from delayd.logs.dispatch_log import FATES, EntryKind
from delayd.logs.message_log import MessageRecord
from delayd.protocol import Message, ResultCode
from delayd.replay import open_replayer
from delayd.sender.retry import RetryPolicy
from delayd.sender.sender import SenderConfig
from delayd.server.intake import IntakePath
from delayd.server.receiver import IntakeLimits, Receiver
from delayd.write_refusals import (
    BROKER_COMMITLOG,
    CHECKPOINT,
    DISPATCH_LOG,
    MESSAGE_LOG,
    SCHEDULE_LOG,
)
from storage.crashfs import CrashSimFileSystem
from storage.errors import DiskFullError, FsyncError, StorageError
from storage.flusher import LogWriter
from storage.segmented_log import SegmentedLog
from tests.delivery_pipeline import T0, Pipeline, RecordingTarget, dispatch_entries
from tests.intake_support import check_exactly_once, read_message_log
from tests.trio_support import running

NOW = 1_795_341_600_000
MINUTE = 60_000


async def until(condition, timeout_s: float = 120) -> None:
    """Wait (virtual time) until ``condition()``: worker threads let the autojump clock
    run ahead, so a fixed sleep is no bound on what they finish."""
    with trio.fail_after(timeout_s):
        while not condition():
            await trio.sleep(0.05)


def sim() -> CrashSimFileSystem:
    fs = CrashSimFileSystem()
    fs.mkdir("/data")
    fs.fsync_dir("/")
    return fs


NO_RESERVE = IntakeLimits(min_free_bytes=1)  # writes stop only at ENOSPC


def make_intake(fs: CrashSimFileSystem, limits: IntakeLimits = NO_RESERVE) -> IntakePath:
    log = SegmentedLog.open(layout.message_log_dir("/data"), fs=fs)
    replayer = open_replayer("/data", log, segment_scale=1, fs=fs)
    receiver = Receiver(limits, replayer.recovery.next_sequence)
    return IntakePath(receiver, LogWriter(log), replayer, clock=lambda: NOW)


def batch(prefix: str, count: int, body: bytes = b"x" * 100) -> list[Message]:
    return [Message(f"{prefix}-{i}", "orders", body=body, delay_ms=i) for i in range(count)]


def leaves(group: BaseException) -> list[BaseException]:
    """The exceptions in ``group`` and its subgroups, flattened."""
    if isinstance(group, BaseExceptionGroup):
        return [leaf for sub in group.exceptions for leaf in leaves(sub)]
    return [group]


def records(count: int, first_sequence: int, dues: list[int]) -> list[bytes]:
    """message_log payloads of ``count`` messages, due in turn at ``dues``."""
    return [
        message_log.encode_record(
            MessageRecord(
                due_ms=dues[i % len(dues)],
                sequence=first_sequence + i,
                receive_ms=NOW,
                message_id=f"r{first_sequence + i}",
                subject="orders",
                key=None,
                body=b"y" * 200,
            )
        )
        for i in range(count)
    ]


# ---------------------------------------------------------------------- message_log


async def test_intake_answers_disk_full_and_resumes_with_dense_sequences(tmp_path):
    fs = sim()
    intake = make_intake(fs)
    async with running(intake.writer.run):
        first = await intake.send_batch(batch("a", 20))
        assert {r.code for r in first} == {ResultCode.OK}

        fs.capacity = fs.used_bytes() + 1000  # a few records' worth: the batch is larger
        refused = await intake.send_batch(batch("b", 20))
        assert [r.code for r in refused] == [ResultCode.DISK_FULL] * 20
        assert refused[0].code.is_retryable
        assert "disk full" in refused[0].reason
        assert layout.message_log_dir("/data") in refused[0].reason
        assert "bytes free" in refused[0].reason
        assert intake.refusals.refusing(MESSAGE_LOG)
        assert intake.receiver.refused_total[ResultCode.DISK_FULL] == 20
        assert intake.pending_acks == 0

        fs.capacity = None  # space returns: the next batch is stored, no restart
        after = await intake.send_batch(batch("c", 20))
        assert {r.code for r in after} == {ResultCode.OK}
        assert after[0].queue_offset == 21  # sequences stay dense: b's were given back
        assert not intake.refusals.refusing(MESSAGE_LOG)
        fs.materialize(str(tmp_path / "after"), "drop", random.Random(0))
    logged = read_message_log(tmp_path / "after" / "data")
    assert [r.message_id for _, r in logged] == [
        *(f"a-{i}" for i in range(20)),
        *(f"c-{i}" for i in range(20)),
    ]
    assert [r.sequence for _, r in logged] == list(range(1, 41))


async def test_intake_stops_at_its_reserve_before_the_disk_is_full():
    fs = sim()
    reserve = 64 << 20
    intake = make_intake(fs, IntakeLimits(min_free_bytes=reserve))
    # Ask the file system every batch: by default the guard asks once per MiB appended,
    # which would not notice a disk that shrinks at once, as this one is about to.
    intake.space.recheck_bytes = 1
    async with running(intake.writer.run):
        await intake.send_batch(batch("z", 1))
        intake.replayer.replay_available()  # the id index's file exists: sizes settle
        fs.capacity = fs.used_bytes() + reserve + 4000
        first = await intake.send_batch(batch("a", 20))  # about 3 KB
        assert {r.code for r in first} == {ResultCode.OK}
        refused = await intake.send_batch(batch("b", 20))
        assert {r.code for r in refused} == {ResultCode.DISK_FULL}
        assert f"less than the reserve of {reserve}" in refused[0].reason
        assert fs.free_bytes("/data") > reserve  # room left for replay and delivery
        # What intake leaves is there for the others: the replayer copies a's records,
        # and cancels go on into half the reserve.
        intake.replayer.replay_available()
        assert intake.replayer.replayed_total == 21
        intake.tombstone_space.recheck_bytes = 1
        intake.canceller = SimpleNamespace(  # type: ignore[assignment]
            expect_many=lambda offsets, is_cancel: [None] * len(offsets)
        )
        end = intake.log.end_offset
        intake.append_tombstone("a-0")
        assert intake.log.end_offset > end
        fs.capacity -= reserve // 2 + 4000
        with pytest.raises(DiskFullError, match=f"reserve of {reserve // 2}"):
            intake.append_tombstone("a-1")
        fs.capacity += reserve // 2 + 4000
        fs.capacity += 1 << 20
        after = await intake.send_batch(batch("c", 20))
        assert {r.code for r in after} == {ResultCode.OK}


async def test_a_cancel_into_a_full_message_log_raises_disk_full():
    fs = sim()
    intake = make_intake(fs)
    intake.canceller = SimpleNamespace()  # type: ignore[assignment]  # never reached
    fs.capacity = fs.used_bytes()
    with pytest.raises(DiskFullError):
        intake.append_tombstone("some-id")
    assert intake.refusals.refusing(MESSAGE_LOG)
    assert intake.log.end_offset == 0


async def test_a_failed_fsync_stops_acknowledging_and_is_never_retried():
    fs = sim()
    intake = make_intake(fs)
    acked = []
    with pytest.RaisesGroup(FsyncError, StorageError) as caught:
        async with trio.open_nursery() as nursery:
            await nursery.start(intake.writer.run)
            acked += await intake.send_batch(batch("a", 5))
            fs.fail_fsyncs(1)
            acked += await intake.send_batch(batch("b", 5))
    assert "never retry" in str(caught.value.exceptions[0]) + str(caught.value.exceptions[1])
    assert [r.code for r in acked] == [ResultCode.OK] * 5  # b was never acknowledged
    with pytest.raises(StorageError, match="failed earlier"):
        intake.log.append(b"more")
    # The process would exit here; a restart recovers from what is on disk.
    intake.log.close()
    fs.restart()
    with SegmentedLog.open(layout.message_log_dir("/data"), fs=fs) as reopened:
        ids = [message_log.decode_message(r.payload).message_id for r in reopened.iter_from(0)]
    assert ids[:5] == [f"a-{i}" for i in range(5)]


# --------------------------------------------------------------------- schedule_log


def test_a_replay_step_into_a_full_disk_is_cut_back_whole(tmp_path):
    fs = sim()
    log = SegmentedLog.open(layout.message_log_dir("/data"), fs=fs)
    replayer = open_replayer("/data", log, segment_scale=1, fs=fs)
    dues = [NOW + MINUTE, NOW + 2 * MINUTE, NOW + 3 * MINUTE]  # three buckets per step
    log.append_batch(records(30, 1, dues), message_log.TYPE_MESSAGE)
    log.flush()
    fs.capacity = fs.used_bytes() + 2500  # the first bucket fits, the second does not
    with pytest.raises(DiskFullError):
        replayer.replay_available()
    assert replayer.position == 0
    assert all(size == 0 for size in replayer.buckets.open_sizes().values())
    fs.capacity = None
    assert replayer.replay_available() == 30
    replayer.checkpoint()
    replayer.close()
    log.close()
    fs.materialize(str(tmp_path / "after"), "drop", random.Random(0))
    assert len(check_exactly_once(tmp_path / "after" / "data", 1)) == 30


async def test_the_replayer_pauses_on_a_full_disk_and_catches_up(clock):
    fs = sim()
    log = SegmentedLog.open(layout.message_log_dir("/data"), fs=fs)
    replayer = open_replayer("/data", log, segment_scale=1, fs=fs)
    log.append_batch(records(10, 1, [NOW + MINUTE]), message_log.TYPE_MESSAGE)
    log.flush()
    fs.capacity = fs.used_bytes()
    async with running(replayer.run):
        replayer.notify(10)
        await trio.sleep(5)
        assert replayer.position == 0 and replayer.refusals.refusing(SCHEDULE_LOG)
        assert "disk full: schedule_log" in (replayer.refusals.reason() or "")
        fs.capacity = None
        await until(lambda: replayer.position == log.durable_offset)
        assert not replayer.refusals.refusing(SCHEDULE_LOG)
        assert not replayer.refusals.refusing(CHECKPOINT)
        await replayer.stop()
    assert replayer.replayed_total == 10
    replayer.close()
    log.close()


async def test_a_retirement_waits_for_room_for_its_checkpoint_and_keeps_the_bucket(clock):
    """The checkpoint a retirement writes before it deletes finds no room: the replayer
    pauses (refusing for the checkpoint), the bucket stays until the checkpoint is
    written, and then goes."""
    fs = sim()
    log = SegmentedLog.open(layout.message_log_dir("/data"), fs=fs)
    replayer = open_replayer("/data", log, segment_scale=1, fs=fs)
    log.append_batch(records(3, 1, [NOW + 1000]), message_log.TYPE_MESSAGE)
    log.flush()
    replayer.replay_available()
    replayer.checkpoint()
    bucket = f"{layout.schedule_log_dir('/data')}/{bucket_name(NOW)}"
    complete = retirement.Retirement(NOW, replayer.buckets.size(NOW), NOW)
    log.append_batch([retirement.encode(complete)], message_log.TYPE_RETIRE_BUCKET)
    log.flush()
    fs.capacity = fs.used_bytes()
    async with running(replayer.run):
        replayer.notify(0)
        await trio.sleep(5)
        assert replayer.refusals.refusing(CHECKPOINT)
        assert not replayer.refusals.refusing(SCHEDULE_LOG)
        assert fs.exists(bucket) and replayer.retired_total == 0
        fs.capacity = None
        await until(lambda: replayer.retired_total == 1)
        assert not fs.exists(bucket)
        await replayer.stop()
    assert not replayer.refusals.refusing(CHECKPOINT)
    replayer.close()
    log.close()


# --------------------------------------------------------------------- dispatch_log


async def test_delivered_messages_are_held_until_their_entries_find_room(clock):
    fs = sim()
    target = RecordingTarget("a")
    with Pipeline("/data", [target], fs=fs) as pipeline:
        ids = pipeline.schedule([T0 + 1000 + i for i in range(5)])
        async with pipeline.running():
            await trio.sleep(0.5)
            fs.capacity = fs.used_bytes()  # room for no dispatch_log entry
            sender = pipeline.delivery.sender
            await until(lambda: len(target.received) == 5)
            await until(lambda: sender.refusals.refusing(DISPATCH_LOG))
            await trio.sleep(2)
            assert sorted(r.message.message_id for r in target.received) == sorted(ids)
            assert sender.in_flight == 5  # held: a cancel finds them in doubt, not lost
            fs.capacity = None
            await until(lambda: sender.in_flight == 0)
            assert not sender.refusals.refusing(DISPATCH_LOG)
            await pipeline.stop()
        entries = [e for es in dispatch_entries("/data", fs).values() for e in es]
        assert sorted(e.kind for e in entries if e.kind in FATES) == [EntryKind.DISPATCHED] * 5
        assert len(target.received) == 5  # each sent once: nothing resent for the wait


@pytest.mark.instant_autojump
async def test_a_broker_disk_full_is_retried_without_dead_lettering(clock):
    target = RecordingTarget("a", refuse=ResultCode.DISK_FULL)
    fs = sim()
    retry = RetryPolicy(max_attempts=3, base_ms=1000, max_ms=1000)
    with Pipeline("/data", [target], fs=fs, sender=SenderConfig(retry=retry)) as pipeline:
        [message_id] = pipeline.schedule([T0 + 1000])
        async with pipeline.running():
            await until(lambda: target.calls > 4)  # more sends than max_attempts
            assert set(target.subjects) == {"orders"}  # never the dead-letter subject
            target.refuse = None
            await until(lambda: len(target.received) == 1)
            await pipeline.stop()
        [got] = target.received
        assert got.message.message_id == message_id and got.message.subject == "orders"


# ------------------------------------------------------------------ broker commitlog


async def test_the_broker_answers_disk_full_and_resumes(tmp_path):
    fs = sim()
    async with open_broker("/data", BrokerConfig(), fs=fs) as broker:
        stored = await broker.send_batch([Message(f"a{i}", "orders") for i in range(10)])
        assert {r.code for r in stored} == {ResultCode.OK}
        fs.capacity = fs.used_bytes() + 100
        refused = await broker.send_batch(
            [Message(f"b{i}", "orders", body=b"z" * 300) for i in range(5)]
            + [Message("b0", "orders", body=b"z" * 300)]  # a copy within the batch
        )
        assert [r.code for r in refused] == [ResultCode.DISK_FULL] * 6
        assert "disk full" in refused[0].reason and "commitlog" in refused[0].reason
        assert broker.refusals.refusing(BROKER_COMMITLOG)
        fs.capacity = None
        again = await broker.send_batch(
            [Message(f"b{i}", "orders", body=b"z" * 300) for i in range(5)]
        )
        assert {r.code for r in again} == {ResultCode.OK}  # not DUPLICATE: never stored
        assert not broker.refusals.refusing(BROKER_COMMITLOG)
        broker.join("g", "orders", "c", None, broker.monotonic_ms())
        got = []
        while batch_ := await broker.pull("orders", "g", "c", 1000, 0):
            got += batch_
    assert sorted(m.message_id for m in got) == sorted(
        [f"a{i}" for i in range(10)] + [f"b{i}" for i in range(5)]
    )


async def test_a_reput_that_finds_no_space_waits_and_the_flusher_goes_on(clock):
    fs = sim()
    config = BrokerConfig(queues_per_subject=1, checkpoint_interval_ms=1000)
    async with open_broker("/data", config, fs=fs) as broker:
        store = broker.store
        await broker.send_batch([Message("m1", "orders")])  # the queue file exists
        before = fs.used_bytes()
        await broker.send_batch([Message("m2", "orders")])
        record = fs.used_bytes() - before - 20  # what m2 took, less its queue entry
        # Room for the commitlog record of m3, not for its 20-byte queue entry.
        fs.capacity = fs.used_bytes() + record + 10
        results = await broker.send_batch([Message("m3", "orders")])
        assert [r.code for r in results] == [ResultCode.OK]  # durable in the commitlog
        assert store.reput_blocked is not None
        assert store.queue_end("orders", 0) == 2  # not visible yet, nothing torn
        await until(lambda: broker.refusals.refusing(CHECKPOINT))
        fs.capacity = None
        await until(lambda: store.reput_blocked is None)  # the checkpoint loop's pass
        assert store.queue_end("orders", 0) == 3
        broker.join("g", "orders", "c", None, broker.monotonic_ms())
        got = await broker.pull("orders", "g", "c", 10, 0)
    assert [m.message_id for m in got] == ["m1", "m2", "m3"]


async def test_a_failed_commitlog_fsync_stops_the_broker_unacknowledged():
    fs = sim()
    answered = []
    with pytest.raises(BaseExceptionGroup) as caught:
        async with open_broker("/data", BrokerConfig(), fs=fs) as broker:
            answered += await broker.send_batch([Message("a", "orders")])
            fs.fail_fsyncs(1)
            answered += await broker.send_batch([Message("b", "orders")])
    causes = [e if isinstance(e, FsyncError) else e.__cause__ for e in leaves(caught.value)]
    assert any(isinstance(cause, FsyncError) for cause in causes)
    assert [r.code for r in answered] == [ResultCode.OK]  # b was never acknowledged
    fs.restart()
    async with open_broker("/data", BrokerConfig(), fs=fs) as reopened:
        reopened.join("g", "orders", "c", None, reopened.monotonic_ms())
        got = []
        while pulled := await reopened.pull("orders", "g", "c", 10, 0):
            got += pulled
    # The acknowledged one is there; b, written but never acknowledged, may be too.
    assert "a" in {m.message_id for m in got}
