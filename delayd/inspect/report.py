"""What ``delayd inspect`` finds in a data directory, as plain data.

Every function here reads (never writes) the delay server's files under ``data_dir``
with the project's codecs — delayd.logs.message_log, schedule_log and dispatch_log,
delayd.replay.state, delayd.wheel.cursor — through the read-only scans of
``files.py``. The command prints the results as text or JSON (``text.py``,
``as_json.py``). Times are epoch milliseconds (UTC); ``now_ms`` is passed in.
"""

from __future__ import annotations

import contextlib
import json
import os
from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from delayd.inspect.files import CORRUPT, TORN_TAIL, Damage, FileEnd, records_of, scan_file
from delayd.logs import dispatch_log, layout, message_log, retirement, schedule_log
from delayd.logs.buckets import bucket_name, parse_bucket_name
from delayd.logs.dispatch_log import FATES, DispatchEntry, EntryKind
from delayd.logs.log_files import (
    DISPATCH_LOG,
    MESSAGE_LOG,
    SCHEDULE_LOG,
    LogFile,
    bucket_file,
    list_files,
)
from delayd.logs.message_log import MessageRecord, RecordFormatError
from delayd.logs.schedule_log import ScheduleRecord
from delayd.replay.recovery import scanned_buckets
from delayd.replay.state import ReplayCheckpoint, decode_replay_checkpoint
from delayd.wheel.cursor import LoadCursors
from storage.checkpoint import read_checkpoint
from storage.errors import CorruptionError
from storage.fs import FileSystem
from storage.scan import Record

# The wheel manager checkpoints its LoadCursors here (LoadCursors.to_bytes in a storage
# checkpoint file); delayd.logs.layout should name it once the wheel writes it.
WHEEL_CHECKPOINT = "wheel"

OnBytes = Callable[[int], None]
RowT = TypeVar("RowT")


class InspectError(Exception):
    """A request inspect cannot answer (no such bucket, not a data directory)."""


# ---------------------------------------------------------------- files


def check_data_dir(fs: FileSystem, data_dir: str) -> None:
    """Raise InspectError unless ``data_dir`` holds a delay server's directory."""
    if not fs.exists(layout.delay_dir(data_dir)):
        raise InspectError(
            f"{data_dir} is not a delayd data directory (no {layout.delay_dir(data_dir)})"
        )


def message_log_segments(fs: FileSystem, data_dir: str) -> list[LogFile]:
    return list_files(data_dir, MESSAGE_LOG, fs)


def bucket_names(fs: FileSystem, data_dir: str) -> tuple[list[str], list[str]]:
    """Names of the schedule_log and of the dispatch_log bucket files, each sorted."""
    return (
        [file.name for file in list_files(data_dir, SCHEDULE_LOG, fs)],
        [file.name for file in list_files(data_dir, DISPATCH_LOG, fs)],
    )


def _check_bucket(name: str) -> str:
    try:
        parse_bucket_name(name)
    except ValueError as exc:
        raise InspectError(str(exc)) from None
    return name


def _schedule_offsets(
    fs: FileSystem, file: LogFile | None, on_bytes: OnBytes | None = None
) -> tuple[list[int], FileEnd | None]:
    """Offsets of the records of a schedule_log bucket ``file``, and how its scan ended
    (None when the bucket has no file)."""
    if file is None:
        return [], None
    ends: list[FileEnd] = []
    offsets = [r.offset for r in records_of(scan_file(fs, file, on_bytes=on_bytes), ends)]
    return offsets, ends[0]


@dataclass(frozen=True, slots=True)
class DispatchFile:
    """A bucket's dispatch_log, read whole: entries with their byte positions."""

    path: str
    entries: list[tuple[int, DispatchEntry]]
    end: FileEnd

    def by_offset(self) -> dict[int, list[DispatchEntry]]:
        """The fates of each schedule_log offset (COMPLETE marks, ROUTE and ROUTED
        entries left out: they are no record's fate)."""
        out: dict[int, list[DispatchEntry]] = {}
        for _, entry in self.entries:
            if entry.kind in FATES:
                out.setdefault(entry.offset, []).append(entry)
        return out


def read_dispatch_file(
    fs: FileSystem, data_dir: str, name: str, on_bytes: OnBytes | None = None
) -> DispatchFile | None:
    """The dispatch_log of bucket ``name``, or None when it has none.

    An entry whose crc holds but that this version cannot read (decode_entry's
    CorruptionError) ends the file like a bad frame: nothing after it is read.
    """
    file = bucket_file(data_dir, DISPATCH_LOG, name, fs)
    if file is None:
        return None
    path = file.path
    entries: list[tuple[int, DispatchEntry]] = []
    ends: list[FileEnd] = []
    with contextlib.closing(records_of(scan_file(fs, file, on_bytes=on_bytes), ends)) as records:
        for record in records:
            try:
                entry = dispatch_log.decode_entry(record.type, record.payload, path, record.offset)
            except CorruptionError as exc:
                # The frame's crc holds: no crash explains it, whatever its position.
                size = file.size
                damage = Damage(CORRUPT, path, exc.offset, size - exc.offset, exc.reason)
                return DispatchFile(path, entries, FileEnd(size, exc.offset, False, damage))
            entries.append((record.offset, entry))
    return DispatchFile(path, entries, ends[0])


# ---------------------------------------------------------------- summary


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    name: str
    base_offset: int
    bytes: int
    records: int
    sealed: bool  # ends with an END_OF_SEGMENT marker
    damage: Damage | None


@dataclass(frozen=True, slots=True)
class DispatchInfo:
    bytes: int
    entries: dict[str, int]  # by kind: dispatched, dead_lettered, cancelled, complete
    complete_up_to: int | None  # schedule_log length the last COMPLETE mark covers
    damage: Damage | None


@dataclass(frozen=True, slots=True)
class BucketInfo:
    """A bucket's schedule_log file and its dispatch_log, side by side."""

    name: str
    bytes: int | None  # schedule_log file size; None when there is no file
    records: int
    damage: Damage | None
    dispatch: DispatchInfo | None  # None when there is no dispatch_log file
    undispatched: int  # schedule records that no dispatch_log entry names
    complete: bool  # a COMPLETE mark covers every record of the schedule_log file


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """The checkpoints under ``<data>/delay/checkpoint``: None when missing; a file
    that cannot be read is named in ``errors`` with the problem."""

    directory: str
    meta: dict | None = None  # the JSON of meta: format, segment_scale_minutes
    replay: ReplayCheckpoint | None = None
    wheel: LoadCursors | None = None
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Summary:
    data_dir: str
    message_log: list[SegmentInfo]
    buckets: list[BucketInfo]
    checkpoints: CheckpointInfo

    @property
    def damages(self) -> list[Damage]:
        found = [s.damage for s in self.message_log if s.damage]
        for bucket in self.buckets:
            if bucket.damage:
                found.append(bucket.damage)
            if bucket.dispatch and bucket.dispatch.damage:
                found.append(bucket.dispatch.damage)
        return found


def _seam_problem(segment: LogFile, end: FileEnd, follower: LogFile | None) -> str | None:
    """What is wrong where ``segment`` ends (``follower`` is the segment after it, None
    for the last): as SegmentedLog's recovery, nothing may follow an end-of-segment
    marker, a segment that is not the last must end with one, and the next segment
    must start where it ends."""
    ends_at = segment.base + end.stopped_at
    if end.sealed and end.stopped_at < end.size:
        return f"{end.size - end.stopped_at} bytes after the end-of-segment marker"
    if follower is None:
        return None
    if not end.sealed:
        return "no end-of-segment marker, but a later segment exists"
    if follower.base != ends_at:
        return f"ends at offset {ends_at}, but the next segment starts at {follower.base}"
    return None


def _segment_infos(fs: FileSystem, data_dir: str, on_bytes: OnBytes | None) -> list[SegmentInfo]:
    segments = message_log_segments(fs, data_dir)
    infos = []
    followers: list[LogFile | None] = [*segments[1:], None] if segments else []
    for segment, follower in zip(segments, followers, strict=True):
        ends: list[FileEnd] = []
        records = sum(1 for _ in records_of(scan_file(fs, segment, on_bytes=on_bytes), ends))
        end = ends[0]
        damage = end.damage
        problem = None if damage else _seam_problem(segment, end, follower)
        if problem is not None:
            # Recovery meets a bad seam as it meets a bad frame: the same rule judges it.
            kind = TORN_TAIL if segment.is_torn_tail(end.stopped_at) else CORRUPT
            damage = Damage(kind, segment.path, end.stopped_at, end.size - end.stopped_at, problem)
        infos.append(SegmentInfo(segment.name, segment.base, end.size, records, end.sealed, damage))
    return infos


def _dispatch_info(dispatch: DispatchFile) -> DispatchInfo:
    counts = {kind.name.lower(): 0 for kind in EntryKind}
    complete_up_to = None
    for _, entry in dispatch.entries:
        counts[entry.kind.name.lower()] += 1
        if entry.kind is EntryKind.COMPLETE:
            complete_up_to = entry.offset
    return DispatchInfo(dispatch.end.size, counts, complete_up_to, dispatch.end.damage)


def bucket_info(
    fs: FileSystem,
    data_dir: str,
    name: str,
    scanned: Mapping[int, int] | None,
    on_bytes: OnBytes | None = None,
) -> BucketInfo:
    """One bucket's schedule_log and dispatch_log, counted; ``scanned`` is
    delayd.replay.recovery.scanned_buckets'."""
    schedule = bucket_file(data_dir, SCHEDULE_LOG, name, fs, scanned)
    offsets, end = _schedule_offsets(fs, schedule, on_bytes)
    dispatch = read_dispatch_file(fs, data_dir, name, on_bytes)
    done = dispatch.by_offset() if dispatch else {}
    info = _dispatch_info(dispatch) if dispatch else None
    covered = info.complete_up_to if info else None
    return BucketInfo(
        name=name,
        bytes=end.size if end else None,
        records=len(offsets),
        damage=end.damage if end else None,
        dispatch=info,
        undispatched=sum(1 for offset in offsets if offset not in done),
        complete=covered is not None and covered >= (end.stopped_at if end else 0),
    )


def _decode_meta(data: bytes, path: str) -> dict:
    meta = json.loads(data)
    if not isinstance(meta, dict):
        raise ValueError(f"meta is {type(meta).__name__}, not an object")
    return meta


def _decode_wheel(data: bytes, path: str) -> LoadCursors:
    return LoadCursors.from_bytes(data)


def read_checkpoints(fs: FileSystem, data_dir: str) -> CheckpointInfo:
    """The meta, replay and wheel checkpoints, decoded."""
    directory = layout.checkpoint_dir(data_dir)
    readers: dict[str, tuple[str, Callable[[bytes, str], object]]] = {
        "meta": (layout.meta_checkpoint_path(data_dir), _decode_meta),
        "replay": (layout.replay_checkpoint_path(data_dir), decode_replay_checkpoint),
        "wheel": (os.path.join(directory, WHEEL_CHECKPOINT), _decode_wheel),
    }
    values: dict[str, object] = {}
    errors: dict[str, str] = {}
    for name, (path, decode) in readers.items():
        try:
            data = read_checkpoint(fs, path)
            if data is not None:
                values[name] = decode(data, path)
        except CorruptionError as exc:
            errors[name] = f"{exc.reason} ({path})"
        except ValueError as exc:  # JSON or cursors that do not parse
            errors[name] = f"{exc} ({path})"
    return CheckpointInfo(directory, errors=errors, **values)


def summary(fs: FileSystem, data_dir: str, on_bytes: OnBytes | None = None) -> Summary:
    """Every segment and bucket counted, every checkpoint decoded."""
    check_data_dir(fs, data_dir)
    schedule, dispatch = bucket_names(fs, data_dir)
    names = sorted({*schedule, *dispatch})
    scanned = scanned_buckets(fs, data_dir)
    return Summary(
        data_dir=data_dir,
        message_log=_segment_infos(fs, data_dir, on_bytes),
        buckets=[bucket_info(fs, data_dir, n, scanned, on_bytes) for n in names],
        checkpoints=read_checkpoints(fs, data_dir),
    )


# ---------------------------------------------------------------- record listings


@dataclass(frozen=True, slots=True)
class MessageRow:
    """One message_log record: decoded, or why it could not be."""

    offset: int
    next_offset: int
    segment: str
    type: str  # "message", or the name of another record type
    message: MessageRecord | None
    error: str | None = None
    retired_bucket: str | None = None  # a retire_bucket record: the bucket it names


@dataclass(frozen=True, slots=True)
class ScheduleRow:
    """One schedule_log record of a bucket, with the dispatch_log entries naming it."""

    offset: int
    next_offset: int
    record: ScheduleRecord | None
    dispatch: list[DispatchEntry]
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Listing(Generic[RowT]):
    """Records from ``start``; ``next_offset`` continues the listing (None when it
    reached the end); ``damages`` are the bad frames met on the way, each of which
    stopped the scan of its file."""

    start: int
    rows: list[RowT]
    next_offset: int | None
    damages: list[Damage]


def _message_row(record: Record, segment: LogFile) -> MessageRow:
    kind = message_log.describe_type(record.type)
    if record.type == message_log.TYPE_RETIRE_BUCKET:
        try:
            retired = bucket_name(retirement.decode(record.payload).start_ms)
        except RecordFormatError as exc:
            return MessageRow(
                record.offset, record.next_offset, segment.name, kind, None, f"undecodable: {exc}"
            )
        return MessageRow(
            record.offset, record.next_offset, segment.name, kind, None, retired_bucket=retired
        )
    if record.type != message_log.TYPE_MESSAGE:
        return MessageRow(record.offset, record.next_offset, segment.name, kind, None)
    try:
        message = message_log.decode_message(record.payload)
    except RecordFormatError as exc:
        return MessageRow(
            record.offset, record.next_offset, segment.name, kind, None, f"undecodable: {exc}"
        )
    return MessageRow(record.offset, record.next_offset, segment.name, kind, message)


def list_message_log(
    fs: FileSystem, data_dir: str, start: int | None = None, limit: int = 50
) -> Listing[MessageRow]:
    """Up to ``limit`` message_log records from offset ``start`` (a record's offset;
    default the first). Raises InspectError for an offset before the first segment."""
    check_data_dir(fs, data_dir)
    segments = message_log_segments(fs, data_dir)
    if not segments:
        return Listing(start or 0, [], None, [])
    start = segments[0].base if start is None else start
    if start < segments[0].base:
        raise InspectError(
            f"offset {start} is before the first message_log segment ({segments[0].base})"
        )
    first = bisect_right([s.base for s in segments], start) - 1
    rows: list[MessageRow] = []
    ends: list[FileEnd] = []
    for segment in segments[first:]:
        scan = scan_file(fs, segment, start=start - segment.base if segment.base <= start else 0)
        with contextlib.closing(records_of(scan, ends)) as records:
            for record in records:
                if len(rows) == limit:
                    return Listing(start, rows, record.offset, [e.damage for e in ends if e.damage])
                rows.append(_message_row(record, segment))
    return Listing(start, rows, None, [e.damage for e in ends if e.damage])


def _schedule_row(
    record: Record, path: str, dispatch: dict[int, list[DispatchEntry]]
) -> ScheduleRow:
    entries = dispatch.get(record.offset, [])
    try:
        schedule_log.check_type(record.type, path, record.offset)
        decoded = schedule_log.decode_scheduled(record.payload)
    except RecordFormatError as exc:
        return ScheduleRow(record.offset, record.next_offset, None, entries, f"undecodable: {exc}")
    return ScheduleRow(record.offset, record.next_offset, decoded, entries)


def list_bucket(
    fs: FileSystem, data_dir: str, name: str, start: int = 0, limit: int = 50
) -> Listing[ScheduleRow]:
    """Up to ``limit`` records of schedule_log bucket ``name`` from byte ``start``, each
    with its dispatch_log entries. Raises InspectError for a bucket with no file."""
    check_data_dir(fs, data_dir)
    file = bucket_file(
        data_dir, SCHEDULE_LOG, _check_bucket(name), fs, scanned_buckets(fs, data_dir)
    )
    if file is None:
        path = os.path.join(layout.schedule_log_dir(data_dir), name)
        raise InspectError(f"schedule_log has no bucket {name} ({path})")
    dispatch = read_dispatch_file(fs, data_dir, name)
    by_offset = dispatch.by_offset() if dispatch else {}
    later = [dispatch.end.damage] if dispatch and dispatch.end.damage else []
    rows: list[ScheduleRow] = []
    ends: list[FileEnd] = []
    with contextlib.closing(records_of(scan_file(fs, file, start=start), ends)) as records:
        for record in records:
            if len(rows) == limit:
                return Listing(start, rows, record.offset, later)
            rows.append(_schedule_row(record, file.path, by_offset))
    return Listing(start, rows, None, [e.damage for e in ends if e.damage] + later)


# ---------------------------------------------------------------- dispatch state


@dataclass(frozen=True, slots=True)
class DispatchReport:
    """A bucket's dispatch_log entries and the schedule records they leave undone."""

    bucket: str
    entries: list[tuple[int, DispatchEntry]]  # (byte position in the file, entry)
    info: DispatchInfo | None  # None when the bucket has no dispatch_log file
    schedule_records: int
    undispatched: list[int]  # schedule_log offsets no entry names
    damages: list[Damage]


def dispatch_report(fs: FileSystem, data_dir: str, name: str) -> DispatchReport:
    """Raises InspectError when the bucket has neither a schedule_log nor a dispatch_log."""
    check_data_dir(fs, data_dir)
    schedule = bucket_file(
        data_dir, SCHEDULE_LOG, _check_bucket(name), fs, scanned_buckets(fs, data_dir)
    )
    offsets, end = _schedule_offsets(fs, schedule)
    dispatch = read_dispatch_file(fs, data_dir, name)
    if dispatch is None and end is None:
        raise InspectError(f"bucket {name} has neither a schedule_log nor a dispatch_log file")
    done = dispatch.by_offset() if dispatch else {}
    damages = [e.damage for e in (end, dispatch and dispatch.end) if e and e.damage]
    return DispatchReport(
        bucket=name,
        entries=dispatch.entries if dispatch else [],
        info=_dispatch_info(dispatch) if dispatch else None,
        schedule_records=len(offsets),
        undispatched=[offset for offset in offsets if offset not in done],
        damages=damages,
    )


# ---------------------------------------------------------------- find

NOT_REPLAYED = "not_replayed"  # in message_log, not (yet) in schedule_log
WAITING = "waiting"  # in schedule_log, due later, no dispatch_log entry
OVERDUE = "overdue"  # in schedule_log, due time passed, no dispatch_log entry
DISPATCHED = "dispatched"
DEAD_LETTERED = "dead_lettered"
CANCELLED = "cancelled"
RESCHEDULED = "rescheduled"  # moved: a copy with the new due time is in another record
NOT_MOVED = "not_moved"  # the void copy of a refused reschedule: never delivered
_STATUS_OF_KIND = (
    (EntryKind.DISPATCHED, DISPATCHED),
    (EntryKind.DEAD_LETTERED, DEAD_LETTERED),
    (EntryKind.CANCELLED, CANCELLED),
    (EntryKind.RESCHEDULED, RESCHEDULED),
    (EntryKind.NOT_MOVED, NOT_MOVED),
)


@dataclass(frozen=True, slots=True)
class FoundMessage:
    """One copy of the message (one message_log record): where it is, what became of it."""

    message: MessageRecord
    message_log_offset: int
    segment: str | None  # None when message_log no longer holds it (retention)
    bucket: str | None  # None when replay has not copied it into schedule_log
    bucket_offset: int | None
    dispatch: list[DispatchEntry]
    status: str  # one of the constants above


@dataclass(frozen=True, slots=True)
class FindResult:
    message_id: str
    found: list[FoundMessage]
    damages: list[Damage]  # files whose scan stopped early: the id may hide behind them


def _status(
    message: MessageRecord, bucket: str | None, entries: list[DispatchEntry], now_ms: int
) -> str:
    if bucket is None:
        return NOT_REPLAYED
    for kind, status in _STATUS_OF_KIND:
        if any(entry.kind is kind for entry in entries):
            return status
    return OVERDUE if message.due_ms <= now_ms else WAITING


def _holding(records: Iterator[Record], needle: bytes) -> Iterator[Record]:
    # A cheap byte search before decoding: most records do not hold the id at all.
    return (record for record in records if needle in record.payload)


def find_message(
    fs: FileSystem,
    data_dir: str,
    message_id: str,
    now_ms: int,
    on_bytes: OnBytes | None = None,
) -> FindResult:
    """Every copy of ``message_id`` in message_log and schedule_log (a linear scan of
    both), joined on the message_log offset, with its dispatch_log entries."""
    check_data_dir(fs, data_dir)
    needle = message_id.encode()
    ends: list[FileEnd] = []
    in_log: dict[int, tuple[str, MessageRecord]] = {}
    for segment in message_log_segments(fs, data_dir):
        records = records_of(scan_file(fs, segment, on_bytes=on_bytes), ends)
        for record in _holding(records, needle):
            if record.type != message_log.TYPE_MESSAGE:
                continue
            with contextlib.suppress(RecordFormatError):
                message = message_log.decode_message(record.payload)
                if message.message_id == message_id:
                    in_log[record.offset] = (segment.name, message)
    scheduled: dict[int, tuple[str, int, MessageRecord]] = {}
    for bucket in list_files(data_dir, SCHEDULE_LOG, fs, scanned_buckets(fs, data_dir)):
        name = bucket.name
        records = records_of(scan_file(fs, bucket, on_bytes=on_bytes), ends)
        for record in _holding(records, needle):
            with contextlib.suppress(RecordFormatError):
                decoded = schedule_log.decode_scheduled(record.payload)
                if decoded.message.message_id == message_id:
                    scheduled[decoded.message_log_offset] = (name, record.offset, decoded.message)
    damages = [end.damage for end in ends if end.damage]
    dispatch: dict[str, dict[int, list[DispatchEntry]]] = {}
    found = []
    for offset in sorted({*in_log, *scheduled}):
        segment, logged = in_log.get(offset, (None, None))
        bucket, bucket_offset, copied = scheduled.get(offset, (None, None, None))
        message = logged or copied
        assert message is not None  # the offset came from one of the two
        entries: list[DispatchEntry] = []
        if bucket is not None:
            if bucket not in dispatch:
                file = read_dispatch_file(fs, data_dir, bucket)
                dispatch[bucket] = file.by_offset() if file else {}
                if file and file.end.damage:
                    damages.append(file.end.damage)
            entries = dispatch[bucket].get(bucket_offset, [])
        status = _status(message, bucket, entries, now_ms)
        found.append(FoundMessage(message, offset, segment, bucket, bucket_offset, entries, status))
    return FindResult(message_id, found, damages)
