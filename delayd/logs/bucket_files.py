"""BucketFiles: the per-bucket RecordFiles of one directory, a bounded number open.

schedule_log and dispatch_log are one file per UTC bucket. Messages due far
apart touch many buckets, so files are kept open in an LRU of at most ``max_open``;
the least recently used is closed when another must open. QMQ keeps every
DelaySegment mapped instead, which costs a file handle and address space per bucket
for as long as the process runs.

An evicted file that still holds unsynced appends is not fsynced on the spot: it is
*retired*, its descriptor kept until the next ``flush`` syncs and closes it with the
others (at most ``max_retired`` wait so, by default ``max_open``; past that the oldest
is synced and closed at once). Eviction happens in the caller's thread, often the
event loop, and work that touches many buckets between two flushes (cancels of
messages due over hours, a restart delivering many overdue buckets) would otherwise
pay one fdatasync per bucket per eviction instead of one per bucket per flush.
Syncing through the descriptor that wrote is deliberate: a new descriptor would not
report a write-back error that happened before it was opened.

Opening a file for append needs a record boundary the caller knows to be durable
(RecordFile's ``trusted_end``): the scan for a torn tail starts there. By default it is
the file's whole current length — correct whenever the caller knows the file holds
nothing unsynced, which is the replayer's invariant for every bucket its recovery did
not have to cut (docs/replay.md). Pass ``trusted_end`` explicitly otherwise.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence

from delayd.logs.buckets import bucket_name, bucket_starts
from storage.framing import TYPE_DATA
from storage.fs import O_READ, REAL_FS, FileSystem, create_dirs_durably
from storage.record_file import DEFAULT_MAX_UNSYNCED_BYTES, RecordFile

DEFAULT_MAX_OPEN = 128


class BucketFiles:
    """Per-bucket RecordFiles under ``directory``; buckets are named by start (epoch ms).

    Used from one thread at a time: ``flush`` may run in a worker thread while the owner
    is not appending (the replayer awaits it).
    """

    def __init__(
        self,
        directory: str,
        *,
        fs: FileSystem = REAL_FS,
        max_open: int = DEFAULT_MAX_OPEN,
        max_retired: int | None = None,
        max_unsynced_bytes: int = DEFAULT_MAX_UNSYNCED_BYTES,
    ) -> None:
        if max_open < 1:
            raise ValueError(f"max_open must be at least 1, got {max_open}")
        self.directory = directory
        self.fs = fs
        self.max_open = max_open
        self.max_retired = max_open if max_retired is None else max_retired
        self.max_unsynced_bytes = max_unsynced_bytes
        self._open: OrderedDict[int, RecordFile] = OrderedDict()  # least recently used first
        self._dirty: set[int] = set()  # open buckets appended to since their last flush
        # Evicted with unsynced appends, oldest first: synced and closed by ``flush``.
        self._retired: OrderedDict[int, RecordFile] = OrderedDict()
        self.opens = 0  # files opened so far (LRU misses), for tests and metrics
        # Also fsyncs the directory itself: bucket files a killed process created may
        # have names only in the page cache; this adopts them all at once (files created
        # from here on are dir-synced by RecordFile.open).
        create_dirs_durably(fs, directory)

    def path(self, start_ms: int) -> str:
        return os.path.join(self.directory, bucket_name(start_ms))

    def is_open(self, start_ms: int) -> bool:
        """Whether the bucket's file is open, in the LRU or retired (appending to it opens
        no file)."""
        return start_ms in self._open or start_ms in self._retired

    def exists(self, start_ms: int) -> bool:
        return self.is_open(start_ms) or self.fs.exists(self.path(start_ms))

    def buckets(self) -> list[int]:
        """Starts (epoch ms) of every bucket file in the directory, ascending."""
        return bucket_starts(self.fs.listdir(self.directory))

    def get(self, start_ms: int, *, trusted_end: int | None = None) -> RecordFile:
        """The open RecordFile of the bucket, opening (and creating) it when needed.

        ``trusted_end`` applies only when the file is not open yet (see the module
        docstring; None means its current length). Raises CorruptionError when the file
        is damaged before its last ``max_unsynced_bytes`` or shorter than
        ``trusted_end``.
        """
        record_file = self._open.get(start_ms)
        if record_file is not None:
            self._open.move_to_end(start_ms)
            return record_file
        while len(self._open) >= self.max_open:
            self._evict()
        record_file = self._retired.pop(start_ms, None)
        if record_file is not None:  # back from retirement, still unsynced
            self._open[start_ms] = record_file
            self._dirty.add(start_ms)
            return record_file
        path = self.path(start_ms)
        if trusted_end is None:
            trusted_end = self._size(path)
        record_file = RecordFile.open(
            path, fs=self.fs, trusted_end=trusted_end, max_unsynced_bytes=self.max_unsynced_bytes
        )
        self.opens += 1
        self._open[start_ms] = record_file
        return record_file

    def opened(self, start_ms: int) -> RecordFile | None:
        """The bucket's RecordFile if it is open now (in the LRU or retired), else None;
        unlike ``get`` it neither opens a file nor changes the LRU's order."""
        record_file = self._open.get(start_ms)
        return record_file if record_file is not None else self._retired.get(start_ms)

    def size(self, start_ms: int) -> int:
        """The bucket file's length on disk (0 when it has none)."""
        return self._size(self.path(start_ms))

    def _size(self, path: str) -> int:
        if not self.fs.exists(path):
            return 0
        fd = self.fs.open(path, O_READ)
        try:
            return self.fs.fsize(fd)
        finally:
            self.fs.close(fd)

    def _evict(self) -> None:
        start_ms, record_file = self._open.popitem(last=False)
        if start_ms not in self._dirty:
            record_file.close()  # nothing unsynced: no fdatasync
            return
        self._dirty.discard(start_ms)
        if len(self._retired) >= self.max_retired:
            if not self._retired:
                record_file.close()  # no retirement at all: flushes now
                return
            _, oldest = self._retired.popitem(last=False)
            oldest.close()  # flushes: too many wait already
        self._retired[start_ms] = record_file

    def close_bucket(self, start_ms: int) -> bool:
        """Flush and close the bucket's file if it is open (before retention deletes
        it); returns whether it was. A later ``get`` opens it again."""
        record_file = self._open.pop(start_ms, None)
        if record_file is None:
            record_file = self._retired.pop(start_ms, None)
        if record_file is None:
            return False
        self._dirty.discard(start_ms)
        record_file.close()
        return True

    def append_batch(
        self, start_ms: int, payloads: Sequence[bytes], rtype: int = TYPE_DATA
    ) -> list[int]:
        """Append records to the bucket's file; returns their offsets in it."""
        offsets = self.get(start_ms).append_batch(payloads, rtype)
        self._dirty.add(start_ms)
        return offsets

    @property
    def dirty(self) -> frozenset[int]:
        """Buckets holding appends not flushed yet (open or retired)."""
        return frozenset(self._dirty.union(self._retired))

    def flush(self) -> int:
        """fdatasync every bucket appended to since its last flush, and close the retired
        ones; returns how many were synced."""
        dirty, self._dirty = self._dirty, set()
        try:
            for start_ms in sorted(dirty):
                self._open[start_ms].flush()
        except BaseException:
            self._dirty |= dirty  # unknown which made it: flush them all again next time
            raise
        retired = self._retired
        synced = len(dirty) + len(retired)
        while retired:
            start_ms, record_file = next(iter(retired.items()))
            record_file.flush()  # a failure leaves it retired: the next flush tries again
            record_file.close()
            del retired[start_ms]
        return synced

    def open_sizes(self) -> dict[int, int]:
        """End offset (bytes) of every open bucket file, by bucket start."""
        return {start_ms: rf.end_offset for start_ms, rf in self._open.items()}

    @property
    def open_count(self) -> int:
        """Descriptors held: the LRU's and the retired files' (max_open + max_retired)."""
        return len(self._open) + len(self._retired)

    def close(self) -> None:
        """Flush and close every open file."""
        try:
            for files in (self._retired, self._open):
                while files:
                    _, record_file = files.popitem(last=False)
                    record_file.close()
        finally:
            self._dirty.clear()

    def __enter__(self) -> BucketFiles:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
