"""dispatch_log: what became of each schedule_log record — one fixed-width entry each.

``<data>/delay/dispatch_log/yyyyMMddHHmm`` has the name of the schedule_log bucket it
describes and is a storage RecordFile (CRC-framed, torn tail cut on open). The sender
appends an entry after the broker acknowledged a message (or after it was
dead-lettered, or cancelled); the wheel manager appends a COMPLETE mark once every
record of the bucket has an entry. Restart recovery reads it to load again exactly the
records that have none (docs/delay-formats.md, docs/delivery.md); the audit reads it to
reconcile. This module is the one codec of the format.

Every entry is the same size, header included (FRAMED_SIZE = 9 + 32 = 41 bytes), so
the last entry of a file is at ``size - FRAMED_SIZE`` and a reader can check whether a
bucket is complete with one small read. Payload (little-endian)::

    entry := offset:u64 at_ms:i64 group:byte[16]

(A file's entries are written with the async flush policy: losing the last ones in a
crash only means those messages are sent again, and the broker drops the ids it already
has — DESIGN.md, "What we promise".)

The frame's type byte says what the entry is:

    DISPATCHED     2  the broker group ``group`` acknowledged the record at ``offset`` at
                      ``at_ms`` (the dispatched_ms consumers see)
    DEAD_LETTERED  3  after max_attempts the record was sent to the dead-letter subject
                      of ``group`` at ``at_ms``
    CANCELLED      4  the record was cancelled (``group`` empty) at ``at_ms``: it is never
                      delivered (docs/cancel.md)
    COMPLETE       5  every record below ``offset`` (the schedule_log file's length) has
                      an entry; ``group`` empty
    RESCHEDULED    6  the record was moved away at ``at_ms`` (``group`` empty): a copy
                      with the new due time was appended to schedule_log, behind the
                      RESCHEDULE tombstone's message_log offset (docs/cancel.md)
    NOT_MOVED      7  the record is the copy a RESCHEDULE tombstone appended although
                      the message was not moved (delivered, cancelled, in doubt): it is
                      never delivered, and the id's current record is the one before it.
                      Replay appends the copy on every member of a group; the leader's
                      decision lives here (docs/cancel.md, "Reschedules and replication")

An offset has one entry, except after a crash (an entry repeated by replay, or a resend
whose DISPATCHED entry was lost): readers take the first entry of an offset as its fate.

``group`` is the broker group's name in ASCII, NUL-padded (names are at most 16 bytes;
delayd.server.config checks). The name is stored, not an index into a table, so that
the file means the same thing after the configuration changes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import IntEnum

from storage.errors import CorruptionError
from storage.framing import HEADER_SIZE, crc32c, type_seed
from storage.fs import O_READ, FileSystem
from storage.scan import BadFrame, Record, read_frame

GROUP_NAME_BYTES = 16
ENTRY = struct.Struct(f"<Qq{GROUP_NAME_BYTES}s")
ENTRY_SIZE = ENTRY.size  # 8 + 8 + 16 = 32
assert ENTRY_SIZE == 8 + 8 + GROUP_NAME_BYTES
FRAMED_SIZE = HEADER_SIZE + ENTRY_SIZE  # 41


class EntryKind(IntEnum):
    """The frame type of a dispatch_log entry; see the module docstring."""

    DISPATCHED = 2
    DEAD_LETTERED = 3
    CANCELLED = 4
    COMPLETE = 5
    RESCHEDULED = 6
    NOT_MOVED = 7


@dataclass(frozen=True, slots=True)
class DispatchEntry:
    """One decoded entry. ``offset`` is a schedule_log offset (COMPLETE: its length)."""

    kind: EntryKind
    offset: int
    at_ms: int
    group: str


def check_group_name(name: str) -> bytes:
    """The stored form of a group name. Raises ValueError for a name that is empty,
    longer than GROUP_NAME_BYTES, or not made of ASCII letters, digits, ``_ . -``."""
    raw = name.encode("ascii", "replace")
    if (
        not raw
        or len(raw) > GROUP_NAME_BYTES
        or not all(chr(b).isalnum() or chr(b) in "_.-" for b in raw)
    ):
        raise ValueError(
            f"broker group name {name!r} must be 1..{GROUP_NAME_BYTES} ASCII letters, "
            "digits, '_', '.' or '-'"
        )
    return raw


def encode_entry(offset: int, at_ms: int, group: bytes = b"") -> bytes:
    """The payload of an entry; ``group`` as returned by ``check_group_name`` (or b"")."""
    return ENTRY.pack(offset, at_ms, group)


def decode_entry(
    rtype: int, payload: bytes | memoryview, path: str, position: int
) -> DispatchEntry:
    """The entry of a framed record of type ``rtype``. Raises CorruptionError for an
    unknown type or a payload of the wrong size (a CRC that holds over a bad record
    means a bug or a newer writer, never a crash)."""
    if len(payload) != ENTRY_SIZE or rtype not in _KINDS:
        raise CorruptionError(
            path,
            position,
            HEADER_SIZE + len(payload),
            f"dispatch_log entry of type {rtype} and {len(payload)} bytes; this version "
            f"reads types {sorted(_KINDS)} of {ENTRY_SIZE} bytes",
        )
    offset, at_ms, group = ENTRY.unpack(payload)
    return DispatchEntry(_KINDS[rtype], offset, at_ms, group.rstrip(b"\0").decode("ascii"))


_KINDS = {kind.value: kind for kind in EntryKind}


def decode_records(records: Iterable[Record], path: str) -> Iterator[DispatchEntry]:
    for record in records:
        yield decode_entry(record.type, record.payload, path, record.offset)


@dataclass(slots=True)
class DispatchState:
    """What a bucket's dispatch_log says: the schedule_log offsets that have an entry
    (dispatched, dead-lettered or cancelled) and the length the last COMPLETE mark
    covers (None without one)."""

    done: set[int]
    complete_up_to: int | None
    entries: int


def read_last_entry(fs: FileSystem, path: str) -> DispatchEntry | None:
    """The last entry of a dispatch_log file, from one read (None when missing or
    empty). A torn tail (a size that is not a whole number of entries, or a bad last
    entry) reads as None: the caller then falls back to ``read_state``."""
    if not fs.exists(path):
        return None
    fd = fs.open(path, O_READ)
    try:
        size = fs.fsize(fd)
        if size < FRAMED_SIZE or size % FRAMED_SIZE:
            return None
        try:
            record = read_frame(fs, fd, path, 0, size - FRAMED_SIZE, size)
        except BadFrame:
            return None
    finally:
        fs.close(fd)
    return decode_entry(record.type, record.payload, path, record.offset)


_FRAME_HEAD = struct.Struct("<IIB")  # storage frame: length, crc32c, type
_OFFSET_AT = HEADER_SIZE  # the entry's offset field is the first of its payload


def find_entry(fs: FileSystem, path: str, offset: int) -> DispatchEntry | None:
    """The first entry (not COMPLETE) for schedule_log ``offset`` in a dispatch_log file,
    or None. Reads the file once and lets ``bytes.find`` look for the offset field, so
    a bucket of a million entries (41 MB) is searched in C; CRCs are checked on the
    matches only. A torn tail is ignored. Raises CorruptionError for a matching entry
    whose CRC holds but whose type is unknown."""
    if not fs.exists(path):
        return None
    fd = fs.open(path, O_READ)
    try:
        size = fs.fsize(fd)
        data = fs.pread(fd, size, 0)
    finally:
        fs.close(fd)
    whole = len(data) - len(data) % FRAMED_SIZE
    needle = struct.pack("<Q", offset)
    at = data.find(needle, 0, whole)
    while at >= 0:
        start = at - _OFFSET_AT
        if start % FRAMED_SIZE == 0:
            length, crc, rtype = _FRAME_HEAD.unpack_from(data, start)
            payload = data[start + HEADER_SIZE : start + FRAMED_SIZE]
            if length == ENTRY_SIZE and crc == crc32c(payload, type_seed(rtype)):
                entry = decode_entry(rtype, payload, path, start)
                if entry.kind is not EntryKind.COMPLETE:
                    return entry
        at = data.find(needle, at + 1, whole)
    return None


def read_state(entries: Iterable[DispatchEntry]) -> DispatchState:
    """Fold a bucket's entries (e.g. ``decode_records(record_file.iter_from(0), path)``
    of a RecordFile, which cut any torn tail when it opened) into a DispatchState."""
    state = DispatchState(set(), None, 0)
    for entry in entries:
        state.entries += 1
        if entry.kind is EntryKind.COMPLETE:
            state.complete_up_to = entry.offset
        else:
            state.done.add(entry.offset)
    return state
