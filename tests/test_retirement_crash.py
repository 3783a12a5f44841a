"""A bucket retirement replayed on the crash simulator (delayd.logs.retirement): power
lost at every step of the deletion its replay performs, and of the replay and the
checkpoint around it, and a restart (remove_orphans, recovery, replay) must leave no
bucket half deleted in a way that resends or loses: the retired bucket's records and
its dispatch_log gone together, a record filed into its name afterwards kept (and not
marked delivered by a stale dispatch_log), every other record kept exactly once. And at
every point, before the restart: every bucket the durable replay checkpoint names has
its schedule_log file — the replay of a retirement writes a checkpoint that no longer
names the bucket before the file goes, which a snapshot of the data directory relies
on (delayd.server.snapshot).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from delayd.logs import layout, message_log, retirement
from delayd.logs.buckets import bucket_name
from delayd.logs.dispatch_files import DispatchFiles
from delayd.logs.dispatch_log import EntryKind
from delayd.logs.message_log import MessageRecord
from delayd.replay import open_replayer
from delayd.replay.state import read_replay_checkpoint
from delayd.server.retention import remove_orphans
from storage.crashfs import CrashSimFileSystem
from storage.segmented_log import SegmentedLog
from tests.crash_support import power_loss_at_every_crash_point
from tests.intake_support import NO_SYNC_FS, read_schedule_log

DATA = "/data"
T = 1_795_341_600_000  # bucket A starts here; bucket B 3 minutes later
A, B = T, T + 3 * 60_000


def message(sequence: int, due_ms: int) -> bytes:
    record = MessageRecord(
        due_ms=due_ms, sequence=sequence, receive_ms=T, message_id=f"m{sequence}", subject="s"
    )
    return message_log.encode_record(record)


def open_data(fs, root: str = DATA):
    log = SegmentedLog.open(layout.message_log_dir(root), fs=fs, segment_size=4096)
    return log, open_replayer(root, log, segment_scale=1, fs=fs, index=False)


def replay_all(replayer) -> None:
    while replayer.replay_available():  # a step ends where a retirement begins or ends
        pass


def workload(fs: CrashSimFileSystem) -> None:
    """Bucket A delivered (its dispatch_log COMPLETE) and retired, then a record filed
    into A's name again (a clock set back) and one into B; replayed with checkpoints
    before and after the retirement."""
    fs.mkdir(DATA)
    fs.fsync_dir("/")
    log, replayer = open_data(fs)
    log.append_batch([message(1, A + 10), message(2, A + 20), message(3, B)], 2)
    log.flush()
    replay_all(replayer)
    replayer.checkpoint()  # lists A open, with its length
    schedule_bytes = replayer.buckets.opened(A).end_offset
    dispatch = DispatchFiles(layout.dispatch_log_dir(DATA), fs=fs)
    dispatch.record(A, EntryKind.DISPATCHED, [0], T, b"g")
    dispatch.record(A, EntryKind.DISPATCHED, [schedule_bytes // 2], T, b"g")
    dispatch.mark_complete(A, schedule_bytes, T)
    dispatch.flush()
    dispatch.close()
    retired = retirement.encode(retirement.Retirement(A, schedule_bytes, T))
    log.append_batch([retired], message_log.TYPE_RETIRE_BUCKET)
    log.append_batch([message(4, A + 30), message(5, B + 1)], 2)
    log.flush()
    replay_all(replayer)
    replayer.checkpoint()
    replayer.close()
    log.close()


def assert_named_buckets_exist(data: str) -> None:
    if not os.path.isdir(layout.checkpoint_dir(data)):
        return
    named = read_replay_checkpoint(NO_SYNC_FS, data).bucket_sizes
    schedule_dir = layout.schedule_log_dir(data)
    for start_ms in named:
        name = bucket_name(start_ms)
        assert os.path.exists(os.path.join(schedule_dir, name)), f"checkpoint names {name}"


def restart_and_check(root: Path) -> None:
    data = str(root)
    if not os.path.isdir(layout.message_log_dir(data)):
        return  # power lost before the data directory existed
    assert_named_buckets_exist(data)
    remove_orphans(data, NO_SYNC_FS)  # as DelayServer.open does
    log, replayer = open_data(NO_SYNC_FS, data)
    try:
        replay_all(replayer)
        replayer.checkpoint()
    finally:
        replayer.close()
        log.close()
    ids = [s.message.message_id for s in read_schedule_log(root)]
    with SegmentedLog.open(layout.message_log_dir(data), fs=NO_SYNC_FS) as held:
        records = list(held.iter_from(held.min_offset))
    logged = [
        message_log.decode_message(r.payload).message_id
        for r in records
        if r.type == message_log.TYPE_MESSAGE
    ]
    dispatch_dir = layout.dispatch_log_dir(data)
    dispatch = os.listdir(dispatch_dir) if os.path.isdir(dispatch_dir) else []
    gone: set[str] = set()
    if any(r.type == message_log.TYPE_RETIRE_BUCKET for r in records):
        # m1 and m2 went with their dispatch_log; m4, filed into A's name later, is
        # kept, with no dispatch_log of the old file claiming its offset delivered.
        gone = {"m1", "m2"}
        assert bucket_name(A) not in dispatch
    assert sorted(ids) == sorted(i for i in logged if i not in gone)  # each once


def test_the_workload_retires_a_bucket_it_has_open_and_listed():
    fs = CrashSimFileSystem()
    workload(fs)
    assert 20 <= fs.ops <= 200
    schedule = fs.listdir(layout.schedule_log_dir(DATA))
    assert sorted(schedule) == [bucket_name(A), bucket_name(B)]  # A anew: m4
    assert fs.listdir(layout.dispatch_log_dir(DATA)) == []


@pytest.mark.parametrize("mode", ["drop", "torn"])
def test_power_loss_at_every_step_of_a_retirement(mode: str, tmp_path: Path) -> None:
    power_loss_at_every_crash_point(
        lambda: None,
        lambda _journal: workload,
        lambda root, _journal: restart_and_check(root / DATA.strip("/")),
        tmp_path,
        mode,
    )
