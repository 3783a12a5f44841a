"""IndexFile: one file of an on-disk hash index from a key to commitlog offsets.

RocketMQ's IndexFile (``store/index/IndexFile.java``, ``IndexService.java``): a hash table
laid out in a file — a header, a slot table, then entries appended in put order, each
linking to the previous entry of its slot, so a slot is the head of a chain newest first.
The broker indexes message ids and business keys with it; a lookup walks the chain and
returns commitlog offsets.

Layout (all integers little-endian; grammar and worked example in docs/storage-format.md)::

    file    := header_copy[2] slot[slot_count] entry[entry_count]
    slot    := u32          1-based number of the newest entry of the slot, 0 = empty
    entry   := key_hash:u32 commitlog_offset:u64 time_delta_ms:u32 prev:u32

Entry number ``n`` (1-based) is at byte ``HEADER_REGION_SIZE + 4 * slot_count + 20 * (n -
1)``. ``key_hash`` is the low 32 bits of ``hash_fn(key)`` (xxh64 by default) and the slot
is ``key_hash % slot_count``: the slot table can be rebuilt from the entries alone.
``prev`` is the number of the entry the slot pointed to before this one (0 ends the chain),
so ``prev < n`` always. ``time_delta_ms`` is the put's timestamp minus the file's begin
timestamp, clamped at 0.

Differences from RocketMQ, and why
    * Lookups never trust the hash: the caller's ``key_matches(offset, key)`` reads the
      record and compares, so a collision (forced in the tests) never returns a wrong
      message. RocketMQ compares the 32-bit hash only and leaves the rest to the client.
    * Writes are pwrites, batched: the slot table lives in memory, new entries in a buffer
      (lookups see both); ``flush()`` writes the buffered entries with one pwrite and,
      every SLOT_WRITE_ENTRIES puts (and when sealing, truncating, closing), the dirty
      slots in runs; it fsyncs, then commits a header and fsyncs again.
    * The header exists twice, written alternately (LMDB's meta pages): a torn header write
      leaves the previous copy. Each copy carries its crc32c, a sequence number, the entry
      count, the crc32c of the slot table it commits and how many entries that table
      reflects.
    * Time deltas are milliseconds (RocketMQ: seconds); a put whose delta would overflow the
      u32 (~49.7 days after the file began) rolls to a new file like a full one.

Recovery
    The committed header names how many entries and which slot table are durable. On
    opening the newest file, entries past the committed count are cut (a flush that did
    not finish) and the entries the slot table does not reflect yet are replayed into
    it. When the slot table's crc32c disagrees with the header (slot writes of an
    unfinished flush), the file is shorter than the committed count (torn) or that tail
    does not link up, the slot table is rebuilt by replaying every entry, each of whose
    ``prev`` must equal the slot value the replay has reached; the first that does not
    ends the file. Older files were sealed by a complete flush (slots included) before
    the next file was created, so they get only the length check. The index is derived
    data: the broker flushes it before it saves its reput checkpoint and re-puts from
    that checkpoint on start, which refills a cut tail (lookups deduplicate the offsets
    put twice). When recovery had to drop *committed*
    entries (damage, not a crash), ``IndexStore.reindex_from`` tells the broker from which
    commitlog offset to re-put.

Threading
    Puts, lookups, truncation and retention come from one thread (the event loop);
    ``flush()`` may run in a worker thread meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import struct
import sys
import threading
from array import array
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from typing import NamedTuple

import xxhash

from storage.errors import (
    CorruptionError,
    DiskFullError,
    StorageError,
    is_disk_full,
)
from storage.framing import crc32c
from storage.fs import O_WRITE, REAL_FS, FileSystem, disk_full_error
from storage.store import Store

MAGIC = b"DIDX"
VERSION = 2
HEADER = struct.Struct("<4sIQQQQQIIIII")
# 4 + 4 + 8 + 8 + 8 + 8 + 8 + 4 + 4 + 4 + 4 + 4 = 68: magic, version, seq, begin offset,
# end offset, begin timestamp ms, end timestamp ms, slot count, max entries, entry count,
# crc32c of the slot table, the entry count that slot table reflects
assert HEADER.size == 68
HEADER_V1 = struct.Struct("<4sIQQQQQIIII")  # version 1: the same without the last field
HEADER_CRC = struct.Struct("<I")  # crc32c of the header bytes, right after them
HEADER_COPY_SIZE = 128  # 68 + 4 = 72 bytes used, the rest zero (room to grow)
HEADER_REGION_SIZE = 2 * HEADER_COPY_SIZE  # copy seq % 2 is the one a flush writes
SLOT = struct.Struct("<I")
SLOT_SIZE = SLOT.size  # 4: entry number u32
ENTRY = struct.Struct("<IQII")
ENTRY_SIZE = ENTRY.size  # 4 + 8 + 4 + 4: key hash, commitlog offset, time delta ms, prev
assert ENTRY_SIZE == 4 + 8 + 4 + 4

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
DEFAULT_SLOT_COUNT = 1_000_003  # a prime; 1_000_003 * 4 B = ~3.8 MiB of slots
DEFAULT_MAX_ENTRIES = 4_000_000  # 4_000_000 * 20 B = 80 MB of entries per file
MAX_TIME_DELTA_MS = U32_MAX  # 2**32 - 1 ms ~ 49.7 days
SLOT_PAGE_BITS = 10  # dirty slots are tracked per page of 2**10 slots (4 KiB of slots)
# A flush writes the dirty slots only once this many entries were put since the slots
# were last written (and always when sealing, truncating or closing): a few thousand
# random puts dirty most pages of a 4 MB table, so writing them every flush rewrote
# the table each second. Recovery replays at most this many entries into the slots.
SLOT_WRITE_ENTRIES = 65_536
REPLAY_CHUNK = 65536  # entries per pread when replaying (65536 * 20 B = 1.25 MiB)
TEMP_SUFFIX = ".tmp"
_BIG_ENDIAN = sys.byteorder == "big"
assert array("I").itemsize == SLOT_SIZE

HashFn = Callable[[bytes], int]


def default_hash(key: bytes) -> int:
    """xxh64 of the key, seed 0; an IndexFile keeps its low 32 bits."""
    return xxhash.xxh64_intdigest(key)


def key_bytes(key: bytes | str) -> bytes:
    if type(key) is bytes:  # the common case: no copy
        return key
    return key.encode() if isinstance(key, str) else bytes(key)


class _Header(NamedTuple):
    seq: int
    begin_offset: int
    end_offset: int
    begin_timestamp_ms: int
    end_timestamp_ms: int
    slot_count: int
    max_entries: int
    entry_count: int
    slot_crc: int
    slot_entry_count: int  # entries 1..this are in the slot table slot_crc commits


def _encode_header(h: _Header) -> bytes:
    body = HEADER.pack(MAGIC, VERSION, *h)
    return body + HEADER_CRC.pack(crc32c(body))


def _decode_header(raw: bytes) -> _Header | None:
    """The header in one copy, or None when it is torn, zero or not ours. A version 1
    header (slots written by every flush) reads as slots reflecting every entry."""
    if len(raw) < HEADER.size + HEADER_CRC.size or raw[:4] != MAGIC:
        return None
    (version,) = struct.unpack_from("<I", raw, 4)
    layout = {1: HEADER_V1, VERSION: HEADER}.get(version)
    if layout is None:
        return None
    body = raw[: layout.size]
    (crc,) = HEADER_CRC.unpack_from(raw, layout.size)
    if crc32c(body) != crc:
        return None
    fields = layout.unpack(body)[2:]
    if version == 1:
        fields = (*fields, fields[-2])  # slot_entry_count = entry_count
    return _Header(*fields)


def _slot_bytes(slots: array) -> bytes | memoryview:
    """The slot table as stored (little-endian u32s)."""
    if _BIG_ENDIAN:
        copy = array("I", slots)
        copy.byteswap()
        return copy.tobytes()
    return memoryview(slots)


def _slots_from_bytes(data: bytes) -> array:
    slots = array("I")
    slots.frombytes(data)
    if _BIG_ENDIAN:
        slots.byteswap()
    return slots


class IndexFile(Store):
    """One index file; see the module docstring. Made by :meth:`create` or :meth:`open`.

    The newest file of a store is *active*: its slot table is in memory and it takes puts.
    Older files are sealed: lookups read their slots with a pread.
    """

    def __init__(self, path: str, fs: FileSystem, fd: int, header: _Header, hash_fn: HashFn):
        self.path = path
        self.fs = fs
        self.name_offset = int(os.path.basename(path))
        self.slot_count = header.slot_count
        self.max_entries = header.max_entries
        self.begin_offset = header.begin_offset  # lowest commitlog offset put
        self.end_offset = header.end_offset  # highest commitlog offset put (an upper bound)
        self.begin_timestamp_ms = header.begin_timestamp_ms
        self.end_timestamp_ms = header.end_timestamp_ms
        self.lost_committed = False  # recovery dropped entries a flush had committed
        self._committed_begin = header.begin_offset
        self._hash = hash_fn
        self._fd = fd
        self._seq = header.seq
        self._slot_crc = header.slot_crc  # of the slot table last committed
        self._slot_entries = header.slot_entry_count  # entries that table reflects
        self._entries_start = HEADER_REGION_SIZE + self.slot_count * SLOT_SIZE
        self._count = header.entry_count  # entries put, flushed or not
        self._flushed = header.entry_count  # entries on disk and committed by the header
        self._pending = bytearray()  # packed entries _flushed + 1 .. _count
        self._slots: array | None = None  # in memory while active
        # One byte per page of slots, 1 = a slot of the page changed since the last flush
        # (a set of slot numbers cost a hash insert per put and a sort per flush).
        self._dirty_pages = bytearray((self.slot_count >> SLOT_PAGE_BITS) + 1)
        self._header_dirty = False
        self._lock = threading.Lock()  # state, vs a flush in a worker thread
        self._flush_lock = threading.Lock()  # one flush at a time

    # ------------------------------------------------------------------ creating, opening

    @classmethod
    def create(
        cls,
        path: str,
        *,
        fs: FileSystem = REAL_FS,
        slot_count: int = DEFAULT_SLOT_COUNT,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        hash_fn: HashFn = default_hash,
    ) -> IndexFile:
        """Create an empty, active index file at ``path`` (its name is a 20-digit commitlog
        offset). The file appears whole or not at all: it is written under a temporary
        name, fsynced, renamed and the directory fsynced. Raises ValueError for sizes
        outside 1..2**32-1 (max_entries: 1..2**32-2, entry numbers are u32 and 0 is none).
        """
        if not 1 <= slot_count <= U32_MAX:
            raise ValueError(f"slot_count must be in 1..{U32_MAX}, got {slot_count}")
        if not 1 <= max_entries < U32_MAX:
            raise ValueError(f"max_entries must be in 1..{U32_MAX - 1}, got {max_entries}")
        slots = array("I", bytes(slot_count * SLOT_SIZE))
        header = _Header(1, 0, 0, 0, 0, slot_count, max_entries, 0, crc32c(_slot_bytes(slots)), 0)
        temp = path + TEMP_SUFFIX
        fd = fs.open(temp, O_WRITE)
        try:
            fs.ftruncate(fd, 0)  # a leftover of a crashed creation is garbage
            fs.ftruncate(fd, HEADER_REGION_SIZE + slot_count * SLOT_SIZE)  # zero slots
            fs.pwrite(fd, _encode_header(header), (header.seq % 2) * HEADER_COPY_SIZE)
            fs.fsync(fd)
            fs.replace(temp, path)
            fs.fsync_dir(os.path.dirname(path) or ".")
        except BaseException:
            fs.close(fd)
            raise
        index = cls(path, fs, fd, header, hash_fn)
        index._slots = slots
        return index

    @classmethod
    def open(
        cls,
        path: str,
        *,
        fs: FileSystem = REAL_FS,
        hash_fn: HashFn = default_hash,
        active: bool = True,
    ) -> IndexFile:
        """Open an index file and recover it (see the module docstring): an active file's
        slot table is verified and loaded, a sealed file gets the length check only.

        Raises CorruptionError when neither header copy is valid: the file was created
        whole, so that is damage.
        """
        fd = fs.open(path, O_WRITE)
        try:
            size = fs.fsize(fd)
            raw = fs.pread(fd, HEADER_REGION_SIZE, 0)
            copies = [_decode_header(raw[i : i + HEADER_COPY_SIZE]) for i in (0, HEADER_COPY_SIZE)]
            valid = [h for h in copies if h is not None]
            if not valid:
                raise CorruptionError(
                    path, 0, HEADER_REGION_SIZE, "neither index header copy is valid"
                )
            index = cls(path, fs, fd, max(valid, key=lambda h: h.seq), hash_fn)
            index._recover(size, active)
        except BaseException:
            fs.close(fd)
            raise
        return index

    def _recover(self, size: int, load_slots: bool) -> None:
        committed = self._count
        physical = max(0, (size - self._entries_start) // ENTRY_SIZE)
        count = min(committed, physical)
        replay = physical < committed
        clean_length = size == self._entries_start + count * ENTRY_SIZE
        if load_slots or replay or not clean_length:
            data = self.fs.pread(self._fd, self.slot_count * SLOT_SIZE, HEADER_REGION_SIZE)
            data += bytes(self.slot_count * SLOT_SIZE - len(data))  # a file cut in the slots
            slots = _slots_from_bytes(data)
            if not replay and crc32c(_slot_bytes(slots)) != self._slot_crc:
                replay = True
            # Slots written by an earlier flush than the last: put the later entries in.
            if not replay and not self._replay_tail(slots, count):
                replay = True
            if replay:
                slots, count = self._replay(count)
            self._slots = slots
        if replay or not clean_length:
            self._count = self._flushed = count
            self.fs.ftruncate(self._fd, self._entries_start + count * ENTRY_SIZE)
            if replay:
                self.fs.pwrite(self._fd, _slot_bytes(self._slots), HEADER_REGION_SIZE)
                self._dirty_pages[:] = bytes(len(self._dirty_pages))
            self.fs.fsync(self._fd)
            if replay:
                self._commit_header(self._header(crc32c(_slot_bytes(self._slots)), count))
        self.lost_committed = count < committed
        if not load_slots:
            self._slots = None

    def _replay_tail(self, slots: array, count: int) -> bool:
        """Put entries after the header's slot_entry_count, up to ``count``, into
        ``slots`` (the table that header committed), marking their pages dirty. False at
        the first entry whose ``prev`` is not the slot value reached: damage, for which
        the caller rebuilds the table from every entry."""
        sc = self.slot_count
        dirty = self._dirty_pages
        number = self._slot_entries
        for first in range(number, count, REPLAY_CHUNK):
            n = min(REPLAY_CHUNK, count - first)
            data = self.fs.pread(self._fd, n * ENTRY_SIZE, self._entries_start + first * ENTRY_SIZE)
            for key_hash, _offset, _delta, prev in ENTRY.iter_unpack(data):
                slot = key_hash % sc
                if prev != slots[slot]:
                    return False
                number += 1
                slots[slot] = number
                dirty[slot >> SLOT_PAGE_BITS] = 1
        return number >= count

    def _replay(self, count: int) -> tuple[array, int]:
        """Rebuild the slot table from entries 1..count; returns it and how many entries
        form a consistent prefix. Recomputes the offsets and end timestamp."""
        slots = array("I", bytes(self.slot_count * SLOT_SIZE))
        sc = self.slot_count
        valid = 0
        low, high, max_delta = U64_MAX, 0, 0
        for first in range(0, count, REPLAY_CHUNK):
            n = min(REPLAY_CHUNK, count - first)
            data = self.fs.pread(self._fd, n * ENTRY_SIZE, self._entries_start + first * ENTRY_SIZE)
            for key_hash, offset, delta, prev in ENTRY.iter_unpack(data):
                slot = key_hash % sc
                if prev != slots[slot]:
                    return self._replayed(slots, valid, low, high, max_delta)
                valid += 1
                slots[slot] = valid
                low, high, max_delta = min(low, offset), max(high, offset), max(max_delta, delta)
        return self._replayed(slots, valid, low, high, max_delta)

    def _replayed(
        self, slots: array, valid: int, low: int, high: int, max_delta: int
    ) -> tuple[array, int]:
        if valid:
            self.begin_offset, self.end_offset = low, high
            self.end_timestamp_ms = self.begin_timestamp_ms + max_delta
        else:
            self._reset_range()
        return slots, valid

    def _reset_range(self) -> None:
        self.begin_offset = self.end_offset = 0
        self.begin_timestamp_ms = self.end_timestamp_ms = 0

    # ------------------------------------------------------------------ state

    @property
    def entry_count(self) -> int:
        """Entries put, flushed or not."""
        return self._count

    @property
    def is_active(self) -> bool:
        return self._slots is not None

    @property
    def committed_begin_offset(self) -> int:
        """begin_offset as the header committed it when the file was opened."""
        return self._committed_begin

    def activate(self) -> None:
        """Load (and verify) the slot table so the file can take puts again."""
        if self._slots is None:
            self._recover(self.fs.fsize(self._fd), load_slots=True)

    def seal(self) -> None:
        """Flush with the slots, then drop the in-memory slot table (lookups pread slots
        from now on)."""
        self.flush(with_slots=True)
        self._slots = None

    def _header(self, slot_crc: int, slot_entries: int) -> _Header:
        return _Header(
            self._seq,
            self.begin_offset,
            self.end_offset,
            self.begin_timestamp_ms,
            self.end_timestamp_ms,
            self.slot_count,
            self.max_entries,
            self._count,
            slot_crc,
            slot_entries,
        )

    def _commit_header(self, header: _Header) -> None:
        """Write ``header`` as the next sequence number into the other copy, then fsync."""
        seq = self._seq + 1
        header = header._replace(seq=seq)
        self.fs.pwrite(self._fd, _encode_header(header), (seq % 2) * HEADER_COPY_SIZE)
        self.fs.fsync(self._fd)
        self._seq = seq
        self._slot_crc = header.slot_crc
        self._slot_entries = header.slot_entry_count

    # ------------------------------------------------------------------ put, lookup

    def put(self, key: bytes, commitlog_offset: int, timestamp_ms: int) -> bool:
        """Index ``key`` -> ``commitlog_offset``; False (and nothing done) when the file is
        full or ``timestamp_ms`` is more than MAX_TIME_DELTA_MS past its begin timestamp,
        the caller then rolls to a new file. Raises StorageError on a sealed file,
        ValueError for an offset outside a u64."""
        self._check_usable()
        if not 0 <= commitlog_offset <= U64_MAX:
            raise ValueError(f"commitlog offset {commitlog_offset} is outside a u64")
        key_hash = self._hash(key) & U32_MAX
        slot = key_hash % self.slot_count
        with self._lock:
            slots = self._slots
            if slots is None:
                raise StorageError(f"index file {self.path} is sealed")
            count = self._count
            if count >= self.max_entries:
                return False
            if count == 0:
                self.begin_offset = self.end_offset = commitlog_offset
                self.begin_timestamp_ms = self.end_timestamp_ms = timestamp_ms
            delta = timestamp_ms - self.begin_timestamp_ms
            if delta > MAX_TIME_DELTA_MS:
                return False
            self._pending += ENTRY.pack(key_hash, commitlog_offset, max(0, delta), slots[slot])
            self._count = count + 1
            slots[slot] = count + 1
            self._dirty_pages[slot >> SLOT_PAGE_BITS] = 1
            if commitlog_offset < self.begin_offset:
                self.begin_offset = commitlog_offset
            if commitlog_offset > self.end_offset:
                self.end_offset = commitlog_offset
            if timestamp_ms > self.end_timestamp_ms:
                self.end_timestamp_ms = timestamp_ms
        return True

    def put_batch(
        self, keys: Sequence[bytes], offsets: Sequence[int], timestamps_ms: int | Sequence[int]
    ) -> int:
        """:meth:`put` of ``keys[i] -> offsets[i]`` for every ``i``, in order: the same
        entries, with one lock and one loop for the batch. ``timestamps_ms`` is one
        timestamp for every key, or one per key.

        Returns how many were put: all, or the first ones when the file filled up or a
        timestamp is more than MAX_TIME_DELTA_MS past the file's begin timestamp (0 when
        the first is); the caller rolls to a new file for the rest. Raises as ``put``
        does (nothing put), and ValueError when the sequences differ in length.
        """
        self._check_usable()
        n = len(keys)
        per_key = not isinstance(timestamps_ms, int)
        if len(offsets) != n or (per_key and len(timestamps_ms) != n):  # type: ignore[arg-type]
            raise ValueError(f"{n} keys, {len(offsets)} offsets: one each, and timestamps")
        if not n:
            return 0
        low, high = min(offsets), max(offsets)
        if low < 0 or high > U64_MAX:
            raise ValueError(f"commitlog offset {low if low < 0 else high} is outside a u64")
        hashes = list(map(self._hash, keys))
        slot_count = self.slot_count
        with self._lock:
            slots = self._slots
            if slots is None:
                raise StorageError(f"index file {self.path} is sealed")
            count = self._count
            n = min(n, self.max_entries - count)
            if n <= 0:
                return 0
            first_ms = timestamps_ms[0] if per_key else timestamps_ms  # type: ignore[index]
            if count == 0:
                self.begin_offset = self.end_offset = offsets[0]
                self.begin_timestamp_ms = self.end_timestamp_ms = first_ms
            begin_ms = self.begin_timestamp_ms
            if per_key:
                stamps = timestamps_ms[:n]  # type: ignore[index]
                deltas = [stamp - begin_ms for stamp in stamps]
                if max(deltas) > MAX_TIME_DELTA_MS:  # stop before the first that overflows
                    n = next(i for i, d in enumerate(deltas) if d > MAX_TIME_DELTA_MS)
                    if not n:
                        return 0
                    stamps, deltas = stamps[:n], deltas[:n]
                deltas = [d if d > 0 else 0 for d in deltas]
                last_ms = max(stamps)
            else:
                delta = first_ms - begin_ms
                if delta > MAX_TIME_DELTA_MS:
                    return 0
                deltas = repeat(max(0, delta))  # type: ignore[assignment]
                last_ms = first_ms
            if n < len(offsets):
                offsets = offsets[:n]
                low, high = min(offsets), max(offsets)
            pending = self._pending
            position = len(pending)
            pending += bytes(n * ENTRY_SIZE)
            pack_into, dirty = ENTRY.pack_into, self._dirty_pages
            for key_hash, offset, delta in zip(hashes, offsets, deltas):  # noqa: B905  # cut to n
                key_hash &= U32_MAX
                slot = key_hash % slot_count
                pack_into(pending, position, key_hash, offset, delta, slots[slot])
                position += ENTRY_SIZE
                count += 1
                slots[slot] = count
                dirty[slot >> SLOT_PAGE_BITS] = 1
            self._count = count
            if low < self.begin_offset:
                self.begin_offset = low
            if high > self.end_offset:
                self.end_offset = high
            if last_ms > self.end_timestamp_ms:
                self.end_timestamp_ms = last_ms
        return n

    def candidates(self, key: bytes) -> Iterator[int]:
        """Commitlog offsets whose entry has ``key``'s 32-bit hash, newest first. These are
        candidates only: the caller must verify each against the record.

        Raises CorruptionError for a chain that points forward or past the entries."""
        self._check_open()
        key_hash = self._hash(key) & U32_MAX
        slot = key_hash % self.slot_count
        slots = self._slots
        if slots is not None:
            number = slots[slot]
        else:
            raw = self.fs.pread(self._fd, SLOT_SIZE, HEADER_REGION_SIZE + slot * SLOT_SIZE)
            number = SLOT.unpack(raw)[0] if len(raw) == SLOT_SIZE else 0
        while number:
            entry_hash, offset, _, prev = self._entry(number)
            if prev >= number:
                raise CorruptionError(
                    self.path,
                    self._entries_start + (number - 1) * ENTRY_SIZE,
                    ENTRY_SIZE,
                    f"index entry {number} links forward to entry {prev}",
                )
            if entry_hash == key_hash:
                yield offset
            number = prev

    def hash_source(self) -> HashSource:
        """What ``read_key_hashes`` needs to list this file's entries' key hashes as
        they are now: the flushed ones from the file, the rest copied from memory."""
        self._check_open()
        with self._lock:
            return HashSource(
                self.path,
                self.fs,
                self._fd,
                self._entries_start,
                self._flushed,
                bytes(self._pending),
            )

    def _entry(self, number: int) -> tuple[int, int, int, int]:
        with self._lock:
            if number > self._count:
                raise CorruptionError(
                    self.path, 0, 0, f"slot chain names entry {number} of {self._count}"
                )
            if number > self._flushed:
                return ENTRY.unpack_from(self._pending, (number - self._flushed - 1) * ENTRY_SIZE)
        position = self._entries_start + (number - 1) * ENTRY_SIZE
        data = self.fs.pread(self._fd, ENTRY_SIZE, position)
        if len(data) < ENTRY_SIZE:
            raise CorruptionError(self.path, position, ENTRY_SIZE, "index entry past EOF")
        return ENTRY.unpack(data)

    # ------------------------------------------------------------------ durability

    def flush(self, *, with_slots: bool = False) -> None:
        """Make every put so far durable: entries (one pwrite) and, every
        SLOT_WRITE_ENTRIES puts or when ``with_slots``, the dirty slot runs; fsync, then
        the header committing them, fsync. May run in a worker thread while puts and
        lookups go on. After a failed write or fsync the file refuses further use."""
        with self._flush_lock:
            self._check_usable()
            self._flush_locked(with_slots=with_slots)

    def _flush_locked(self, *, with_slots: bool = False) -> None:
        slots = self._slots
        with self._lock:
            dirty = self._dirty_pages
            write_slots = (
                slots is not None
                and (with_slots or self._count - self._slot_entries >= SLOT_WRITE_ENTRIES)
                and (dirty.find(1) >= 0 or self._slot_entries != self._count)
            )
            if not self._pending and not self._header_dirty and not write_slots:
                return
            data = bytes(self._pending)
            position = self._entries_start + self._flushed * ENTRY_SIZE
            runs: list[tuple[int, bytes | memoryview]] = []
            slot_crc, slot_entries = self._slot_crc, self._slot_entries
            if write_slots:
                # Slicing copies, so later puts cannot change what this flush writes.
                runs = [(start, _slot_bytes(slots[start:stop])) for start, stop in self._runs()]
                dirty[:] = bytes(len(dirty))
                slot_crc, slot_entries = crc32c(_slot_bytes(slots)), self._count
            self._header_dirty = False
            header = self._header(slot_crc, slot_entries)
        try:
            if data:
                self.fs.pwrite(self._fd, data, position)
            for start, chunk in runs:
                self.fs.pwrite(self._fd, chunk, HEADER_REGION_SIZE + start * SLOT_SIZE)
        except OSError as exc:
            if not is_disk_full(exc):
                self._failed = exc
                raise
            # Nothing is committed before the header: what was written past the
            # committed entries is ignored by recovery and overwritten by the next
            # flush, which writes every slot run again.
            with self._lock:
                self._header_dirty = True
                if write_slots:
                    dirty[:] = b"\x01" * len(dirty)
            raise disk_full_error(self.fs, self.path, exc) from None
        try:
            self.fs.fsync(self._fd)
            self._commit_header(header)
        except BaseException as exc:
            self._failed = exc
            raise
        with self._lock:
            del self._pending[: len(data)]
            self._flushed += len(data) // ENTRY_SIZE

    def _runs(self) -> list[tuple[int, int]]:
        """The dirty pages as [start, stop) slot runs, neighbouring pages merged."""
        pages = self._dirty_pages
        runs: list[tuple[int, int]] = []
        page = pages.find(1)
        while page >= 0:
            end = pages.find(0, page)
            if end < 0:
                end = len(pages)
            runs.append((page << SLOT_PAGE_BITS, min(end << SLOT_PAGE_BITS, self.slot_count)))
            page = pages.find(1, end)
        return runs

    # ------------------------------------------------------------------ truncation, closing

    def truncate_beyond(self, commitlog_end: int) -> int:
        """Undo the newest entries whose offset is ``>= commitlog_end`` (each one's slot
        goes back to its ``prev``); returns how many. Durable when it returns. Entries put
        out of commitlog order behind a kept one stay: lookups verify every offset.
        Only on an active file."""
        self._check_usable()
        slots = self._slots
        if slots is None:
            raise StorageError(f"index file {self.path} is sealed")
        with self._flush_lock:
            count = self._count
            number = count
            while number:
                key_hash, offset, _, prev = self._entry(number)
                if offset < commitlog_end:
                    break
                slot = key_hash % self.slot_count
                if slots[slot] != number:
                    raise CorruptionError(
                        self.path,
                        self._entries_start + (number - 1) * ENTRY_SIZE,
                        ENTRY_SIZE,
                        f"index entry {number} is not the head of its slot {slot}",
                    )
                with self._lock:
                    slots[slot] = prev
                    self._dirty_pages[slot >> SLOT_PAGE_BITS] = 1
                number -= 1
            if number == count:
                return 0
            with self._lock:
                cut_on_disk = number < self._flushed
                if cut_on_disk:
                    self._pending.clear()
                    self._flushed = number
                else:
                    del self._pending[(number - self._flushed) * ENTRY_SIZE :]
                self._count = number
                self._header_dirty = True
                if number == 0:
                    self._reset_range()
            # With the slots: the table on disk may reflect entries just undone.
            self._flush_locked(with_slots=True)
            if cut_on_disk:
                # The header already excludes them; drop the bytes too so that nothing
                # stale is left past the committed entries.
                self.fs.ftruncate(self._fd, self._entries_start + number * ENTRY_SIZE)
                self.fs.fsync(self._fd)
            return count - number

    def close(self, *, flush: bool = True) -> None:
        """Flush (unless told not to or an earlier write failed) and close the file.

        A flush the disk has no room for is skipped, not raised: nothing it would have
        committed is counted as indexed by the owner's checkpoint (which covers only
        flushed puts), so the next open puts it again."""
        if self._closed:
            return
        try:
            if flush and self._failed is None and self._slots is not None:
                with contextlib.suppress(DiskFullError):
                    self.flush(with_slots=True)  # a restart then replays nothing
        finally:
            self._closed = True
            self.fs.close(self._fd)

    @property
    def described(self) -> str:
        return f"index file {self.path}"


class HashSource(NamedTuple):
    """An index file's entries at one moment (``IndexFile.hash_source``)."""

    path: str
    fs: FileSystem
    fd: int
    entries_start: int
    flushed: int  # entries on disk
    pending: bytes  # packed entries after them
