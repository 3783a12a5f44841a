"""storage/ on a full disk and after a failed fsync, through the crash simulator.

A write that finds no space is refused whole (DiskFullError), the file is cut back to
where the refused append began, and appends succeed again once space returns; nothing
appended before is lost, after a reopen or a power loss. A failed fsync (EIO) is never
retried: the store refuses every further use until it is reopened from disk.
"""

from __future__ import annotations

import errno
import os
import random

import pytest

from storage.checkpoint import read_checkpoint, write_checkpoint
from storage.crashfs import MODES, CrashSimFileSystem
from storage.errors import DiskFullError, FsyncError, StorageError
from storage.record_file import RecordFile
from storage.segmented_log import SegmentedLog
from storage.space import FreeSpaceGuard

LOG_DIR = "/data/log"
LOG_OPTIONS = {"segment_size": 4096, "max_unsynced_bytes": 2048, "checkpoint_every_bytes": 1024}
RECORD = b"r" * 100


def fill_log(log: SegmentedLog, fs: CrashSimFileSystem) -> list[bytes]:
    """Append numbered records, flushing as a server would, until the disk refuses one;
    returns the payloads whose appends (and flushes) succeeded."""
    stored: list[bytes] = []
    for i in range(10_000):
        payload = b"%05d" % i + RECORD
        try:
            log.append(payload)
        except DiskFullError:
            return stored
        stored.append(payload)
        if i % 3 == 0:
            log.flush()
    raise AssertionError("the disk never filled")


def payloads(log: SegmentedLog) -> list[bytes]:
    return [record.payload for record in log.iter_from(log.min_offset)]


def test_a_full_disk_refuses_the_append_and_keeps_the_log_whole():
    fs = CrashSimFileSystem()
    fs.capacity = 3 * 4096 + 500  # the third segment fills part-way through a record
    log = SegmentedLog.open(LOG_DIR, fs=fs, **LOG_OPTIONS)
    stored = fill_log(log, fs)
    end = log.end_offset

    with pytest.raises(DiskFullError) as refused:
        log.append(b"refused" + RECORD)
    assert refused.value.path.startswith(LOG_DIR + "/")
    assert refused.value.errno == errno.ENOSPC
    assert refused.value.free_bytes is not None and refused.value.free_bytes < len(RECORD) + 9
    assert "disk full" in str(refused.value) and LOG_DIR in str(refused.value)
    # The partial record the simulator took was cut: file and log end agree.
    assert log.end_offset == end
    last = [n for n in fs.listdir(LOG_DIR) if n.isdigit()][-1]
    assert int(last) + len(fs._lookup(f"{LOG_DIR}/{last}").data) == end
    assert payloads(log) == stored

    fs.capacity += 10_000  # space returns: the same log object takes appends again
    offset = log.append(b"after" + RECORD)
    log.flush()
    assert log.read(offset).payload == b"after" + RECORD
    log.close()

    with SegmentedLog.open(LOG_DIR, fs=fs, **LOG_OPTIONS) as reopened:
        assert reopened.recovery.truncated_bytes == 0  # no torn record anywhere
        assert payloads(reopened) == [*stored, b"after" + RECORD]


@pytest.mark.parametrize("mode", MODES)
def test_nothing_acknowledged_is_lost_to_a_power_loss_after_a_refusal(tmp_path, mode):
    fs = CrashSimFileSystem(page_size=256)
    fs.capacity = 2 * 4096 + 1000
    log = SegmentedLog.open(LOG_DIR, fs=fs, **LOG_OPTIONS)
    stored = fill_log(log, fs)
    durable = log.flush()
    with pytest.raises(DiskFullError):
        log.append_batch([b"refused-a" + RECORD, b"refused-b" + RECORD * 10])
    fs.materialize(str(tmp_path), mode, random.Random(7))
    with SegmentedLog.open(str(tmp_path) + LOG_DIR, **LOG_OPTIONS) as after:
        found = payloads(after)
        assert found[: len(stored)] == stored
        assert after.end_offset == durable  # the refused batch never comes back
        assert not any(p.startswith(b"refused") for p in found)


def test_a_refused_batch_that_rolled_a_segment_leaves_no_segment_behind():
    fs = CrashSimFileSystem()
    log = SegmentedLog.open(LOG_DIR, fs=fs, **LOG_OPTIONS)
    for _ in range(30):
        log.append(RECORD)  # most of the first segment
    log.flush()
    segments = fs.listdir(LOG_DIR)
    end = log.end_offset
    fs.capacity = fs.used_bytes() + 1500  # room for the roll, not for the whole batch
    with pytest.raises(DiskFullError):
        log.append_batch([RECORD] * 20)
    assert fs.listdir(LOG_DIR) == segments  # the segment the batch opened is gone
    assert log.end_offset == end
    fs.capacity = None
    log.append_batch([RECORD] * 20)
    log.close()
    with SegmentedLog.open(LOG_DIR, fs=fs, **LOG_OPTIONS) as reopened:
        assert payloads(reopened) == [RECORD] * 50


def test_a_failed_fsync_is_never_retried_and_a_reopen_recovers():
    fs = CrashSimFileSystem()
    log = SegmentedLog.open(LOG_DIR, fs=fs, **LOG_OPTIONS)
    log.append(b"durable")
    log.flush()
    log.append(b"written, never confirmed")
    fs.fail_fsyncs(1)
    with pytest.raises(FsyncError, match="never retry"):
        log.flush()
    assert log.durable_offset < log.end_offset  # not acknowledged
    with pytest.raises(StorageError, match="failed earlier"):
        log.flush()  # no second fsync that could report lost pages as durable
    with pytest.raises(StorageError, match="failed earlier"):
        log.append(b"more")
    log.close()
    fs.restart()
    with SegmentedLog.open(LOG_DIR, fs=fs, **LOG_OPTIONS) as reopened:
        assert payloads(reopened)[0] == b"durable"
        reopened.append(b"goes on")
        reopened.flush()


def test_a_record_file_refuses_a_batch_whole_and_resumes():
    fs = CrashSimFileSystem()
    path = "/data/buckets/202611221530"
    record_file = RecordFile.open(path, fs=fs, max_unsynced_bytes=1024)
    record_file.append_batch([RECORD] * 3)
    record_file.flush()
    end = record_file.end_offset
    fs.capacity = fs.used_bytes() + 150
    with pytest.raises(DiskFullError) as refused:
        record_file.append_batch([RECORD] * 20)  # several writes, a flush in between
    assert refused.value.path == path
    assert record_file.end_offset == end
    assert len(fs._lookup(path).data) == end  # the partial tail was cut
    fs.capacity = None
    record_file.append_batch([b"after"])
    record_file.close()
    with RecordFile.open(path, fs=fs) as reopened:
        assert [r.payload for r in reopened.iter_from(0)] == [RECORD] * 3 + [b"after"]
        assert reopened.truncated_bytes == 0


def test_a_record_file_whose_fsync_failed_refuses_everything():
    fs = CrashSimFileSystem()
    record_file = RecordFile.open("/data/b/1", fs=fs)
    record_file.append(b"x")
    fs.fail_fsyncs(1)
    with pytest.raises(FsyncError):
        record_file.flush()
    with pytest.raises(StorageError, match="failed earlier"):
        record_file.flush()
    with pytest.raises(StorageError, match="failed earlier"):
        record_file.append(b"y")


def test_a_checkpoint_that_finds_no_space_keeps_the_old_one():
    fs = CrashSimFileSystem()
    fs.mkdir("/data")
    write_checkpoint(fs, "/data/c", b"old")
    fs.capacity = fs.used_bytes() + 4
    with pytest.raises(DiskFullError):
        write_checkpoint(fs, "/data/c", b"new and longer")
    assert read_checkpoint(fs, "/data/c") == b"old"
    assert not fs.exists("/data/c.tmp")
    fs.capacity = None
    write_checkpoint(fs, "/data/c", b"new and longer")
    assert read_checkpoint(fs, "/data/c") == b"new and longer"


def test_the_simulated_disk_takes_what_fits_then_refuses():
    fs = CrashSimFileSystem()
    fs.mkdir("/d")
    fd = fs.open("/d/f", os.O_RDWR | os.O_CREAT)
    fs.capacity = 10
    with pytest.raises(OSError) as full:
        fs.pwrite(fd, b"0123456789abcdef", 0)
    assert full.value.errno == errno.ENOSPC
    assert fs.pread(fd, 100, 0) == b"0123456789"
    assert fs.free_bytes("/d") == 0
    fs.pwrite(fd, b"XY", 0)  # overwriting takes no space
    fs.ftruncate(fd, 4)
    assert fs.free_bytes("/d") == 6


class CountingSpace(CrashSimFileSystem):
    """Counts the free-space questions."""

    asked = 0

    def free_bytes(self, path: str) -> int:
        self.asked += 1
        return super().free_bytes(path)


def test_the_reserve_guard_asks_once_per_mib_until_it_nears_the_reserve():
    fs = CountingSpace()
    fs.mkdir("/d")
    fs.capacity = 100 << 20
    guard = FreeSpaceGuard(fs, "/d", 10 << 20)
    for _ in range(1024):
        guard.check(4096)  # 4 MiB in all, far from the reserve
    assert fs.asked == 4
    fs.capacity = (10 << 20) + 8192  # two appends from the reserve: asked every time
    guard._since = guard.recheck_bytes  # (the next check asks in any case)
    for _ in range(2):
        guard.check(4096)
        fs.capacity -= 4096  # what the append took
    with pytest.raises(DiskFullError, match=f"reserve of {10 << 20}") as refused:
        guard.check(4096)
    assert refused.value.free_bytes == 10 << 20
    assert fs.asked == 7
