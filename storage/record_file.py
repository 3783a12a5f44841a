"""RecordFile: one file of CRC-framed records, for logs that are one file per key.

The delay server keeps one schedule_log file and one dispatch_log file per time bucket
(named by the bucket, not by an offset), so a bucket is a RecordFile rather than a
SegmentedLog. Offsets are byte positions in the file. The framing, the scanner and the
torn-tail rule are the segmented log's (storage/framing.py, storage/scan.py,
storage/torn_tail.py):

* on open the file is scanned from ``trusted_end`` (a length the caller knows to be
  durable, e.g. from its checkpoint; 0 scans everything) to the end; the first invalid
  record within ``max_unsynced_bytes`` of the end is a torn tail and is cut, anything
  earlier raises CorruptionError and nothing is truncated;
* the file never holds more than ``max_unsynced_bytes`` unsynced (append flushes first).

A write that finds the disk full (ENOSPC, EDQUOT) refuses the whole batch with
DiskFullError and cuts the file back to where the batch began, so the file stays
usable and no torn record is followed by later appends. A failed fsync raises
FsyncError and the file refuses all further use (storage/segmented_log.py says why).

A RecordFile is used from one thread; ``flush`` may run in a worker thread while that
thread is not appending (the caller serialises them, as the replayer does).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from storage.errors import (
    CorruptionError,
    FsyncError,
    RawAppendRefused,
    RecordTooLargeError,
    is_disk_full,
)
from storage.framing import HEADER, HEADER_SIZE, MAX_TYPE, TYPE_DATA, crc32c, type_seed
from storage.fs import O_WRITE, REAL_FS, FileSystem, create_dirs_durably, disk_full_error
from storage.raw_frames import check_append, check_boundary, pieces, whole_frames
from storage.scan import BadFrame, Record, read_frame, scan_frames, validate_frames
from storage.store import Store
from storage.torn_tail import DEFAULT_MAX_UNSYNCED_BYTES, is_torn_tail


class RecordFile(Store):
    """An append-only file of framed records (see the module docstring)."""

    def __init__(self, path: str, fs: FileSystem, fd: int, size: int, max_unsynced: int) -> None:
        self.path = path
        self.fs = fs
        self.max_unsynced_bytes = max_unsynced
        self.truncated_bytes = 0  # torn tail cut when the file was opened
        # Record boundaries known without a scan: where open began validating (the
        # caller's trusted end) and the durable end; truncate checks from the nearest.
        self._trusted_end = 0
        self._fd = fd
        self._size = size
        self._durable = size

    @classmethod
    def open(
        cls,
        path: str,
        *,
        fs: FileSystem = REAL_FS,
        trusted_end: int = 0,
        max_unsynced_bytes: int = DEFAULT_MAX_UNSYNCED_BYTES,
    ) -> RecordFile:
        """Open (creating when missing, with its directory made durable) and recover.

        Raises CorruptionError for damage a crash cannot explain, or when the file is
        shorter than ``trusted_end``; DiskFullError when it cannot be created for lack
        of space.
        """
        try:
            return cls._open(path, fs, trusted_end, max_unsynced_bytes)
        except OSError as exc:
            if is_disk_full(exc):
                raise disk_full_error(fs, path, exc) from None
            raise

    @classmethod
    def _open(
        cls, path: str, fs: FileSystem, trusted_end: int, max_unsynced_bytes: int
    ) -> RecordFile:
        directory = os.path.dirname(path) or "."
        if not fs.exists(directory):
            # Once per new directory; a store of many RecordFiles makes its existing
            # directory durable once at start (create_dirs_durably) rather than per file.
            create_dirs_durably(fs, directory)
        created = not fs.exists(path)
        fd = fs.open(path, O_WRITE)
        try:
            if created:
                fs.fsync_dir(directory)
            size = fs.fsize(fd)
            if size < trusted_end:
                raise CorruptionError(
                    path,
                    size,
                    trusted_end - size,
                    f"file is shorter than its durable length {trusted_end}",
                )
            try:
                end, _ = validate_frames(fs, fd, path, trusted_end, size)
                cut = 0
            except BadFrame as bad:
                if not is_torn_tail(
                    bad.position,
                    size,
                    durable_end=trusted_end,
                    max_unsynced_bytes=max_unsynced_bytes,
                ):
                    raise bad.corruption() from None
                end, cut = bad.position, size - bad.position
                fs.ftruncate(fd, end)
            if cut or size > trusted_end:
                fs.fsync(fd)  # what survived a kill -9 may sit only in the page cache
        except BaseException:
            fs.close(fd)
            raise
        record_file = cls(path, fs, fd, end, max_unsynced_bytes)
        record_file.truncated_bytes = cut
        record_file._trusted_end = trusted_end
        return record_file

    @property
    def end_offset(self) -> int:
        return self._size

    @property
    def durable_offset(self) -> int:
        return self._durable

    @property
    def unsynced_bytes(self) -> int:
        return self._size - self._durable

    def append_batch(self, payloads: Sequence[bytes], rtype: int = TYPE_DATA) -> list[int]:
        """Append records; returns their offsets. Durable after the next flush().

        Raises RecordTooLargeError (nothing written) for a record larger than the
        unsynced window, ValueError for a reserved type, DiskFullError (nothing of the
        batch kept) when the disk is full.
        """
        self._check_usable()
        mark = self._size
        try:
            return self._append_batch(payloads, rtype)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            self._undo_append(mark)
            raise disk_full_error(self.fs, self.path, exc) from None

    def _undo_append(self, mark: int) -> None:
        """Cut the file back to ``mark`` (where a refused batch began) and fsync the cut,
        so a power loss cannot bring back records whose append was refused."""
        try:
            self.fs.ftruncate(self._fd, mark)
            self.fs.fsync(self._fd)
        except Exception as exc:
            self._failed = FsyncError(self.path, exc)
            raise self._failed from exc
        self._size = mark
        self._durable = min(self._durable, mark)

    def _append_batch(self, payloads: Sequence[bytes], rtype: int) -> list[int]:
        if not TYPE_DATA <= rtype <= MAX_TYPE:
            raise ValueError(f"record type {rtype} is reserved; use {TYPE_DATA}..{MAX_TYPE}")
        sizes = list(map(len, payloads))
        if not sizes:
            return []
        if HEADER_SIZE + max(sizes) > self.max_unsynced_bytes:
            raise RecordTooLargeError(
                f"a record exceeds max_unsynced_bytes={self.max_unsynced_bytes} in {self.path}"
            )
        seed = type_seed(rtype)
        pack = HEADER.pack
        offsets: list[int] = []
        parts: list[bytes] = []
        if self._size - self._durable + sum(sizes) + HEADER_SIZE * len(sizes) <= (
            self.max_unsynced_bytes
        ):
            # The whole batch fits in the unsynced window (the usual case): one write, no
            # per-record check.
            position = self._size
            for payload, size in zip(payloads, sizes):  # noqa: B905  # same length
                offsets.append(position)
                parts.append(pack(size, crc32c(payload, seed), rtype))
                parts.append(payload)
                position += HEADER_SIZE + size
            self._write(b"".join(parts))
            return offsets
        pending = 0
        for payload in payloads:
            need = HEADER_SIZE + len(payload)
            if self.unsynced_bytes + pending + need > self.max_unsynced_bytes:
                self._write(b"".join(parts))
                parts, pending = [], 0
                self.flush()
            offsets.append(self._size + pending)
            parts.append(pack(len(payload), crc32c(payload, seed), rtype))
            parts.append(payload)
            pending += need
        self._write(b"".join(parts))
        return offsets

    def append(self, payload: bytes, rtype: int = TYPE_DATA) -> int:
        return self.append_batch((payload,), rtype)[0]

    def _write(self, data: bytes) -> None:
        if data:
            self.fs.pwrite(self._fd, data, self._size)
            self._size += len(data)

    def flush(self) -> int:
        """fdatasync; returns the durable end offset."""
        self._check_usable()
        if self._durable < self._size:
            target = self._size
            try:
                self.fs.fdatasync(self._fd)
            except Exception as exc:
                self._failed = FsyncError(self.path, exc)
                raise self._failed from exc
            self._durable = target
        return self._durable

    def read(self, offset: int) -> Record:
        """The record at ``offset``. Raises ValueError past the end, CorruptionError."""
        self._check_open()
        if not 0 <= offset < self._size:
            raise ValueError(f"offset {offset} is outside {self.path} [0, {self._size})")
        try:
            return read_frame(self.fs, self._fd, self.path, 0, offset, self._size)
        except BadFrame as bad:
            raise bad.corruption() from None

    def iter_from(self, offset: int = 0, until: int | None = None) -> Iterator[Record]:
        """Records from ``offset`` up to ``until`` or the end as of each chunk read."""
        self._check_open()
        limit = self._size if until is None else min(until, self._size)
        try:
            yield from scan_frames(self.fs, self._fd, self.path, 0, offset, limit)
        except BadFrame as bad:
            raise bad.corruption() from None

    def read_raw(self, offset: int, max_bytes: int) -> bytes:
        """The framed bytes from ``offset`` (a record boundary) as they lie in the file:
        whole records only, at most ``max_bytes`` of them unless the first record alone
        is longer (then exactly that record). Empty at the end. Every CRC is checked.
        Raises ValueError past the end, CorruptionError."""
        self._check_open()
        if not 0 <= offset <= self._size:
            raise ValueError(f"offset {offset} is outside {self.path} [0, {self._size}]")
        if offset == self._size:
            return b""
        size = min(max(max_bytes, HEADER_SIZE), self._size - offset)
        data = self.fs.pread(self._fd, size, offset)
        return whole_frames(self.fs, self._fd, self.path, offset, self._size, data)

    def append_raw(self, offset: int, data: bytes) -> int:
        """Append framed bytes copied from another file's ``read_raw`` at ``offset``,
        which must be this file's end; returns the new end. Durable after flush().

        Raises RawAppendRefused (nothing written) when ``offset`` is not the end or a
        frame is cut short, fails its CRC or is an END_OF_SEGMENT marker (a bucket file
        has none); DiskFullError (nothing kept) when the disk is full.
        """
        self._check_usable()
        walk = check_append(data, self.path, offset, self._size)
        if walk.segment_ends:
            raise RawAppendRefused(
                f"{self.path}: refused raw bytes: an end-of-segment marker at byte "
                f"{offset + walk.segment_ends[0] - HEADER_SIZE}; a record file holds none"
            )
        mark = self._size
        try:
            start = 0
            for stop in pieces(walk, self.max_unsynced_bytes):
                if self.unsynced_bytes + stop - start > self.max_unsynced_bytes:
                    self.flush()
                self._write(data[start:stop])
                start = stop
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            self._undo_append(mark)
            raise disk_full_error(self.fs, self.path, exc) from None
        return self._size

    def truncate(self, offset: int) -> None:
        """Drop every record at or after ``offset`` (a record boundary) and fsync.

        Replication cuts a divergent tail with it; the replayer makes its appends
        idempotent by cutting what a crashed run wrote after its checkpoint. Raises
        ValueError when ``offset`` is past the end or not a record boundary.
        """
        self._check_open()
        if not 0 <= offset <= self._size:
            raise ValueError(f"cannot truncate {self.path} to {offset}: size is {self._size}")
        known = max(b for b in (0, self._trusted_end, self._durable) if b <= offset)
        check_boundary(self.fs, self._fd, self.path, offset, known)
        self.fs.ftruncate(self._fd, offset)
        self.fs.fsync(self._fd)
        self._size = self._durable = offset
        self._trusted_end = min(self._trusted_end, offset)

    @property
    def described(self) -> str:
        return self.path

    def _release_files(self) -> None:
        self.fs.close(self._fd)
