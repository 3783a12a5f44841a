"""SegmentedLog: an append-only log of CRC-framed records split over segment files.

Offsets are logical byte positions, dense across segments: a segment file is named by
the 20-digit zero-padded offset of its first byte (MetaQ / RocketMQ commitlog naming), and
the next segment starts right after the previous one's END_OF_SEGMENT record. Finding the
segment of an offset is a binary search over the sorted base offsets.

Durability model
    ``append``/``append_batch`` write to the OS at once (readers see the records); the
    records are *durable* after ``flush()``, which fdatasyncs every segment written since
    the last flush and fsyncs the directory when a segment was created. The trio layer
    (storage.flusher) decides when to flush (sync with group commit, or every N ms).

How recovery tells a torn tail from corruption
    A power loss can leave any mix of the bytes written since the last fsync: a short
    file, zero pages, even a later page without an earlier one. The log bounds that
    region: it never lets more than ``max_unsynced_bytes`` sit unsynced (append flushes
    first when it would), so after a crash every invalid byte a power loss can explain
    lies within ``max_unsynced_bytes`` of the end of the log. Recovery scans from the
    recovery checkpoint (a durable offset written every ``checkpoint_every_bytes`` of
    flushed data, so reopening costs time proportional to the tail, not to the log); the
    first invalid record it meets is judged by storage.torn_tail (the one rule, which
    inspect and the audit apply too):

    * a torn tail if it lies within ``max_unsynced_bytes`` of the end: the log is cut
      there (later segments removed) and the cut is reported in ``recovery``;
    * corruption otherwise: ``CorruptionError`` names the file, offset and bytes
      affected, and nothing is truncated.

    Records below the recovery checkpoint are not scanned at open; reads verify every
    record's crc and raise ``CorruptionError`` there.

When a write fails
    * No space or quota (ENOSPC, EDQUOT): the append is refused whole with
      ``DiskFullError``. The log is cut back to where the append began (a segment it
      created is removed, a partial record truncated away and the cut fsynced), so later
      appends never follow a torn record, and the log takes appends again at once: they
      succeed as soon as space returns.
    * A failed fsync: ``FsyncError``, and the log refuses every further use. After a
      failed fsync the kernel may have dropped the pages it could not write, so a retry
      could report lost data as durable (PostgreSQL's fsyncgate); only a reopen, whose
      recovery reads what is really on disk, can go on.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from storage.checkpoint import read_checkpoint, write_checkpoint
from storage.errors import (
    CorruptionError,
    DiskFullError,
    FsyncError,
    RecordTooLargeError,
    is_disk_full,
)
from storage.framing import (
    END_OF_SEGMENT_RECORD,
    HEADER,
    HEADER_SIZE,
    MAX_TYPE,
    TYPE_DATA,
    crc32c,
    type_seed,
)
from storage.fs import O_READ, O_WRITE, REAL_FS, FileSystem, create_dirs_durably, disk_full_error
from storage.raw_frames import check_append, check_boundary, pieces, whole_frames
from storage.scan import BadFrame, Record, read_frame, scan_frames, validate_frames
from storage.store import Store
from storage.torn_tail import DEFAULT_MAX_UNSYNCED_BYTES, is_torn_tail

SEGMENT_NAME_DIGITS = 20
RECOVERY_CHECKPOINT = "recovery.checkpoint"
EOS_SIZE = len(END_OF_SEGMENT_RECORD)  # HEADER_SIZE + 0 payload bytes

DEFAULT_SEGMENT_SIZE = 1 << 30  # 1 GiB, as RocketMQ's commitlog
DEFAULT_CHECKPOINT_EVERY_BYTES = 32 << 20
MAX_OPEN_READERS = 64  # read-only fds kept open for sealed segments


def segment_name(base: int) -> str:
    return f"{base:0{SEGMENT_NAME_DIGITS}d}"


def is_segment_name(name: str) -> bool:
    return len(name) == SEGMENT_NAME_DIGITS and name.isdigit()


def read_recovery_checkpoint(fs: FileSystem, directory: str) -> int | None:
    """The offset below which the log in ``directory`` was durable when last flushed
    (recovery scans from there), or None when it has no recovery checkpoint. Raises
    CorruptionError when the checkpoint file is damaged."""
    data = read_checkpoint(fs, os.path.join(directory, RECOVERY_CHECKPOINT))
    return None if data is None else int.from_bytes(data, "little")


@dataclass
class RecoveryReport:
    """What opening the log found and did."""

    scanned_from: int = 0
    scanned_bytes: int = 0
    end_offset: int = 0
    truncated_bytes: int = 0  # torn tail cut off
    truncated_at: int | None = None
    removed_segments: list[str] = field(default_factory=list)


class _Segment:
    __slots__ = ("base", "path", "size", "write_fd")

    def __init__(self, base: int, path: str, size: int) -> None:
        self.base = base
        self.path = path
        self.size = size  # bytes written (logical end = base + size)
        self.write_fd: int | None = None


class _BadRecord(Exception):
    """Internal: the scan met bytes that are not a valid record."""

    def __init__(self, segment: _Segment, position: int, length: int, reason: str) -> None:
        self.segment = segment
        self.position = position
        self.length = length
        self.reason = reason


class SegmentedLog(Store):
    """An append-only, crash-safe log; see the module docstring for the guarantees.

    Appends come from one thread (the event loop); ``flush()`` may run concurrently in a
    worker thread. Readers may iterate while appends happen: they see every record whose
    append returned.
    """

    def __init__(
        self,
        directory: str,
        fs: FileSystem,
        segment_size: int,
        max_unsynced_bytes: int,
        checkpoint_every_bytes: int,
    ) -> None:
        if segment_size < EOS_SIZE + HEADER_SIZE + 1:
            raise ValueError(f"segment_size {segment_size} is too small to hold a record")
        self.directory = directory
        self.fs = fs
        self.segment_size = segment_size
        self.max_unsynced_bytes = max_unsynced_bytes
        self.checkpoint_every_bytes = checkpoint_every_bytes
        self.recovery = RecoveryReport()
        self._segments: dict[int, _Segment] = {}
        self._bases = SortedList()
        self._readers: dict[int, int] = {}  # base -> read fd of a sealed segment
        self._end = 0
        self._durable = 0
        self._checkpointed = 0
        self._unsynced_bytes = 0
        self._dirty: dict[int, _Segment] = {}  # written since the last flush
        self._retired_fds: list[int] = []  # write fds of rolled segments, closed on flush
        self._dir_dirty = False
        self._state_lock = threading.Lock()  # appends vs a flush snapshot
        self._flush_lock = threading.Lock()  # one flush at a time

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        directory: str,
        *,
        fs: FileSystem = REAL_FS,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
        max_unsynced_bytes: int = DEFAULT_MAX_UNSYNCED_BYTES,
        checkpoint_every_bytes: int = DEFAULT_CHECKPOINT_EVERY_BYTES,
    ) -> SegmentedLog:
        """Open (creating if missing) the log in ``directory`` and recover its tail.

        Raises CorruptionError for damage that a crash cannot explain.
        """
        log = cls(directory, fs, segment_size, max_unsynced_bytes, checkpoint_every_bytes)
        create_dirs_durably(fs, directory)
        log._recover()
        return log

    def _recover(self) -> None:
        fs = self.fs
        for name in sorted(n for n in fs.listdir(self.directory) if is_segment_name(n)):
            path = os.path.join(self.directory, name)
            fd = fs.open(path, O_READ)
            try:
                size = fs.fsize(fd)
            finally:
                fs.close(fd)
            seg = _Segment(int(name), path, size)
            self._segments[seg.base] = seg
            self._bases.add(seg.base)
        if not self._bases:
            return
        first = self._segments[self._bases[0]]
        last = self._segments[self._bases[-1]]
        file_end = last.base + last.size
        checkpoint = self._read_recovery_checkpoint()
        start = first.base
        if checkpoint is not None and checkpoint > first.base:
            if checkpoint > file_end:
                raise CorruptionError(
                    last.path,
                    last.size,
                    checkpoint - file_end,
                    f"log ends at offset {file_end} but its recovery checkpoint says "
                    f"{checkpoint} was durable",
                )
            start = checkpoint
        self.recovery.scanned_from = start
        try:
            end = self._scan_to_end(start)
        except _BadRecord as bad:
            end = bad.segment.base + bad.position
            if not is_torn_tail(
                end, file_end, durable_end=start, max_unsynced_bytes=self.max_unsynced_bytes
            ):
                raise CorruptionError(
                    bad.segment.path, bad.position, bad.length, bad.reason
                ) from None
            self._cut_tail(bad.segment, bad.position, file_end)
        self.recovery.scanned_bytes = end - start
        self.recovery.end_offset = end
        self._end = end
        # What survived a kill -9 may still sit only in the page cache: sync it once so
        # that durable_offset is true from the start.
        for base in self._bases.irange(self._segment_of(start).base):
            seg = self._segments[base]
            fd = fs.open(seg.path, O_READ)
            try:
                fs.fsync(fd)
            finally:
                fs.close(fd)
        self._durable = end
        self._checkpointed = start

    def _read_recovery_checkpoint(self) -> int | None:
        return read_recovery_checkpoint(self.fs, self.directory)

    def _scan_to_end(self, start: int) -> int:
        """Validate every record from ``start``; the logical end, or raise _BadRecord."""
        seg = self._segment_of(start)
        position = start - seg.base
        while True:
            position, sealed = self._validate_segment(seg, position)
            is_last = seg.base == self._bases[-1]
            if sealed and position < seg.size:
                raise _BadRecord(
                    seg, position, seg.size - position, "bytes after the end-of-segment marker"
                )
            if not sealed and not is_last:
                raise _BadRecord(
                    seg, position, 0, "segment has no end-of-segment marker but a later one exists"
                )
            if is_last:
                return seg.base + position
            next_base = seg.base + seg.size
            following = self._bases[self._bases.index(seg.base) + 1]
            if following != next_base:
                raise _BadRecord(
                    seg, seg.size, 0, f"next segment should start at {next_base}, found {following}"
                )
            seg, position = self._segments[following], 0

    def _validate_segment(self, seg: _Segment, position: int) -> tuple[int, bool]:
        """Check records from ``position`` to the end of ``seg``.

        Returns (position after the last valid record, whether that record was the
        END_OF_SEGMENT marker). Raises _BadRecord at the first invalid record.
        """
        try:
            return validate_frames(self.fs, self._reader_fd(seg), seg.path, position, seg.size)
        except BadFrame as bad:
            raise _BadRecord(seg, bad.position, bad.length, bad.reason) from None

    def _cut_tail(self, seg: _Segment, position: int, file_end: int) -> None:
        fs = self.fs
        self.recovery.truncated_at = seg.base + position
        self.recovery.truncated_bytes = file_end - (seg.base + position)
        for base in list(self._bases.irange(seg.base + 1)):
            doomed = self._segments.pop(base)
            self._bases.remove(base)
            self._close_reader(base)
            fs.unlink(doomed.path)
            self.recovery.removed_segments.append(os.path.basename(doomed.path))
        self._close_reader(seg.base)
        fd = fs.open(seg.path, O_WRITE)
        try:
            fs.ftruncate(fd, position)
            fs.fsync(fd)
        finally:
            fs.close(fd)
        seg.size = position
        fs.fsync_dir(self.directory)

    # ------------------------------------------------------------------ appending

    def append(self, payload: bytes, rtype: int = TYPE_DATA) -> int:
        """Append one record; returns its offset. Durable after the next flush()."""
        return self.append_batch((payload,), rtype)[0]

    def append_batch(self, payloads: Sequence[bytes], rtype: int = TYPE_DATA) -> list[int]:
        """Append records in order; returns their offsets.

        Raises RecordTooLargeError (before writing anything) when a record cannot fit in
        a segment or in the unsynced window, ValueError for a reserved type,
        DiskFullError (nothing of the batch kept; the log stays usable) when the disk
        is full, FsyncError or another StorageError (the log is then unusable).
        """
        self._check_usable()
        if not TYPE_DATA <= rtype <= MAX_TYPE:
            raise ValueError(f"record type {rtype} is reserved; use {TYPE_DATA}..{MAX_TYPE}")
        limit = min(self.segment_size - EOS_SIZE, self.max_unsynced_bytes)
        sizes = list(map(len, payloads))
        largest = max(sizes, default=0)
        if HEADER_SIZE + largest > limit:
            raise RecordTooLargeError(
                f"record of {largest} bytes does not fit: the limit is "
                f"{limit - HEADER_SIZE} bytes (segment_size={self.segment_size}, "
                f"max_unsynced_bytes={self.max_unsynced_bytes})"
            )
        offsets: list[int] = []
        seed = type_seed(rtype)
        pack = HEADER.pack
        parts: list[bytes] = []  # headers and payloads, joined once per write
        pending = 0
        mark = self._end  # where this batch begins: what a refused batch is cut back to
        try:
            seg = self._active_segment()
            room = min(self.segment_size - EOS_SIZE - seg.size, self.max_unsynced_bytes)
            if sum(sizes) + HEADER_SIZE * len(sizes) <= room:
                # The whole batch fits in the segment (the usual case): one write, no
                # per-record check.
                position = seg.base + seg.size
                for payload, size in zip(payloads, sizes):  # noqa: B905  # same length
                    offsets.append(position)
                    parts.append(pack(size, crc32c(payload, seed), rtype))
                    parts.append(payload)
                    position += HEADER_SIZE + size
                self._write(seg, b"".join(parts))
                return offsets
            for payload in payloads:
                need = HEADER_SIZE + len(payload)
                if pending + need > room:
                    self._write(seg, b"".join(parts))
                    parts, pending = [], 0
                    if seg.size + need > self.segment_size - EOS_SIZE:
                        seg = self._roll(seg)
                    room = min(self.segment_size - EOS_SIZE - seg.size, self.max_unsynced_bytes)
                offsets.append(seg.base + seg.size + pending)
                parts.append(pack(len(payload), crc32c(payload, seed), rtype))
                parts.append(payload)
                pending += need
            self._write(seg, b"".join(parts))
        except BaseException as exc:
            self._refuse_append(exc, mark)
            raise
        return offsets

    def _refuse_append(self, exc: BaseException, mark: int) -> None:
        """An append that began at ``mark`` failed with ``exc``: raise DiskFullError
        with the log cut back to ``mark`` when the disk was full; otherwise the file is
        in an unknown state, so the log refuses every further use (reopen runs
        recovery) and the caller re-raises ``exc``."""
        if self._failed is None and is_disk_full(exc):
            self._undo_append(mark)
            path = self._segment_of(mark).path if self._bases else self.directory
            raise disk_full_error(self.fs, path, exc) from None
        if self._failed is None:
            self._failed = exc

    def _undo_append(self, mark: int) -> None:
        """Cut the log back to ``mark``, where an append that ran out of space began
        (``_cut_back``). Marks the log failed if even that fails."""
        try:
            self._cut_back(mark)
        except BaseException as exc:
            self._failed = exc
            raise

    def _cut_back(self, mark: int) -> None:
        """Cut the log back to ``mark`` (a record boundary at or below the end), durably.

        The order makes every crash point safe: a power loss part way leaves the log as
        it was or shorter, never one recovery calls corrupt. The recovery checkpoint
        goes first when it lies past the cut (recovery refuses a log shorter than its
        checkpoint); then the segments wholly past the cut, newest first, with the
        directory synced (a sealed segment left last is a whole log); then the cut of
        the segment that holds ``mark``, fsynced.
        """
        fs = self.fs
        # No flush may sync a descriptor closed here (flush takes the same locks, in
        # this order).
        with self._flush_lock, self._state_lock:
            if self._checkpointed > mark:
                fs.unlink(os.path.join(self.directory, RECOVERY_CHECKPOINT))
                fs.fsync_dir(self.directory)
                self._checkpointed = min(self.min_offset, mark)
            keep = self._segment_of(mark) if self._bases else None
            removed = False
            for base in reversed(list(self._bases.irange(keep.base + 1 if keep else 0))):
                doomed = self._segments.pop(base)
                self._bases.remove(base)
                self._dirty.pop(base, None)
                self._close_reader(base)
                if doomed.write_fd is not None:
                    fs.close(doomed.write_fd)
                fs.unlink(doomed.path)
                removed = True
            if removed:
                fs.fsync_dir(self.directory)
            if keep is not None:
                if keep.write_fd is None:  # sealed or rolled away from: write here again
                    self._close_reader(keep.base)
                    keep.write_fd = fs.open(keep.path, O_WRITE)
                fs.ftruncate(keep.write_fd, mark - keep.base)
                fs.fsync(keep.write_fd)
                keep.size = mark - keep.base
            self._end = mark
            self._durable = min(self._durable, mark)
            self._unsynced_bytes = self._end - self._durable
            if keep is not None and self._unsynced_bytes:
                self._dirty[keep.base] = keep

    # ------------------------------------------------------------------ raw frames

    def read_raw(self, offset: int, max_bytes: int) -> bytes:
        """The framed bytes from ``offset`` (a record boundary) as they lie on disk,
        END_OF_SEGMENT markers included: whole records only, at most ``max_bytes`` of
        them unless the first record alone is longer (then exactly that record), and
        never past the end of ``offset``'s segment. Empty at the end of the log.

        Every CRC is checked. Raises ValueError outside [min_offset, end_offset],
        CorruptionError when the bytes at ``offset`` are not whole valid records.
        """
        self._check_open()
        if not self.min_offset <= offset <= self._end:
            raise ValueError(f"offset {offset} is outside the log [{self.min_offset}, {self._end}]")
        if offset == self._end:
            return b""
        seg = self._segment_of(offset)
        position = offset - seg.base
        limit = min(seg.size, self._end - seg.base)
        fd = self._read_fd(seg)
        data = self.fs.pread(fd, min(max(max_bytes, HEADER_SIZE), limit - position), position)
        return whole_frames(self.fs, fd, seg.path, position, limit, data)

    def append_raw(self, offset: int, data: bytes) -> int:
        """Append framed bytes copied from another log's ``read_raw`` at ``offset``,
        which must be this log's end; returns the new end. An END_OF_SEGMENT marker in
        ``data`` seals the segment and the next bytes start a new one, so the segments
        match the source's whatever this log's segment_size. Durable after flush().

        Raises RawAppendRefused (nothing written) when ``offset`` is not the end or a
        frame is cut short or fails its CRC; DiskFullError (nothing kept) and the
        errors of append_batch otherwise.
        """
        self._check_usable()
        walk = check_append(data, self.described, offset, self._end)
        if not data:
            return self._end
        mark = self._end
        try:
            start = 0
            for stop in pieces(walk, self.max_unsynced_bytes):
                seg = self._active_segment()
                self._write(seg, data[start:stop])
                if stop in walk.segment_ends:
                    with self._state_lock:
                        self._retired_fds.append(seg.write_fd)
                        seg.write_fd = None
                start = stop
        except BaseException as exc:
            self._refuse_append(exc, mark)
            raise
        return self._end

    def truncate(self, offset: int) -> None:
        """Cut the log back to ``offset``, a record boundary in [min_offset, end_offset],
        durably: segments wholly past it removed, the cut fsynced (``_cut_back``).
        Raises ValueError when ``offset`` is outside the log or not a record boundary.
        """
        self._check_usable()
        if not self.min_offset <= offset <= self._end:
            raise ValueError(
                f"cannot truncate {self.described} to {offset}: it holds "
                f"[{self.min_offset}, {self._end}]"
            )
        if offset == self._end:
            return
        seg = self._segment_of(offset)
        # Durable ends and checkpoints are record boundaries: hop from the nearest one.
        known = [seg.base] + [b for b in (self._durable, self._checkpointed) if b <= offset]
        start = max(known) - seg.base
        check_boundary(self.fs, self._read_fd(seg), seg.path, offset - seg.base, start)
        try:
            self._cut_back(offset)
        except BaseException as exc:
            self._failed = exc
            raise

    def _write(self, seg: _Segment, data: bytes | bytearray) -> None:
        if not data:
            return
        if self._unsynced_bytes + len(data) > self.max_unsynced_bytes:
            # Keep the unsynced window bounded: it is what lets recovery tell a torn
            # tail from corruption. The trio flusher normally flushes long before this.
            self.flush()
        self.fs.pwrite(seg.write_fd, data, seg.size)
        with self._state_lock:
            seg.size += len(data)
            self._end = seg.base + seg.size
            self._unsynced_bytes += len(data)
            self._dirty[seg.base] = seg

    def _active_segment(self) -> _Segment:
        if self._bases:
            seg = self._segments[self._bases[-1]]
            if seg.base + seg.size == self._end and seg.write_fd is not None:
                return seg
            if seg.base + seg.size == self._end and not self._is_sealed(seg):
                seg.write_fd = self.fs.open(seg.path, O_WRITE)
                return seg
        return self._create_segment(self._end)

    def _is_sealed(self, seg: _Segment) -> bool:
        if seg.size < EOS_SIZE:
            return False
        tail = self.fs.pread(self._reader_fd(seg), EOS_SIZE, seg.size - EOS_SIZE)
        return tail == END_OF_SEGMENT_RECORD

    def _create_segment(self, base: int) -> _Segment:
        path = os.path.join(self.directory, segment_name(base))
        seg = _Segment(base, path, 0)
        seg.write_fd = self.fs.open(path, O_WRITE)
        self.fs.ftruncate(seg.write_fd, 0)  # a leftover of a crashed creation is garbage
        with self._state_lock:
            self._segments[base] = seg
            self._bases.add(base)
            self._dir_dirty = True
        return seg

    def _roll(self, seg: _Segment) -> _Segment:
        self._write(seg, END_OF_SEGMENT_RECORD)
        with self._state_lock:
            self._retired_fds.append(seg.write_fd)
            seg.write_fd = None
        return self._create_segment(seg.base + seg.size)

    # ------------------------------------------------------------------ durability

    def flush(self) -> int:
        """Make every record appended so far durable; returns the durable end offset.

        Safe to call from a worker thread while the event loop appends. A failed fsync
        makes the log unusable (after an fsync error the kernel may have dropped the
        dirty pages, so retrying could report lost data as durable).
        """
        with self._flush_lock:
            self._check_usable()
            with self._state_lock:
                target = self._end
                # Capture the fds now: the event loop may roll a segment meanwhile.
                dirty = [seg.write_fd for seg in self._dirty.values() if seg.write_fd is not None]
                retired = self._retired_fds
                self._retired_fds = []
                self._dirty = {}
                dir_dirty, self._dir_dirty = self._dir_dirty, False
                synced_bytes = self._unsynced_bytes
            try:
                for fd in retired:
                    self.fs.fdatasync(fd)
                    self.fs.close(fd)
                for fd in dirty:
                    self.fs.fdatasync(fd)
                if dir_dirty:
                    self.fs.fsync_dir(self.directory)
            except Exception as exc:
                self._failed = FsyncError(self.directory, exc)
                raise self._failed from exc
            except BaseException as exc:  # a simulated power loss, KeyboardInterrupt
                self._failed = exc
                raise
            with self._state_lock:
                self._unsynced_bytes -= synced_bytes
                self._durable = max(self._durable, target)
            if self._durable - self._checkpointed >= self.checkpoint_every_bytes:
                self._write_recovery_checkpoint(self._durable)
            return self._durable

    def _write_recovery_checkpoint(self, offset: int) -> None:
        path = os.path.join(self.directory, RECOVERY_CHECKPOINT)
        try:
            write_checkpoint(self.fs, path, offset.to_bytes(8, "little"))
        except DiskFullError:
            # Only a shortcut for recovery (it scans from the older checkpoint): the
            # next flush tries again.
            return
        self._checkpointed = offset

    # ------------------------------------------------------------------ reading

    @property
    def min_offset(self) -> int:
        """Offset of the oldest record still on disk (== end_offset when empty)."""
        return self._bases[0] if self._bases else self._end

    @property
    def end_offset(self) -> int:
        """Offset the next record will be written at (one past the last record)."""
        return self._end

    @property
    def durable_offset(self) -> int:
        """Every record below this offset survives a power loss."""
        return self._durable

    @property
    def unsynced_bytes(self) -> int:
        return self._unsynced_bytes

    def read(self, offset: int) -> Record:
        """The record at ``offset`` (an offset returned by append or a scan).

        Raises ValueError outside [min_offset, end_offset), CorruptionError when the bytes
        there are not a valid record.
        """
        self._check_open()
        if not self.min_offset <= offset < self._end:
            raise ValueError(f"offset {offset} is outside the log [{self.min_offset}, {self._end})")
        seg = self._segment_of(offset)
        try:
            return read_frame(
                self.fs, self._read_fd(seg), seg.path, seg.base, offset - seg.base, seg.size
            )
        except BadFrame as bad:
            raise bad.corruption() from None

    def iter_from(self, offset: int, until: int | None = None) -> Iterator[Record]:
        """Records from ``offset`` (a record start) up to ``until`` or the current end.

        The end is re-read as the scan goes, so records appended meanwhile are seen.
        Raises CorruptionError on a damaged record.
        """
        self._check_open()
        if offset < self.min_offset:
            raise ValueError(f"offset {offset} is below the oldest record {self.min_offset}")
        while True:
            limit = self._end if until is None else min(until, self._end)
            if offset >= limit:
                return
            seg = self._segment_of(offset)
            try:
                stopped, sealed = yield from scan_frames(
                    self.fs,
                    self._read_fd(seg),
                    seg.path,
                    seg.base,
                    offset - seg.base,
                    min(limit - seg.base, seg.size),
                )
            except BadFrame as bad:
                raise bad.corruption() from None
            # Past an END_OF_SEGMENT marker the next record is in the next segment.
            next_offset = seg.base + seg.size if sealed else seg.base + stopped
            if next_offset <= offset:
                # An unsealed segment ends here, yet the log goes on: records are missing
                # (a segment deleted or emptied by hand). Report it; never spin.
                raise CorruptionError(
                    seg.path,
                    stopped,
                    0,
                    f"segment ends at offset {next_offset} without an end-of-segment marker "
                    f"but the log continues to {limit}",
                )
            offset = next_offset

    def _segment_of(self, offset: int) -> _Segment:
        index = self._bases.bisect_right(offset) - 1
        if index < 0:
            raise ValueError(f"offset {offset} is below the oldest segment")
        return self._segments[self._bases[index]]

    def _read_fd(self, seg: _Segment) -> int:
        return seg.write_fd if seg.write_fd is not None else self._reader_fd(seg)

    def _reader_fd(self, seg: _Segment) -> int:
        fd = self._readers.pop(seg.base, None)
        if fd is None:
            if len(self._readers) >= MAX_OPEN_READERS:
                oldest = next(iter(self._readers))
                self.fs.close(self._readers.pop(oldest))
            fd = self.fs.open(seg.path, O_READ)
        self._readers[seg.base] = fd  # re-insert: most recently used last
        return fd

    def _close_reader(self, base: int) -> None:
        fd = self._readers.pop(base, None)
        if fd is not None:
            self.fs.close(fd)

    # ------------------------------------------------------------------ retention, close

    def delete_before(self, offset: int) -> int:
        """Delete whole segments whose records all lie below ``offset``; returns how many.

        The segment being written is never deleted.
        """
        self._check_usable()
        doomed = []
        for index in range(len(self._bases) - 1):
            base, next_base = self._bases[index], self._bases[index + 1]
            if next_base > offset:
                break
            doomed.append(base)
        for base in doomed:
            seg = self._segments[base]
            with self._state_lock:
                del self._segments[base]
                self._bases.remove(base)
            self._close_reader(base)
            self.fs.unlink(seg.path)
        if doomed:
            self.fs.fsync_dir(self.directory)
        return len(doomed)

    @property
    def described(self) -> str:
        return f"log {self.directory}"

    def _flush_before_close(self) -> None:
        # Records below the recovery checkpoint are not scanned at open: after a clean
        # close, none are.
        self.flush()
        if self._durable > self._checkpointed:
            self._write_recovery_checkpoint(self._durable)

    def _release_files(self) -> None:
        for fd in self._retired_fds:
            self.fs.close(fd)
        for seg in self._segments.values():
            if seg.write_fd is not None:
                self.fs.close(seg.write_fd)
                seg.write_fd = None
        for base in list(self._readers):
            self._close_reader(base)
