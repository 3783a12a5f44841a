"""BucketFiles: evicting a file with unsynced appends defers its fdatasync to the next
flush (through the descriptor that wrote), bounded, and loses nothing."""

import os
import resource

import pytest

from delayd.logs.bucket_files import BucketFiles
from delayd.logs.buckets import bucket_name
from delayd.logs.dispatch_files import DispatchFiles
from delayd.logs.dispatch_log import FRAMED_SIZE, EntryKind, decode_records
from storage.errors import FsyncError, StorageError
from storage.fs import REAL_FS, OsFileSystem
from storage.scan import scan_frames

MINUTE = 60_000


class SyncCountingFs(OsFileSystem):
    """The real file system, counting fdatasyncs per descriptor; ``fail_in`` = n makes
    the n-th fdatasync from now raise, as a failed write-back does."""

    def __init__(self) -> None:
        self.synced: list[int] = []
        self.fail_in = 0

    def fdatasync(self, fd: int) -> None:
        if self.fail_in:
            self.fail_in -= 1
            if not self.fail_in:
                raise OSError(5, "Input/output error (injected)")
        self.synced.append(fd)
        super().fdatasync(fd)


def records(fs, path: str) -> list[bytes]:
    fd = fs.open(path, os.O_RDONLY)
    try:
        return [r.payload for r in scan_frames(fs, fd, path, 0, 0, fs.fsize(fd))]
    finally:
        fs.close(fd)


def fill(files: BucketFiles, buckets: int) -> None:
    for i in range(buckets):
        files.append_batch(i * MINUTE, [b"record %d" % i])


def test_evicting_unsynced_files_costs_no_fdatasync_until_the_flush(tmp_path):
    fs = SyncCountingFs()
    files = BucketFiles(str(tmp_path), fs=fs, max_open=4)
    fill(files, 8)
    assert fs.synced == []  # four evicted, all retired: nothing synced in the caller
    assert files.open_count == 8
    assert files.dirty == frozenset(i * MINUTE for i in range(8))
    assert all(files.is_open(i * MINUTE) for i in range(8))

    assert files.flush() == 8
    assert len(fs.synced) == 8  # one fdatasync per bucket, each once
    assert files.open_count == 4  # the retired ones were closed
    assert files.dirty == frozenset()
    files.close()
    for i in range(8):
        assert records(fs, files.path(i * MINUTE)) == [b"record %d" % i]


def test_a_retired_file_comes_back_unsynced_and_is_synced_once(tmp_path):
    fs = SyncCountingFs()
    files = BucketFiles(str(tmp_path), fs=fs, max_open=2)
    fill(files, 3)  # bucket 0 retired
    opens = files.opens
    files.append_batch(0, [b"again"])  # reinstated: no new open, bucket 1 retired
    assert files.opens == opens
    assert files.dirty == frozenset({0, MINUTE, 2 * MINUTE})
    assert files.flush() == 3
    assert len(fs.synced) == 3
    files.close()
    assert records(fs, files.path(0)) == [b"record 0", b"again"]


def test_retired_files_are_bounded_the_oldest_synced_at_once(tmp_path):
    fs = SyncCountingFs()
    files = BucketFiles(str(tmp_path), fs=fs, max_open=2)
    peak = 0
    for i in range(10):
        files.append_batch(i * MINUTE, [b"x"])
        peak = max(peak, files.open_count)
    assert peak == 4  # two in the LRU, two retired
    assert len(fs.synced) == 6  # the rest were synced as they left retirement
    assert files.flush() == 4
    assert len(fs.synced) == 10


def test_evicting_a_synced_file_does_not_sync_it_again(tmp_path):
    fs = SyncCountingFs()
    files = BucketFiles(str(tmp_path), fs=fs, max_open=2)
    fill(files, 2)
    files.flush()
    fill(files, 0)
    files.append_batch(5 * MINUTE, [b"y"])
    files.append_batch(6 * MINUTE, [b"z"])  # evicts buckets 0 and 1, both clean
    assert len(fs.synced) == 2
    assert files.open_count == 2


@pytest.mark.parametrize("failing", [1, 2], ids=["open-file", "retired-file"])
def test_a_failed_sync_is_never_tried_again(tmp_path, failing):
    """After a failed fdatasync the kernel may have dropped the pages it could not
    write (fsyncgate): a second fdatasync would report them durable. The file refuses
    every further use instead, and a flush keeps failing until the process restarts."""
    fs = SyncCountingFs()
    files = BucketFiles(str(tmp_path), fs=fs, max_open=1)
    fill(files, 2)  # bucket 1 open, bucket 0 retired; flush syncs them in that order
    fs.fail_in = failing
    with pytest.raises(FsyncError, match="never retry the fsync"):
        files.flush()
    failed_fd_syncs = len(fs.synced)
    with pytest.raises(StorageError, match="failed earlier"):
        files.flush()
    with pytest.raises(StorageError, match="failed earlier"):
        files.append_batch(MINUTE if failing == 1 else 0, [b"more"])
    assert len(fs.synced) == failed_fd_syncs  # the failed file was not synced again


def test_a_first_record_into_a_dispatch_file_cuts_its_torn_tail(tmp_path):
    """After a machine crash a dispatch_log file may end in half an entry; the first
    entry this process records into it (a cancel of a far message, before any load of
    the bucket read the file) must follow the last whole entry, not the garbage."""
    directory = str(tmp_path / "dispatch")
    before = DispatchFiles(directory)
    before.record(0, EntryKind.DISPATCHED, [0, 100], 5, b"g1")
    before.close()
    path = os.path.join(directory, bucket_name(0))
    whole = os.path.getsize(path)
    with open(path, "ab") as torn:
        torn.write(b"\x29\x00\x00")  # the first bytes of a frame: a torn tail

    after = DispatchFiles(directory)
    after.record(0, EntryKind.CANCELLED, [200], 7, b"")
    after.close()
    assert os.path.getsize(path) == whole + FRAMED_SIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        frames = scan_frames(REAL_FS, fd, path, 0, 0, whole + FRAMED_SIZE)
        entries = [(e.kind, e.offset) for e in decode_records(frames, path)]
    finally:
        os.close(fd)
    assert entries == [
        (EntryKind.DISPATCHED, 0),
        (EntryKind.DISPATCHED, 100),
        (EntryKind.CANCELLED, 200),
    ]


def test_max_retired_zero_syncs_on_eviction(tmp_path):
    fs = SyncCountingFs()
    files = BucketFiles(str(tmp_path), fs=fs, max_open=2, max_retired=0)
    fill(files, 5)
    assert len(fs.synced) == 3
    assert files.open_count == 2


@pytest.mark.parametrize(
    ("soft", "budget"), [(1024, 128), (20_000, 1024), (4, 1), (resource.RLIM_INFINITY, 1024)]
)
def test_dispatch_files_retire_at_most_an_eighth_of_the_descriptor_limit(
    tmp_path, monkeypatch, soft, budget
):
    monkeypatch.setattr(resource, "getrlimit", lambda _which: (soft, resource.RLIM_INFINITY))
    files = DispatchFiles(str(tmp_path))
    assert files.files.max_retired == budget
    files.close()
