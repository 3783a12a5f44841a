"""schedule_log and message_log files as Arrow batches: the records that carry a message.

A SCHEDULED record is ``message_log_offset`` followed by the MESSAGE payload, so both
logs are read by one loop. Frames come from storage.scan.scan_frames (every CRC
checked, via frames.FileScan); the message head is read with the codec's own struct
(``schedule_log.PREFIX`` + ``message_log.HEAD``), and only the fields the audit needs
are taken: offsets, times, sequence, id, subject, key and the body's size. Properties
and bodies are not decoded.

message_log also holds cancel and reschedule tombstones (docs/cancel.md). Each goes
through its codec (delayd.logs.tombstone), one at a time, into a row whose ``kind``
says what it is (``cancel``, ``reschedule``; a message's is ``message``) and whose
sequence, subject, key and body_size are null.

Two modes, option ``verify``:

* ``head`` (default): the loop checks what the codec checks of the head — known flags,
  the key flag, lengths that add up to the payload — and leaves UTF-8 to Arrow, which
  validates a whole column at once. A record that fails any of it goes to the codec
  (``decode_scheduled`` / ``decode_message``), whose RecordFormatError becomes a
  ``format`` row naming the reason; the codec decides, never this loop.
* ``full``: every record is decoded by the codec, properties included (about five
  times slower). The tests check that both modes give the same batches.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence

import pyarrow as pa

from delayd.audit.batches import BATCH_ROWS, bucket_value, build, problems_batch
from delayd.audit.files import LogFile
from delayd.audit.frames import FileScan, Problem
from delayd.audit.kinds import FORMAT, HEAD, VERIFY_MODES
from delayd.audit.schemas import MESSAGE_LOG, SCHEDULE_LOG, select
from delayd.logs import message_log, schedule_log, tombstone
from delayd.logs.message_log import FLAG_KEY, KNOWN_FLAGS, MessageRecord, RecordFormatError
from delayd.logs.tombstone import Tombstone
from storage.scan import BadFrame

# The head of each record as one struct, composed from the codecs' own formats.
_SCHEDULED_HEAD = struct.Struct("<" + schedule_log.PREFIX.format[1:] + message_log.HEAD.format[1:])
assert _SCHEDULED_HEAD.size == schedule_log.HEAD_SIZE
_MESSAGE_HEAD = message_log.HEAD
# message_log's ``kind`` column, indexed by the frame's type byte (for Arrow's take()).
_KIND_TYPES = (message_log.TYPE_MESSAGE, *message_log.TOMBSTONE_TYPES)
_KIND_NAMES = pa.array(
    [message_log.describe_type(t) if t in _KIND_TYPES else None for t in range(256)], pa.string()
)

Decoded = tuple[int | None, MessageRecord | Tombstone]  # message_log_offset (None), record


class _Shape:
    """What differs between the two logs: the record type, the head struct, whether a
    message_log offset leads the head, and the codec."""

    def __init__(
        self,
        rtype: int,
        head: struct.Struct,
        prefixed: bool,
        decode: Callable[[int, bytes], Decoded],
        check_type: Callable[[int, str, int], None],
    ) -> None:
        self.rtype = rtype
        self.head = head
        self.prefixed = prefixed
        self.decode = decode
        self.check_type = check_type


def _decode_scheduled(rtype: int, payload: bytes) -> Decoded:
    record = schedule_log.decode_scheduled(payload)
    return record.message_log_offset, record.message


def _decode_message(rtype: int, payload: bytes) -> Decoded:
    if rtype in message_log.TOMBSTONE_TYPES:
        return None, tombstone.decode(rtype, payload)
    return None, message_log.decode_message(payload)


SCHEDULE = _Shape(
    schedule_log.TYPE_SCHEDULED,
    _SCHEDULED_HEAD,
    True,
    _decode_scheduled,
    schedule_log.check_type,
)
MESSAGE = _Shape(
    message_log.TYPE_MESSAGE,
    _MESSAGE_HEAD,
    False,
    _decode_message,
    message_log.check_type,
)


def schedule_batches(
    file: LogFile,
    server: str,
    *,
    verify: str = HEAD,
    batch_rows: int = BATCH_ROWS,
    columns: Sequence[str] | None = None,
) -> Iterator[pa.RecordBatch]:
    """The SCHEDULED records of one schedule_log bucket file (SCHEDULE_LOG schema, or
    its ``columns``), then one row per problem found."""
    return _batches(SCHEDULE, file, server, verify, batch_rows, select(SCHEDULE_LOG, columns))


def message_batches(
    file: LogFile,
    server: str,
    *,
    verify: str = HEAD,
    batch_rows: int = BATCH_ROWS,
    columns: Sequence[str] | None = None,
) -> Iterator[pa.RecordBatch]:
    """The records of one message_log segment — messages and tombstones (MESSAGE_LOG
    schema, or its ``columns``), then one row per problem found."""
    return _batches(MESSAGE, file, server, verify, batch_rows, select(MESSAGE_LOG, columns))


# A record collected for a batch: offset, frame type, head tuple, id, subject and key
# bytes (key None when absent; subject None for a tombstone), and the payload (kept for
# the codec when a text is not UTF-8).
_Row = tuple[int, int, tuple, bytes, bytes | None, bytes | None, bytes]


def _batches(
    shape: _Shape, file: LogFile, server: str, verify: str, batch_rows: int, schema: pa.Schema
) -> Iterator[pa.RecordBatch]:
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
    where = {"server": server, "file": file.name}
    if shape.prefixed:
        where["bucket"] = bucket_value(file.bucket_ms)
    problems: list[Problem] = []
    fast = verify == HEAD
    unpack = shape.head.unpack_from
    head_size = shape.head.size
    rtype = shape.rtype
    flags_at = 4 if shape.prefixed else 3  # index of flags in the head tuple
    rows: list[_Row] = []
    append = rows.append
    room = batch_rows
    with FileScan(file) as scan:
        next_offset = file.base
        try:
            # Once per record of every file audited: locals only, one append each.
            # (next_offset is read after the loop: where the scan ran out.)
            for offset, record_type, payload, next_offset in scan.frames:  # noqa: B007
                size = len(payload)
                head = (
                    unpack(payload) if fast and record_type == rtype and size >= head_size else None
                )
                if head is not None:
                    flags, id_len, subject_len, key_len, props_len, body_len = head[flags_at:]
                    if (
                        flags & ~KNOWN_FLAGS
                        or (key_len and not flags & FLAG_KEY)
                        or head_size + id_len + subject_len + key_len + props_len + body_len != size
                    ):
                        head = None  # the codec says what is wrong with it
                if head is None:
                    _slow(shape, file, record_type, offset, payload, rows, problems)
                else:
                    subject_at = head_size + id_len
                    key_at = subject_at + subject_len
                    append(
                        (
                            offset,
                            record_type,
                            head,
                            payload[head_size:subject_at],
                            payload[subject_at:key_at],
                            payload[key_at : key_at + key_len] if flags & FLAG_KEY else None,
                            payload,
                        )
                    )
                room -= 1
                if not room:
                    yield from _emit(shape, schema, rows, where, problems, file)
                    rows.clear()
                    room = batch_rows
        except BadFrame as bad:
            stop = scan.stopped(bad)
        else:
            stop = scan.finished(next_offset)
    if rows:
        yield from _emit(shape, schema, rows, where, problems, file)
    if stop is not None:
        problems.append(stop)
    if problems:
        yield problems_batch(schema, where, problems, "offset", file.base)


def _slow(
    shape: _Shape,
    file: LogFile,
    rtype: int,
    offset: int,
    payload: bytes,
    rows: list[_Row],
    problems: list[Problem],
) -> None:
    """Decode one record with the codec: into ``rows`` when it is valid, into
    ``problems`` (a ``format`` problem) when the codec refuses it."""
    try:
        shape.check_type(rtype, file.path, offset)
        message_log_offset, message = shape.decode(rtype, payload)
    except RecordFormatError as exc:
        problems.append(Problem(FORMAT, offset - file.base, exc.reason))
        return
    if isinstance(message, Tombstone):  # message_log only; no sequence, no body
        head = (message.due_ms, None, message.receive_ms, 0, 0, 0, 0, 0, None)
        rows.append((offset, rtype, head, message.message_id.encode(), None, None, payload))
        return
    # A head tuple as the fast path unpacks it; of flags and lengths only body_len
    # (the last) is read back.
    head = (message.due_ms, message.sequence, message.receive_ms, 0, 0, 0, 0, 0, len(message.body))
    if shape.prefixed:
        head = (message_log_offset, *head)
    key = None if message.key is None else message.key.encode()
    rows.append(
        (offset, rtype, head, message.message_id.encode(), message.subject.encode(), key, payload)
    )


def _emit(
    shape: _Shape,
    schema: pa.Schema,
    rows: list[_Row],
    where: dict,
    problems: list[Problem],
    file: LogFile,
) -> Iterator[pa.RecordBatch]:
    """The batch of ``rows``. When a text is not UTF-8, Arrow refuses the column; the
    records then go through the codec one by one, which names the bad ones."""
    offsets, rtypes, heads, ids, subjects, keys, payloads = zip(*rows, strict=True)
    try:
        texts = [
            pa.array(values, pa.binary()).cast(pa.string()) for values in (ids, subjects, keys)
        ]
    except pa.ArrowInvalid:
        retry: list[_Row] = []
        for offset, rtype, payload in zip(offsets, rtypes, payloads, strict=True):
            _slow(shape, file, rtype, offset, payload, retry, problems)
        if retry:
            yield from _emit(shape, schema, retry, where, problems, file)
        return
    values = dict(where)
    values["offset"] = offsets
    if "kind" in schema.names:
        values["kind"] = _KIND_NAMES.take(pa.array(rtypes, pa.uint8()))
    first = 1 if shape.prefixed else 0  # where due_ms is in the head tuple
    fields = {"due_ms": first, "sequence": first + 1, "receive_ms": first + 2, "body_size": -1}
    if shape.prefixed:
        fields["message_log_offset"] = 0
    for name, index in fields.items():
        if name in schema.names:  # only the columns asked for
            values[name] = [head[index] for head in heads]
    values["message_id"], values["subject"], values["key"] = texts
    yield build(schema, len(offsets), values)
