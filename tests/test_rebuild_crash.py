"""A follower's cut of message_log under power loss at every crash point
(delayd/server/rebuild.py, storage/crashfs.py).

A data directory is filled and replayed (a replay checkpoint at the log's end, schedule_log
and the id index written); then the leader's cut runs (``cut_message_log``: the derived
state goes, then message_log is cut) and the power goes at each of its mutating calls.
Whatever the disk then holds must start (no replay checkpoint past the log's end) and
replay exactly once; the member is then told to cut again, and after that second cut
the directory holds exactly the records below the cut, replayed exactly once.
"""

from __future__ import annotations

import random
from contextlib import closing
from pathlib import Path

import pytest

from delayd.logs import layout, message_log
from delayd.logs.message_log import MessageRecord
from delayd.replay import open_replayer
from delayd.replay.state import read_replay_checkpoint
from delayd.server.rebuild import RebuildNeeded, cut_message_log, remove_derived_state
from storage.crashfs import MODES, CrashSimFileSystem, crash_points, run_to_crash
from storage.fs import FileSystem
from storage.segmented_log import SegmentedLog
from tests.crash_support import assert_no_failures, check_crash_point
from tests.intake_support import NO_SYNC_FS, check_exactly_once, read_message_log

DATA = "/data"
T = 1_795_341_600_000
SEGMENT_SIZE = 2048
LOG_OPTIONS = {"segment_size": SEGMENT_SIZE, "max_unsynced_bytes": 1500}
MESSAGES = 40
KEPT = 17  # the cut keeps the first KEPT messages


def open_data(fs: FileSystem, root: str = DATA):
    log = SegmentedLog.open(layout.message_log_dir(root), fs=fs, **LOG_OPTIONS)
    replayer = open_replayer(root, log, segment_scale=1, fs=fs, max_open_buckets=2)
    return log, replayer


def replay_all(fs: FileSystem, root: str = DATA) -> None:
    log, replayer = open_data(fs, root)
    with log, closing(replayer):
        replayer.replay_available()
        replayer.checkpoint()


def fill(fs: FileSystem) -> int:
    """A replayed data directory of MESSAGES messages over five buckets and three or
    more segments; returns the offset of message KEPT + 1 (where the cut goes)."""
    fs.mkdir(DATA)
    fs.fsync_dir("/")
    log, replayer = open_data(fs)
    rng = random.Random(7)
    offsets = []
    for sequence in range(1, MESSAGES + 1):
        record = MessageRecord(
            due_ms=T + rng.randrange(5) * 60_000,
            sequence=sequence,
            receive_ms=T,
            message_id=f"m-{sequence}",
            subject="orders",
            body=rng.randbytes(60),
        )
        offsets += log.append_batch([message_log.encode_record(record)], message_log.TYPE_MESSAGE)
    log.flush()
    replayer.replay_available()
    replayer.checkpoint()
    replayer.close()
    log.close()
    return offsets[KEPT]


def cut_workload(fs: CrashSimFileSystem) -> None:
    cut_message_log(DATA, fill(fs), fs=fs, segment_size=SEGMENT_SIZE)


def check_after_power_loss(root: Path, cut: int) -> None:
    """The directory starts and replays exactly once; cut again (the leader says so at
    the next session), it holds the first KEPT messages, replayed exactly once."""
    data = str(root)
    replay_all(NO_SYNC_FS, data)
    check_exactly_once(root, 1)
    RebuildNeeded(data, cut).rebuild(fs=NO_SYNC_FS, segment_size=SEGMENT_SIZE)
    replay_all(NO_SYNC_FS, data)
    scheduled = check_exactly_once(root, 1)
    kept = [f"m-{n}" for n in range(1, KEPT + 1)]
    assert [record.message_id for _, record in read_message_log(root)] == kept
    assert sorted(scheduled) == sorted(kept)


def test_the_cut_workload_has_derived_state_and_segments_to_remove() -> None:
    """A trivial workload would pass without testing anything."""
    fs = CrashSimFileSystem()
    cut = fill(fs)
    assert read_replay_checkpoint(fs, DATA).position > cut
    assert len(fs.listdir(layout.schedule_log_dir(DATA))) == 5
    assert fs.listdir(layout.id_index_dir(DATA))
    assert len(fs.listdir(layout.message_log_dir(DATA))) >= 3
    before = fs.ops
    cut_message_log(DATA, cut, fs=fs, segment_size=SEGMENT_SIZE)
    assert fs.ops - before >= 12  # crash points inside the cut
    assert not fs.listdir(layout.schedule_log_dir(DATA))
    assert not fs.listdir(layout.id_index_dir(DATA))
    assert read_replay_checkpoint(fs, DATA).position == 0


@pytest.mark.parametrize("mode", MODES)
def test_power_loss_at_every_crash_point_of_the_cut(mode: str, tmp_path: Path) -> None:
    probe = CrashSimFileSystem()
    cut = fill(probe)
    setup_ops = probe.ops
    failures: dict[int, str] = {}
    for k in range(setup_ops, crash_points(cut_workload) + 1):
        fs = run_to_crash(cut_workload, k)
        root = tmp_path / f"k{k}"
        fs.materialize(str(root), mode, random.Random(f"{k}:{mode}"))
        data = root / DATA.strip("/")
        check_crash_point(failures, k, root, lambda: check_after_power_loss(data, cut))  # noqa: B023
    assert_no_failures(failures)


def test_removing_the_derived_state_twice_is_harmless(tmp_path: Path) -> None:
    """A start after a crash part way removes what is left: nothing there is fine."""
    root = tmp_path / "data"
    root.mkdir()
    fs = NO_SYNC_FS
    remove_derived_state(str(root), fs=fs)  # a directory with no derived state at all
    replay_all(fs, str(root))
    remove_derived_state(str(root), fs=fs)
    remove_derived_state(str(root), fs=fs)
    assert read_replay_checkpoint(fs, str(root)).position == 0
