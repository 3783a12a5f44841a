"""ScheduleReader: read-only access to schedule_log buckets, for the wheel and sender.

The replayer appends to bucket files through its own descriptors (BucketFiles); the
wheel manager scans buckets for due times and the sender reads records back by offset
through this reader's own read-only descriptors, kept in a small LRU. pread on a
separate descriptor needs no coordination with the appending one: a reader only ever
asks for records the replayer has already appended (it was told of them by the
on_scheduled hook, or it scans up to a length it read under the replayer's lock).

Retention closes the descriptor of a bucket it deletes (``forget``) from the event loop
while a worker thread may be reading *another* bucket through the same reader (the
wheel manager's loader, the sender's large reads): the descriptor table is guarded by a
lock, and no one reads a bucket that retention deletes (it is complete, and older than
the loading cursor).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from delayd.logs import schedule_log
from delayd.logs.buckets import bucket_name, bucket_starts
from storage.fs import O_READ, REAL_FS, FileSystem
from storage.scan import BadFrame, read_frame, read_frames, scan_frames

DEFAULT_MAX_OPEN = 64
_NO_LIMIT = 2**62  # read_frame's limit when the caller knows the record was appended


class ScheduleReader:
    """Read-only descriptors over ``<data>/delay/schedule_log``; one thread at a time."""

    def __init__(
        self, directory: str, *, fs: FileSystem = REAL_FS, max_open: int = DEFAULT_MAX_OPEN
    ) -> None:
        self.directory = directory
        self.fs = fs
        self.max_open = max_open
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._sizes: dict[int, int] = {}  # read_untrusted: a length seen, per open file
        self._lock = threading.Lock()  # the table only; see the module docstring

    def path(self, bucket_ms: int) -> str:
        return f"{self.directory}/{bucket_name(bucket_ms)}"

    def buckets(self) -> list[int]:
        """Starts (epoch ms) of every bucket file, ascending."""
        return bucket_starts(self.fs.listdir(self.directory))

    def size(self, bucket_ms: int) -> int:
        """The file's length now (0 when the bucket has no file)."""
        fd = self._fd(bucket_ms)
        return 0 if fd is None else self.fs.fsize(fd)

    def _fd(self, bucket_ms: int) -> int | None:
        with self._lock:
            fd = self._fds.get(bucket_ms)
            if fd is not None:
                self._fds.move_to_end(bucket_ms)
                return fd
            path = self.path(bucket_ms)
            if not self.fs.exists(path):
                return None
            while len(self._fds) >= self.max_open:
                evicted, old_fd = self._fds.popitem(last=False)
                self._sizes.pop(evicted, None)
                self.fs.close(old_fd)
            fd = self._fds[bucket_ms] = self.fs.open(path, O_READ)
            return fd

    def scan_dues(
        self, bucket_ms: int, start: int, end: int, max_records: int
    ) -> tuple[list[int], list[int], int]:
        """Up to ``max_records`` records from ``start`` (before ``end``): their offsets,
        their due_ms, and the offset after the last one. Raises CorruptionError."""
        offsets: list[int] = []
        dues: list[int] = []
        fd = self._fd(bucket_ms)
        if fd is None:
            if start < end:
                raise FileNotFoundError(self.path(bucket_ms))
            return offsets, dues, start
        path = self.path(bucket_ms)
        due_ms_of = schedule_log.due_ms_of
        position = start
        try:
            for record in scan_frames(self.fs, fd, path, 0, start, end):
                schedule_log.check_type(record.type, path, record.offset)
                offsets.append(record.offset)
                dues.append(due_ms_of(record.payload))
                position = record.next_offset
                if len(offsets) >= max_records:
                    break
        except BadFrame as bad:
            raise bad.corruption() from None
        return offsets, dues, position

    def read_payloads(self, bucket_ms: int, offsets: Sequence[int]) -> list[bytes]:
        """The SCHEDULED payloads at ``offsets``. Raises CorruptionError (or
        FileNotFoundError when the bucket's file is gone)."""
        fd = self._fd(bucket_ms)
        if fd is None:
            raise FileNotFoundError(self.path(bucket_ms))
        try:
            records = read_frames(self.fs, fd, self.path(bucket_ms), 0, offsets, _NO_LIMIT)
        except BadFrame as bad:
            raise bad.corruption() from None
        return [record.payload for record in records]

    def read_untrusted(self, bucket_ms: int, offset: int) -> bytes | None:
        """The SCHEDULED payload at ``offset`` when a whole valid record starts there,
        else None (no file, past its end, not a record boundary). For offsets that may
        be stale (the id index's): the file's length bounds the read, so a stray length
        field can never ask for gigabytes."""
        fd = self._fd(bucket_ms)
        if fd is None:
            return None
        # The length seen last, first (an fsize per lookup was 4 % of a cancel's cost):
        # it only bounds the read (read_frame checks the record), and an offset past it,
        # or a record that does not fit below it, gets a fresh look.
        size = self._sizes.get(bucket_ms, 0)
        for fresh in (False, True):
            if fresh:
                size = self._sizes[bucket_ms] = self.fs.fsize(fd)
            if not 0 <= offset < size:
                continue
            try:
                # The path only names a BadFrame, which is dropped here: not formatted
                # per lookup (the id index calls this once per cancel).
                record = read_frame(self.fs, fd, self.directory, 0, offset, size)
            except BadFrame:
                continue
            if record.type != schedule_log.TYPE_SCHEDULED:
                return None
            return record.payload
        return None

    def forget(self, bucket_ms: int) -> None:
        """Close the bucket's descriptor (before its file is deleted): a file of that
        name created later is opened anew."""
        with self._lock:
            fd = self._fds.pop(bucket_ms, None)
            self._sizes.pop(bucket_ms, None)
            if fd is not None:
                self.fs.close(fd)

    def close(self) -> None:
        with self._lock:
            self._sizes.clear()
            while self._fds:
                self.fs.close(self._fds.popitem()[1])
