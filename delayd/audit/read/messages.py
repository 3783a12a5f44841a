"""schedule_log and message_log files as Arrow batches: the records that carry a message.

A SCHEDULED record is ``message_log_offset`` followed by the MESSAGE payload, so both
logs are read by one loop. Frames come from storage.scan.scan_frames (every CRC
checked, via frames.FileScan). The loop only collects each record's offset and payload;
a batch of them then becomes one Arrow binary column, and the head — the codec's own
struct, ``schedule_log.PREFIX`` + ``message_log.HEAD`` — and the texts behind it are
cut out of that column by Arrow's kernels (fields.py), with no Python step per record.
Only the fields the audit needs are taken: offsets, times, sequence, id, subject, key
and the body's size. Properties and bodies are not decoded.

message_log also holds cancel and reschedule tombstones (docs/cancel.md). Each goes
through its codec (delayd.logs.tombstone), one at a time, into a row whose ``kind``
says what it is (``cancel``, ``reschedule``; a message's is ``message``) and whose
sequence, subject, key and body_size are null. A bucket retirement (a deletion
retention ordered, delayd.logs.retirement) is not a message: it is checked by its
codec and gives no row.

Two modes, option ``verify``:

* ``head`` (default): the batch is checked as the codec checks a head — known flags,
  the key flag, lengths that add up to the payload — and its texts as UTF-8, a column
  at a time. A record that fails any of it goes to the codec (``decode_scheduled`` /
  ``decode_message``), whose RecordFormatError becomes a ``format`` row naming the
  reason; the codec decides, never this module.
* ``full``: every record is decoded by the codec, properties included (about five
  times slower). The tests check that both modes give the same batches.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from delayd.audit.kinds import FORMAT, HEAD
from delayd.audit.read import fields
from delayd.audit.read.batches import ALL, ReadOptions, bucket_value, build, problems_batch
from delayd.audit.read.frames import FileScan, Problem
from delayd.audit.schemas import MESSAGE_LOG, SCHEDULE_LOG, select
from delayd.logs import message_log, retirement, schedule_log, tombstone
from delayd.logs.log_files import LogFile
from delayd.logs.message_log import FLAG_KEY, KNOWN_FLAGS, MessageRecord, RecordFormatError
from delayd.logs.retirement import Retirement
from delayd.logs.tombstone import Tombstone
from storage.scan import BadFrame, Record

# The head of each record as one struct, composed from the codecs' own formats, and the
# names of its fields in that order (as decode_message unpacks message_log.HEAD).
_SCHEDULED_HEAD = struct.Struct("<" + schedule_log.PREFIX.format[1:] + message_log.HEAD.format[1:])
assert _SCHEDULED_HEAD.size == schedule_log.HEAD_SIZE
_MESSAGE_FIELDS = (
    "due_ms",
    "sequence",
    "receive_ms",
    "flags",
    "id_len",
    "subject_len",
    "key_len",
    "props_len",
    "body_len",
)
_LENGTHS = ("id_len", "subject_len", "key_len", "props_len", "body_len")
_CHECKED = ("flags", *_LENGTHS)  # read from every head, to check it
# message_log's ``kind`` column, indexed by the frame's type byte (for Arrow's take()).
_KIND_TYPES = (message_log.TYPE_MESSAGE, *message_log.TOMBSTONE_TYPES)
_KIND_NAMES = pa.array(
    [message_log.describe_type(t) if t in _KIND_TYPES else None for t in range(256)], pa.string()
)
# A batch is cut short once its frames reach this many bytes: the payloads are held in
# memory until it is built, end to end in one buffer with int32 offsets (fields.cut).
_BATCH_BYTES = 64 << 20

Decoded = tuple[int | None, MessageRecord | Tombstone | Retirement]  # message_log_offset, record
# A record decoded by its codec: offset, frame type, and the values of _ROW_COLUMNS.
_Row = tuple[int, int, tuple]
_ROW_COLUMNS = (
    "message_log_offset",
    "due_ms",
    "sequence",
    "receive_ms",
    "message_id",
    "subject",
    "key",
    "body_size",
)


class _Shape:
    """What differs between the two logs: the record type, the head struct and its
    field names, and the codec."""

    def __init__(
        self,
        rtype: int,
        head: struct.Struct,
        names: tuple[str, ...],
        decode: Callable[[int, bytes], Decoded],
        check_type: Callable[[int, str, int], None],
    ) -> None:
        self.rtype = rtype
        self.head = head
        self.fields = dict(zip(names, fields.layout(head), strict=True))
        self.decode = decode
        self.check_type = check_type


def _decode_scheduled(rtype: int, payload: bytes) -> Decoded:
    record = schedule_log.decode_scheduled(payload)
    return record.message_log_offset, record.message


def _decode_message(rtype: int, payload: bytes) -> Decoded:
    if rtype in message_log.TOMBSTONE_TYPES:
        return None, tombstone.decode(rtype, payload)
    if rtype == message_log.TYPE_RETIRE_BUCKET:
        return None, retirement.decode(payload)
    return None, message_log.decode_message(payload)


SCHEDULE = _Shape(
    schedule_log.TYPE_SCHEDULED,
    _SCHEDULED_HEAD,
    ("message_log_offset", *_MESSAGE_FIELDS),
    _decode_scheduled,
    schedule_log.check_type,
)
MESSAGE = _Shape(
    message_log.TYPE_MESSAGE,
    message_log.HEAD,
    _MESSAGE_FIELDS,
    _decode_message,
    message_log.check_type,
)


def schedule_batches(
    file: LogFile, server: str, options: ReadOptions = ALL
) -> Iterator[pa.RecordBatch]:
    """The SCHEDULED records of one schedule_log bucket file (SCHEDULE_LOG schema, or
    its ``options.columns``), then one row per problem found."""
    return _batches(SCHEDULE, file, server, options, select(SCHEDULE_LOG, options.columns))


def message_batches(
    file: LogFile, server: str, options: ReadOptions = ALL
) -> Iterator[pa.RecordBatch]:
    """The records of one message_log segment — messages and tombstones (MESSAGE_LOG
    schema, or its ``options.columns``), then one row per problem found."""
    return _batches(MESSAGE, file, server, options, select(MESSAGE_LOG, options.columns))


class _Batch:
    """The records of one batch: the frames as the scan finds them, and those the codec
    decoded, one at a time."""

    def __init__(
        self, shape: _Shape, file: LogFile, schema: pa.Schema, where: dict, fast: bool
    ) -> None:
        self.shape = shape
        self.file = file
        self.schema = schema
        self.where = where
        self.fast = fast  # verify=head: the records of the shape's type column at a time
        self.frames: list[Record] = []
        self.decoded: list[_Row] = []

    def slow(self, rtype: int, offset: int, payload: bytes, problems: list[Problem]) -> None:
        """Decode one record with the codec: into ``decoded`` when it is valid, into
        ``problems`` (a ``format`` problem) when the codec refuses it."""
        shape, file = self.shape, self.file
        try:
            shape.check_type(rtype, file.path, offset)
            message_log_offset, message = shape.decode(rtype, payload)
        except RecordFormatError as exc:
            problems.append(Problem(FORMAT, offset - file.base, exc.reason))
            return
        if isinstance(message, Retirement):
            return  # a bucket deletion retention ordered: not a message, no row
        if isinstance(message, Tombstone):  # message_log only; no sequence, no body
            values = (None, message.due_ms, None, message.receive_ms, message.message_id)
            self.decoded.append((offset, rtype, (*values, None, None, None)))
            return
        values = (message_log_offset, message.due_ms, message.sequence, message.receive_ms)
        texts = (message.message_id, message.subject, message.key)
        self.decoded.append((offset, rtype, (*values, *texts, len(message.body))))

    def emit(self, problems: list[Problem]) -> pa.RecordBatch | None:
        """The batch of the frames collected (None for none), in file order: those of
        the shape's record type a column at a time (when ``fast``), the others — and
        those the column checks refuse — through the codec."""
        parts = []
        if self.frames:
            offsets, rtypes, payloads, _ = zip(*self.frames, strict=True)
            rtype = self.shape.rtype
            if not self.fast or rtypes.count(rtype) != len(rtypes):
                kept = [frame for frame in self.frames if self.fast and frame.type == rtype]
                for frame in self.frames:
                    if not self.fast or frame.type != rtype:
                        self.slow(frame.type, frame.offset, frame.payload, problems)
                offsets = [frame.offset for frame in kept]
                payloads = [frame.payload for frame in kept]
            if payloads:
                parts.append(self._columns(offsets, payloads, problems))
        if self.decoded:
            parts.append(self._decoded())
        self.frames, self.decoded = [], []
        parts = [part for part in parts if part.num_rows]
        if not parts:
            return None
        if len(parts) == 1:
            return parts[0]
        both = pa.concat_batches(parts)
        return both.take(pc.sort_indices(both["offset"]))

    def _columns(
        self, offsets: Sequence[int], payloads: Sequence[bytes], problems: list[Problem]
    ) -> pa.RecordBatch:
        """The batch of the records at ``offsets`` decoded a column at a time; those the
        columns cannot vouch for are decoded by ``slow`` instead."""
        shape = self.shape
        head_size = shape.head.size
        column = pa.array(payloads, pa.binary())
        offsets = pa.array(offsets, pa.int64())
        whole = pc.greater_equal(pc.binary_length(column), head_size)
        column, offsets = self._keep(whole, column, offsets, problems)
        head = fields.heads(column, head_size)
        values = {
            name: fields.field(head, *at)
            for name, at in shape.fields.items()
            if name in self.schema.names or name in _CHECKED
        }
        lengths = [values[name].cast(pa.int64()) for name in _LENGTHS]
        flags = values["flags"]
        has_key = pc.not_equal(pc.bit_wise_and(flags, FLAG_KEY), 0)
        size = head_size
        for length in lengths:
            size = pc.add(size, length)
        valid = pc.and_(
            pc.and_(
                pc.equal(pc.bit_wise_and(flags, ~KNOWN_FLAGS & 0xFF), 0),
                pc.or_(has_key, pc.equal(lengths[2], 0)),  # key_len
            ),
            pc.equal(size, pc.binary_length(column).cast(pa.int64())),
        )
        if not pc.all(valid).as_py():
            column, offsets = self._keep(valid, column, offsets, problems)
            values = {name: array.filter(valid) for name, array in values.items()}
            lengths = [length.filter(valid) for length in lengths]
            has_key = has_key.filter(valid)
        id_len, subject_len, key_len, _, body_len = lengths
        id_at = pc.add(fields.starts(column), head_size)
        subject_at = pc.add(id_at, id_len)
        key_at = pc.add(subject_at, subject_len)
        try:
            message_id, subject, key = (
                fields.cut(column, at, length).cast(pa.string())
                for at, length in ((id_at, id_len), (subject_at, subject_len), (key_at, key_len))
            )
        except pa.ArrowInvalid:  # a text that is not UTF-8: the codec names the record
            self._keep(pa.repeat(False, len(column)), column, offsets, problems)
            return build(self.schema, 0, {})
        batch = dict(self.where)
        batch.update(offset=offsets, message_id=message_id, subject=subject, body_size=body_len)
        batch["key"] = pc.if_else(has_key, key, pa.scalar(None, pa.string()))
        if "kind" in self.schema.names:
            batch["kind"] = message_log.describe_type(shape.rtype)
        for name in ("message_log_offset", "due_ms", "sequence", "receive_ms"):
            if name in values:
                batch[name] = values[name].cast(pa.int64())
        return build(self.schema, len(column), batch)

    def _keep(
        self,
        kept: pa.BooleanArray,
        column: pa.BinaryArray,
        offsets: pa.Int64Array,
        problems: list[Problem],
    ) -> tuple[pa.BinaryArray, pa.Int64Array]:
        """The records of ``column`` and ``offsets`` that are ``kept``; the others are
        decoded by ``slow``."""
        if pc.all(kept).as_py():
            return column, offsets
        for index in pc.indices_nonzero(pc.invert(kept)).to_pylist():
            self.slow(self.shape.rtype, offsets[index].as_py(), column[index].as_py(), problems)
        return column.filter(kept), offsets.filter(kept)

    def _decoded(self) -> pa.RecordBatch:
        """The batch of the records the codec decoded."""
        offsets, rtypes, rows = zip(*self.decoded, strict=True)
        batch = dict(self.where)
        batch["offset"] = offsets
        if "kind" in self.schema.names:
            batch["kind"] = _KIND_NAMES.take(pa.array(rtypes, pa.uint8()))
        for name, values in zip(_ROW_COLUMNS, zip(*rows, strict=True), strict=True):
            if name in self.schema.names:
                batch[name] = values
        return build(self.schema, len(offsets), batch)


def _batches(
    shape: _Shape, file: LogFile, server: str, options: ReadOptions, schema: pa.Schema
) -> Iterator[pa.RecordBatch]:
    verify, batch_rows = options.verify, options.batch_rows
    where = {"server": server, "file": file.name}
    if shape is SCHEDULE:
        where["bucket"] = bucket_value(file.bucket_ms)
    problems: list[Problem] = []
    batch = _Batch(shape, file, schema, where, verify == HEAD)
    append = batch.frames.append
    room, start = batch_rows, file.base
    frame = None
    with FileScan(file) as scan:
        try:
            # Once per record of every file audited: one append (a batch ends at
            # batch_rows records, or once its frames reach _BATCH_BYTES).
            for frame in scan.frames:  # the last one is read after the loop
                append(frame)
                room -= 1
                if not room or frame[3] - start >= _BATCH_BYTES:
                    emitted = batch.emit(problems)
                    if emitted is not None:
                        yield emitted
                    append = batch.frames.append
                    room, start = batch_rows, frame[3]
        except BadFrame as bad:
            stop = scan.stopped(bad)
        else:
            stop = scan.finished(file.base if frame is None else frame.next_offset)
    emitted = batch.emit(problems)
    if emitted is not None:
        yield emitted
    if stop is not None:
        problems.append(stop)
    if problems:
        yield problems_batch(schema, where, problems, "offset", file.base)
