"""ConsumeQueue: a dense array of fixed-width pointers into the commitlog, one per queue.

RocketMQ's ConsumeQueue (``store/ConsumeQueue.java``): the commitlog holds every message of
every queue; a consume queue holds, for one queue, where each of its messages sits in the
commitlog, so a consumer at logical index ``i`` reads entry ``i`` (one 20-byte pread) and
then the record. Entries are addressed by logical index 0, 1, 2, … and never move.

Layout (all integers little-endian; grammar and worked example in docs/storage-format.md)::

    directory := segment+                      files named f"{base_index:020d}"
    segment   := entry{0..entries_per_segment}
    entry     := commitlog_offset:u64 size:u32 tag_hash:u64

``size`` is the *frame* size of the record (framing header + payload), so that
``commitlog.read(commitlog_offset)`` finds the record and ``commitlog_offset + size`` is
where the next record may start. ``size`` is never 0: a zero-filled entry (what a power
loss can leave where an extending write did not reach the disk) is never valid.
``tag_hash`` is :func:`tag_hash` of the message tag, for filtering without reading the
record (RocketMQ stores ``tag.hashCode()`` there).

Entry ``i`` lives in the segment with the greatest ``base <= i``, at byte
``(i - base) * ENTRY_SIZE``. A segment other than the last holds exactly
``next_base - base`` entries, so changing ``entries_per_segment`` only affects new segments.

Durability and recovery
    Appends are pwrites (readers see them at once); ``flush()`` fsyncs them. Rolling to a
    new segment first fsyncs the full one (and its directory entry), so every segment but
    the last is durable and full. Opening therefore only scans the last segment — as
    RocketMQ's ``ConsumeQueue.recover`` scans its last files — and cuts it at the first
    entry that a crash can explain: a partial entry, a zero size, or a commitlog offset
    that does not lie past the previous entry (the front of an entry zeroed by a lost
    page). A short segment that is not the last cannot come from a crash and raises
    :class:`~storage.errors.CorruptionError`.

    The queue carries no checksum (the 20-byte layout is RocketMQ's), so an entry of the
    unsynced tail torn in its trailing bytes (its tag hash, say) can survive recovery —
    the crash simulator's ``torn`` mode produces exactly that. The commitlog is the truth,
    and the broker restores the exact queue on start:

    1. before saving its reput checkpoint, it flushes each queue and stores the
       end_index ``flush()`` returned next to the checkpoint offset;
    2. on start, after the commitlog recovered: ``truncate_to(stored end_index)`` (or,
       lacking it, ``truncate_beyond(commitlog.end_offset)``), then :func:`rebuild` from
       the checkpoint offset, which appends exactly the missing entries.

    Readers still verify that a record read through the queue belongs to it.

Threading
    Appends, reads, truncation and retention come from one thread (the event loop);
    ``flush()`` may run in a worker thread meanwhile.
"""

from __future__ import annotations

import functools
import operator
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, NamedTuple, Protocol

import xxhash

from storage.errors import (
    CorruptionError,
    DiskFullError,
    is_disk_full,
)
from storage.framing import HEADER_SIZE
from storage.fs import (
    O_READ,
    O_WRITE,
    REAL_FS,
    FileSystem,
    create_dirs_durably,
    dirs_up_to,
    disk_full_error,
)
from storage.store import Store

if TYPE_CHECKING:
    from storage.segmented_log import Record

ENTRY = struct.Struct("<QIQ")
ENTRY_SIZE = ENTRY.size  # 8 + 4 + 8: commitlog offset, size, tag hash
assert ENTRY_SIZE == 8 + 4 + 8

# 300_000 entries * 20 B = 6_000_000 B (~5.72 MiB) per segment, as RocketMQ's
# mappedFileSizeConsumeQueue.
DEFAULT_ENTRIES_PER_SEGMENT = 300_000
SEGMENT_NAME_DIGITS = 20
MAX_SIZE = (1 << 32) - 1  # size is a u32
MAX_OPEN_READERS = 4  # read fds kept for sealed segments (consumers read near the head)
SCAN_ENTRIES = 4096  # entries per pread when scanning backwards (4096 * 20 B = 80 KiB)
REBUILD_BATCH = 4096  # entries buffered per queue by rebuild() before one append_batch


class Entry(NamedTuple):
    commitlog_offset: int  # byte offset of the record in the commitlog
    size: int  # frame size of the record in bytes (header + payload), never 0
    tag_hash: int  # tag_hash(tag), u64


# tuple.__new__ straight from C: a third faster than Entry._make on the read path.
_make_entry = functools.partial(tuple.__new__, Entry)
_size_of = operator.itemgetter(1)


@dataclass
class QueueRecovery:
    """What opening the queue cut from its last segment (nothing on a clean open)."""

    cut_at_index: int | None = None  # first index dropped, or None
    cut_bytes: int = 0  # bytes removed from the end of the last segment


def tag_hash(tag: str | bytes) -> int:
    """The u64 stored in an entry for a message tag: xxh64 of its UTF-8 bytes, seed 0."""
    if isinstance(tag, str):
        tag = tag.encode()
    return xxhash.xxh64_intdigest(tag)


def segment_name(base_index: int) -> str:
    return f"{base_index:0{SEGMENT_NAME_DIGITS}d}"


def is_segment_name(name: str) -> bool:
    return len(name) == SEGMENT_NAME_DIGITS and name.isdigit()


class _Segment:
    __slots__ = ("base", "count", "path")

    def __init__(self, base: int, path: str, count: int) -> None:
        self.base = base  # index of the first entry
        self.path = path
        self.count = count  # whole entries in the file


class ConsumeQueue(Store):
    """One queue's index of commitlog positions; see the module docstring.

    Not constructed directly: use :meth:`open`.
    """

    def __init__(self, directory: str, fs: FileSystem, entries_per_segment: int) -> None:
        if entries_per_segment < 1:
            raise ValueError(f"entries_per_segment must be >= 1, got {entries_per_segment}")
        self.directory = directory
        self.fs = fs
        self.entries_per_segment = entries_per_segment
        self.recovery = QueueRecovery()
        self._segments: list[_Segment] = []  # ascending base; never empty once open
        self._bases: list[int] = []  # the same bases, for bisect
        self._write_fd = -1  # fd of the last segment
        self._readers: dict[int, int] = {}  # base -> fd of a sealed segment, LRU order
        self._covered_end = 0  # commitlog_offset + size of the last entry, 0 when empty
        self._dirty = False  # the last segment was written since the last flush
        self._dir_dirty = False  # a segment was created since the last directory fsync
        self._dirs_to_sync: list[str] = []  # created by open, made durable by flush
        self._flush_lock = threading.Lock()  # flush vs roll / truncate / close

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        directory: str,
        *,
        fs: FileSystem = REAL_FS,
        entries_per_segment: int = DEFAULT_ENTRIES_PER_SEGMENT,
        first_index: int = 0,
        durable_ancestor: str | None = None,
    ) -> ConsumeQueue:
        """Open (creating if missing) the queue in ``directory`` and recover its tail.

        ``first_index`` is the index of the first entry of a queue created now (a queue
        re-created after its commitlog was trimmed keeps its consumers' indexes); it is
        ignored when the directory already holds segments. Raises CorruptionError when a
        segment other than the last is short, which no crash can explain.

        The directory chain is made durable up to the root before this returns, unless
        ``durable_ancestor`` names a parent already durable (a store's own directory,
        made durable when the store opened): then only the directories from
        ``directory`` up to it are fsynced, and by the first :meth:`flush`, so a queue
        created while serving costs its caller a ``mkdir`` instead of a chain of fsyncs.
        """
        if first_index < 0:
            raise ValueError(f"first_index must be >= 0, got {first_index}")
        queue = cls(directory, fs, entries_per_segment)
        if durable_ancestor is None:
            create_dirs_durably(fs, directory)
        else:
            queue._dirs_to_sync = dirs_up_to(directory, durable_ancestor)
            fs.mkdir(directory)
        queue._recover(first_index)
        return queue

    def _recover(self, first_index: int) -> None:
        fs = self.fs
        names = sorted(n for n in fs.listdir(self.directory) if is_segment_name(n))
        if not names:
            path = os.path.join(self.directory, segment_name(first_index))
            self._segments.append(_Segment(first_index, path, 0))
            self._bases.append(first_index)
            self._write_fd = fs.open(path, O_WRITE)
            self._dir_dirty = True
            return
        sizes: list[int] = []
        for name in names:
            path = os.path.join(self.directory, name)
            fd = fs.open(path, O_READ)
            try:
                sizes.append(fs.fsize(fd))
            finally:
                fs.close(fd)
            self._segments.append(_Segment(int(name), path, 0))
            self._bases.append(int(name))
        for seg, next_seg, size in zip(self._segments, self._segments[1:], sizes, strict=False):
            expected = (next_seg.base - seg.base) * ENTRY_SIZE
            if size != expected:
                raise CorruptionError(
                    seg.path,
                    min(size, expected),
                    abs(expected - size),
                    f"segment holds {size} bytes but the next segment starts at index "
                    f"{next_seg.base}, which needs exactly {expected}",
                )
            seg.count = next_seg.base - seg.base
        last = self._segments[-1]
        self._write_fd = fs.open(last.path, O_WRITE)
        prev_end = 0
        if len(self._segments) > 1:
            prev_end = sum(self._read_tuple(last.base - 1)[:2])
        valid, self._covered_end = self._valid_prefix(sizes[-1], prev_end)
        last.count = valid
        if valid * ENTRY_SIZE < sizes[-1]:
            self.recovery = QueueRecovery(last.base + valid, sizes[-1] - valid * ENTRY_SIZE)
            # Make the cut durable before anything is appended over it: otherwise a later
            # power loss could bring back stale entries behind the new ones.
            fs.ftruncate(self._write_fd, valid * ENTRY_SIZE)
            fs.fsync(self._write_fd)

    def _valid_prefix(self, size: int, prev_end: int) -> tuple[int, int]:
        """(whole valid entries at the front of the last segment, commitlog end covered)."""
        data = self.fs.pread(self._write_fd, size - size % ENTRY_SIZE, 0)
        valid = 0
        for offset, entry_size, _ in ENTRY.iter_unpack(data):
            if entry_size == 0 or offset < prev_end:
                break
            prev_end = offset + entry_size
            valid += 1
        return valid, prev_end

    # ------------------------------------------------------------------ appending

    def append(self, commitlog_offset: int, size: int, tag_hash: int) -> int:
        """Append one entry; returns its index. Durable after the next flush().

        Raises ValueError when ``size`` is 0 or exceeds a u32, when a field is out of range,
        or when ``commitlog_offset`` lies before the end of the previous entry (entries
        follow commitlog order, which rebuild() and truncate_beyond() rely on).
        """
        self._check_usable()
        if not 0 < size <= MAX_SIZE or commitlog_offset < self._covered_end:
            raise self._bad_entry(commitlog_offset, size, self._covered_end)
        try:
            data = ENTRY.pack(commitlog_offset, size, tag_hash)
        except struct.error:
            raise ValueError(f"entry field out of range: {commitlog_offset=} {tag_hash=}") from None
        seg = self._segments[-1]
        if seg.count >= self.entries_per_segment:
            seg = self._roll()
        self._write(seg, data)
        self._covered_end = commitlog_offset + size
        return seg.base + seg.count - 1

    def append_batch(self, entries: Iterable[tuple[int, int, int]]) -> int:
        """Append ``(commitlog_offset, size, tag_hash)`` entries in order, with one pwrite
        per segment touched; returns the index of the first (end_index when empty).

        Validates every entry before writing any; raises ValueError as append() does,
        DiskFullError (nothing of the batch kept, the queue still usable) when the disk
        is full.
        """
        self._check_usable()
        first = self.end_index
        buf = bytearray()
        pack = ENTRY.pack
        covered = self._covered_end
        try:
            for commitlog_offset, size, tag in entries:
                if not 0 < size <= MAX_SIZE or commitlog_offset < covered:
                    raise self._bad_entry(commitlog_offset, size, covered)
                buf += pack(commitlog_offset, size, tag)
                covered = commitlog_offset + size
        except struct.error:
            raise ValueError("entry field out of range in batch") from None
        view = memoryview(buf)
        try:
            while view:
                seg = self._segments[-1]
                if seg.count >= self.entries_per_segment:
                    seg = self._roll()
                take = min(len(view), (self.entries_per_segment - seg.count) * ENTRY_SIZE)
                self._write(seg, view[:take])
                view = view[take:]
        except DiskFullError:
            self.truncate_to(first)  # all or nothing: the caller may append it again
            raise
        self._covered_end = covered
        return first

    def append_records(
        self, commitlog_offsets: Sequence[int], sizes: Sequence[int], tag_hash: int = 0
    ) -> int:
        """:meth:`append_batch` of ``(commitlog_offsets[i], sizes[i], tag_hash)`` for every
        ``i``: the same entries, without a tuple per entry. Returns the index of the first.
        Raises ValueError as append_batch does, and when the sequences differ in length.
        """
        if len(commitlog_offsets) != len(sizes):
            raise ValueError(f"{len(commitlog_offsets)} offsets but {len(sizes)} sizes")
        return self.append_batch(zip(commitlog_offsets, sizes, repeat(tag_hash)))

    @staticmethod
    def _bad_entry(commitlog_offset: int, size: int, covered: int) -> ValueError:
        if not 0 < size <= MAX_SIZE:
            return ValueError(f"entry size must be in 1..{MAX_SIZE}, got {size}")
        return ValueError(
            f"commitlog offset {commitlog_offset} lies before the end of the previous "
            f"entry ({covered}); entries must follow commitlog order"
        )

    def _write(self, seg: _Segment, data: bytes | memoryview) -> None:
        try:
            self.fs.pwrite(self._write_fd, data, seg.count * ENTRY_SIZE)
        except BaseException as exc:
            if is_disk_full(exc):
                # Cut what part of it the disk took; the queue stays usable.
                try:
                    self.fs.ftruncate(self._write_fd, seg.count * ENTRY_SIZE)
                except BaseException as cut:
                    self._failed = cut
                    raise
                raise disk_full_error(self.fs, seg.path, exc) from None
            # The file is in an unknown state: refuse further writes (reopen recovers).
            self._failed = exc
            raise
        seg.count += len(data) // ENTRY_SIZE
        self._dirty = True

    def _roll(self) -> _Segment:
        """Seal the full last segment durably and start the next one."""
        with self._flush_lock:
            fs = self.fs
            old = self._segments[-1]
            try:
                fs.fsync(self._write_fd)
                if self._dir_dirty:
                    # The sealed segment's name must be durable before a later one's:
                    # a gap in the bases would read as corruption.
                    fs.fsync_dir(self.directory)
                base = old.base + old.count
                path = os.path.join(self.directory, segment_name(base))
                fd = fs.open(path, O_WRITE)
            except BaseException as exc:
                self._failed = exc
                raise
            self._cache_reader(old.base, self._write_fd)
            self._write_fd = fd
            seg = _Segment(base, path, 0)
            self._segments.append(seg)
            self._bases.append(base)
            self._dirty = False
            self._dir_dirty = True
            return seg

    # ------------------------------------------------------------------ durability

    def flush(self) -> int:
        """Make every entry appended so far durable (fsync, and the directory when a
        segment was created); returns the end_index now durable. May run in a worker
        thread while appends go on. After a failed fsync the queue refuses further use
        (the kernel may have dropped the dirty pages); reopen it to recover."""
        with self._flush_lock:
            self._check_usable()
            # Clear the flags before syncing: an append racing with this flush sets them
            # again and is synced by the next flush.
            durable = self.end_index
            dirty, self._dirty = self._dirty, False
            dir_dirty, self._dir_dirty = self._dir_dirty, False
            dirs, self._dirs_to_sync = self._dirs_to_sync, []
            if dir_dirty and not dirs:
                dirs = [self.directory]
            try:
                if dirty:
                    self.fs.fsync(self._write_fd)
                for directory in dirs:  # the queue's own directory first
                    self.fs.fsync_dir(directory)
            except BaseException as exc:
                self._failed = exc
                raise
            return durable

    # ------------------------------------------------------------------ reading

    @property
    def min_index(self) -> int:
        """Index of the oldest entry still stored (== end_index when the queue is empty)."""
        return self._segments[0].base

    @property
    def end_index(self) -> int:
        """Index the next appended entry gets (one past the newest)."""
        last = self._segments[-1]
        return last.base + last.count

    @property
    def covered_commitlog_end(self) -> int:
        """Commitlog offset just past the newest entry's record; 0 when the queue is empty.
        Records below it are already in the queue (rebuild() skips them)."""
        return self._covered_end

    def get(self, index: int) -> Entry:
        """The entry at ``index``.

        Raises IndexError outside [min_index, end_index), CorruptionError when the stored
        bytes are missing or zero.
        """
        return Entry._make(self._read_tuple(index))

    def _read_tuple(self, index: int) -> tuple[int, int, int]:
        self._check_open()
        if not self.min_index <= index < self.end_index:
            raise IndexError(
                f"index {index} is outside the queue [{self.min_index}, {self.end_index})"
            )
        seg = self._segments[self._segment_pos(index)]
        position = (index - seg.base) * ENTRY_SIZE
        data = self.fs.pread(self._fd(seg), ENTRY_SIZE, position)
        if len(data) < ENTRY_SIZE:
            raise CorruptionError(seg.path, position, ENTRY_SIZE, "entry missing: file too short")
        entry = ENTRY.unpack(data)
        if entry[1] == 0:
            raise CorruptionError(seg.path, position, ENTRY_SIZE, "entry has size 0")
        return entry

    def read_range(self, start_index: int, max_entries: int) -> list[Entry]:
        """Up to ``max_entries`` entries from ``start_index`` on, with one pread per
        segment; ``[]`` at end_index.

        Raises IndexError when ``start_index`` is outside [min_index, end_index] (below
        min_index means retention deleted it: the consumer must skip ahead),
        CorruptionError when stored bytes are missing or zero.
        """
        self._check_open()
        if not self.min_index <= start_index <= self.end_index:
            raise IndexError(
                f"start index {start_index} is outside the queue "
                f"[{self.min_index}, {self.end_index}]"
            )
        out: list[Entry] = []
        index = start_index
        stop = min(self.end_index, start_index + max(0, max_entries))
        pos = self._segment_pos(index) if index < stop else 0
        while index < stop:
            seg = self._segments[pos]
            count = min(stop, seg.base + seg.count) - index
            position = (index - seg.base) * ENTRY_SIZE
            data = self.fs.pread(self._fd(seg), count * ENTRY_SIZE, position)
            if len(data) < count * ENTRY_SIZE:
                raise CorruptionError(
                    seg.path, position + len(data), count * ENTRY_SIZE - len(data), "file too short"
                )
            entries = list(map(_make_entry, ENTRY.iter_unpack(data)))
            if 0 in map(_size_of, entries):
                bad = next(i for i, e in enumerate(entries) if not e.size)
                raise CorruptionError(
                    seg.path, position + bad * ENTRY_SIZE, ENTRY_SIZE, "entry has size 0"
                )
            out += entries
            index += count
            pos += 1
        return out

    def _segment_pos(self, index: int) -> int:
        # Bisect by hand over a plain list: faster than the bisect module's key= form and
        # there are few segments.
        lo, hi = 0, len(self._bases)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._bases[mid] <= index:
                lo = mid + 1
            else:
                hi = mid
        return lo - 1

    def _fd(self, seg: _Segment) -> int:
        if seg is self._segments[-1]:
            return self._write_fd
        fd = self._readers.pop(seg.base, None)
        if fd is None:
            fd = self.fs.open(seg.path, O_READ)
        self._cache_reader(seg.base, fd)
        return fd

    def _cache_reader(self, base: int, fd: int) -> None:
        if len(self._readers) >= MAX_OPEN_READERS:
            oldest = next(iter(self._readers))
            self.fs.close(self._readers.pop(oldest))
        self._readers[base] = fd  # most recently used last

    def _close_reader(self, base: int) -> None:
        fd = self._readers.pop(base, None)
        if fd is not None:
            self.fs.close(fd)

    # ------------------------------------------------------------------ truncation, retention

    def truncate_to(self, index: int) -> int:
        """Drop every entry at or after ``index`` (clamped to [min_index, end_index]);
        returns how many were dropped. Durable when it returns.

        Later whole segments are unlinked and the directory fsynced *before* the segment
        holding ``index`` is shortened, so a crash in between leaves a prefix, never a gap.
        """
        self._check_usable()
        index = max(self.min_index, min(index, self.end_index))
        dropped = self.end_index - index
        if not dropped:
            return 0
        fs = self.fs
        with self._flush_lock:
            try:
                doomed = [s for s in self._segments[1:] if s.base >= index]
                if doomed:
                    fs.close(self._write_fd)
                    for seg in reversed(doomed):
                        self._close_reader(seg.base)
                        fs.unlink(seg.path)
                    del self._segments[-len(doomed) :]
                    del self._bases[-len(doomed) :]
                    fs.fsync_dir(self.directory)
                    last = self._segments[-1]
                    self._close_reader(last.base)
                    self._write_fd = fs.open(last.path, O_WRITE)
                last = self._segments[-1]
                if last.base + last.count > index:
                    last.count = index - last.base
                    fs.ftruncate(self._write_fd, last.count * ENTRY_SIZE)
                    fs.fsync(self._write_fd)
            except BaseException as exc:
                self._failed = exc
                raise
        self._covered_end = sum(self._read_tuple(index - 1)[:2]) if index > self.min_index else 0
        return dropped

    def truncate_beyond(self, commitlog_end: int) -> int:
        """Drop the trailing entries whose record does not end within the commitlog
        (``commitlog_offset + size > commitlog_end``); returns how many were dropped.

        The broker calls this at start, after the commitlog cut its torn tail, so that the
        queue is never ahead of the commitlog.
        """
        self._check_usable()
        index = self.end_index
        while index > self.min_index:
            pos = self._segment_pos(index - 1)
            seg = self._segments[pos]
            low = max(seg.base, index - SCAN_ENTRIES)
            data = self.fs.pread(
                self._fd(seg), (index - low) * ENTRY_SIZE, (low - seg.base) * ENTRY_SIZE
            )
            entries = list(ENTRY.iter_unpack(data))
            for j in range(len(entries) - 1, -1, -1):
                offset, size, _ = entries[j]
                if offset + size <= commitlog_end:
                    return self.truncate_to(low + j + 1)
            index = low
        return self.truncate_to(self.min_index)

    def delete_before(self, index: int) -> int:
        """Retention: unlink whole segments whose entries all lie below ``index``; returns
        how many. The last segment is never deleted (it remembers end_index), so the
        queue may keep entries below ``index``; min_index tells what is left."""
        self._check_usable()
        doomed = 0
        for seg in self._segments[:-1]:
            if seg.base + seg.count > index:
                break
            doomed += 1
        if not doomed:
            return 0
        with self._flush_lock:
            for seg in self._segments[:doomed]:
                self._close_reader(seg.base)
                self.fs.unlink(seg.path)
            del self._segments[:doomed]
            del self._bases[:doomed]
            self.fs.fsync_dir(self.directory)
        return doomed

    # ------------------------------------------------------------------ closing

    @property
    def described(self) -> str:
        return f"consume queue {self.directory}"

    def _release_files(self) -> None:
        self.fs.close(self._write_fd)
        for base in list(self._readers):
            self._close_reader(base)


class _CommitLog(Protocol):
    def iter_from(self, offset: int) -> Iterator[Record]: ...


Route = tuple[ConsumeQueue, int]


def rebuild(
    queue_for: Callable[[Record], Route | None], commitlog: _CommitLog, from_offset: int
) -> int:
    """Re-create consume queue entries from the commitlog; returns how many were written.

    "As long as the commitlog survives, the consumequeue can be rebuilt" (RocketMQ's
    ReputMessageService does this continuously). Scans ``commitlog.iter_from(from_offset)``
    (``from_offset`` must be a record start); ``queue_for(record)`` returns ``None`` for a
    record that belongs to no queue, else ``(queue, tag_hash)``. Each routed record becomes
    the entry ``(record.offset, HEADER_SIZE + len(record.payload), tag_hash)``: the frame
    size, so ``commitlog.read(commitlog_offset)`` works and entries tile the commitlog.

    Idempotent: a record below its queue's ``covered_commitlog_end`` is already there and
    is skipped (as RocketMQ's putMessagePositionInfo skips ``offset + size <=
    maxPhysicOffset``), so the broker may rebuild from any checkpoint at or before the
    queues' ends — a lost queue (re-created empty) is refilled from ``from_offset``, one
    that is behind only gets its missing tail. Every queue written is flushed before this
    returns. Raises what the commitlog and the queues raise (CorruptionError, StorageError).
    """
    pending: dict[int, tuple[ConsumeQueue, list[tuple[int, int, int]]]] = {}
    written = 0
    for record in commitlog.iter_from(from_offset):
        route = queue_for(record)
        if route is None:
            continue
        queue, tag = route
        slot = pending.get(id(queue))
        if slot is None:
            # Records arrive in commitlog order, so once one record of a queue is past its
            # covered end, every later one is too: only the first needs the check.
            if record.offset < queue.covered_commitlog_end:
                continue
            slot = pending[id(queue)] = (queue, [])
        batch = slot[1]
        batch.append((record.offset, HEADER_SIZE + len(record.payload), tag))
        if len(batch) >= REBUILD_BATCH:
            queue.append_batch(batch)
            written += len(batch)
            batch.clear()
    for queue, batch in pending.values():
        if batch:
            queue.append_batch(batch)
            written += len(batch)
        queue.flush()
    return written
