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
    ROUTE          8  one broker group of the bucket's **route set**: ``group`` its name,
                      ``offset`` packs ``count << 32 | weight`` (count: the groups in the
                      set; a set is ``count`` consecutive ROUTE entries of one ``at_ms``;
                      count 0 with ``group`` empty is the empty set). Written before the
                      bucket's first send, durable (and in a group copied by the in-sync
                      followers) before it; the first whole set of a file is the
                      bucket's, for good
    ROUTED         9  the record at ``offset`` is sent to ``group``, not where the
                      route set puts it (a circuit open, a group added or drained since),
                      written durable before that send; the last one of an offset counts

ROUTE and ROUTED say where a send went, not what became of the record (``FATES`` are
the others): after a crash, a record without a fate is sent again to its last ROUTED
group, else to the rendezvous choice of the bucket's route set — where the first send
went, so that broker drops the copy (docs/cluster.md, "A resend after a failover").
Files written before these kinds existed have none: their records are routed by the
groups of the moment, as then.

An offset has one fate, except after a crash (an entry repeated by replay, or a resend
whose DISPATCHED entry was lost): readers take the first fate of an offset.

``group`` is the broker group's name in ASCII, NUL-padded (names are at most 16 bytes;
delayd.server.config checks). The name is stored, not an index into a table, so that
the file means the same thing after the configuration changes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
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
    ROUTE = 8
    ROUTED = 9


# The kinds that say what became of a record (ROUTE, ROUTED and COMPLETE do not).
FATES = frozenset(
    {
        EntryKind.DISPATCHED,
        EntryKind.DEAD_LETTERED,
        EntryKind.CANCELLED,
        EntryKind.RESCHEDULED,
        EntryKind.NOT_MOVED,
    }
)
ROUTING = frozenset({EntryKind.ROUTE, EntryKind.ROUTED})
_ROUTE_COUNT_SHIFT = 32
_ROUTE_WEIGHT_MASK = (1 << _ROUTE_COUNT_SHIFT) - 1
MAX_ROUTE_WEIGHT = _ROUTE_WEIGHT_MASK  # a ROUTE entry holds a group's weight in 32 bits

RouteSet = tuple[tuple[str, int], ...]
"""A route set: (broker group name, weight) pairs, sorted by name."""


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


def encode_route_set(route_set: RouteSet, at_ms: int) -> list[bytes]:
    """The payloads of the ROUTE entries recording ``route_set`` (one entry for the
    empty set). Raises ValueError for a name ``check_group_name`` refuses or a weight
    outside 1..2**32-1."""
    count = len(route_set) << _ROUTE_COUNT_SHIFT
    if not route_set:
        return [encode_entry(0, at_ms)]
    payloads = []
    for name, weight in route_set:
        if not 1 <= weight <= MAX_ROUTE_WEIGHT:
            raise ValueError(f"broker group {name!r}: weight {weight} is not in 1..2**32-1")
        payloads.append(encode_entry(count | weight, at_ms, check_group_name(name)))
    return payloads


def decode_records(records: Iterable[Record], path: str) -> Iterator[DispatchEntry]:
    for record in records:
        yield decode_entry(record.type, record.payload, path, record.offset)


@dataclass(slots=True)
class BucketRoutes:
    """What a bucket's dispatch_log says of its sends: its route set (None: no send
    recorded one, e.g. a file of an older version), the last ROUTED group of each
    offset that has one, and whether the set was read from the file (``earlier``: a
    run before this one may have sent from the bucket) rather than recorded since."""

    route_set: RouteSet | None = None
    deviations: dict[int, str] = field(default_factory=dict)
    earlier: bool = False


@dataclass(slots=True)
class DispatchState:
    """What a bucket's dispatch_log says: the schedule_log offsets that have a fate
    (dispatched, dead-lettered, cancelled, moved), the length the last COMPLETE mark
    covers (None without one), and its routes."""

    done: set[int]
    complete_up_to: int | None
    entries: int
    routes: BucketRoutes = field(default_factory=BucketRoutes)


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
    """The first fate (``FATES``) of schedule_log ``offset`` in a dispatch_log file,
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
                if entry.kind in FATES:
                    return entry
        at = data.find(needle, at + 1, whole)
    return None


def read_state(entries: Iterable[DispatchEntry]) -> DispatchState:
    """Fold a bucket's entries (e.g. ``decode_records(record_file.iter_from(0), path)``
    of a RecordFile, which cut any torn tail when it opened) into a DispatchState."""
    state = DispatchState(set(), None, 0)
    routes = state.routes
    run: list[DispatchEntry] = []  # the ROUTE entries of the set being read
    for entry in entries:
        state.entries += 1
        kind = entry.kind
        if kind is EntryKind.ROUTE:
            if routes.route_set is None:
                run = _route_run(run, entry)
                if len(run) == entry.offset >> _ROUTE_COUNT_SHIFT or not entry.group:
                    routes.route_set, routes.earlier = _route_set_of(run), True
            continue
        run = []  # a set cut short by a crash is no set
        if kind is EntryKind.COMPLETE:
            state.complete_up_to = entry.offset
        elif kind is EntryKind.ROUTED:
            routes.deviations[entry.offset] = entry.group
        else:
            state.done.add(entry.offset)
    return state


def _route_run(run: list[DispatchEntry], entry: DispatchEntry) -> list[DispatchEntry]:
    """``run`` with ROUTE ``entry`` added, or a new run when it starts another set."""
    if run and (
        run[0].at_ms != entry.at_ms
        or run[0].offset >> _ROUTE_COUNT_SHIFT != entry.offset >> _ROUTE_COUNT_SHIFT
        or any(e.group == entry.group for e in run)
    ):
        run = []
    run.append(entry)
    return run


def _route_set_of(run: Sequence[DispatchEntry]) -> RouteSet:
    return tuple(sorted((e.group, e.offset & _ROUTE_WEIGHT_MASK) for e in run if e.group))
