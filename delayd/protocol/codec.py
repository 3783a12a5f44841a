"""Frame bodies: each event to bytes and back, by hand with ``struct``.

Primitives (little-endian; docs/protocol.md has the grammar of every body)::

    str       := length:u16 utf8:byte[length]
    opt_str   := 0:u8 | 1:u8 str
    opt_i64   := 0:u8 | 1:u8 i64
    queues    := count:u16 queue:u32{count}
    message   := a 14-byte head with the mask and every length, then the bytes they
                 measure, then the optional integers the mask announces (MSG_HEAD)

Decoding trusts nothing: every length is checked against what is left of the body
before it is used, text must be UTF-8, enum values must be known, and the body must be
consumed exactly. Each failure raises RemoteProtocolError naming the command and the
field, never IndexError, struct.error or UnicodeDecodeError.

The message layout is also the broker's commitlog record (docs/broker.md), so this
module has the public functions that work on one message's bytes without decoding it:
``encode_message``, ``decode_message``, ``stamp_message`` (the record of a received
message), ``with_commitlog_offset`` (a record as delivered) and ``message_ints``. There
is one copy of the layout, here.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from operator import itemgetter

from delayd.errors import LocalProtocolError, RemoteProtocolError
from delayd.protocol.codes import (
    CancelOutcome,
    Command,
    ErrorCode,
    RescheduleOutcome,
    ResultCode,
)
from delayd.protocol.events import (
    Cancel,
    CancelBatch,
    CancelBatchResult,
    CancelResult,
    CommitOffset,
    CommitOffsetOk,
    EncodedMessages,
    Error,
    Event,
    Heartbeat,
    HeartbeatResult,
    Hello,
    HelloOk,
    JoinGroup,
    JoinGroupResult,
    Message,
    Pull,
    PullResult,
    Query,
    QueryResult,
    Reschedule,
    RescheduleResult,
    SendBatch,
    SendBatchResult,
    SendResult,
    Stats,
    StatsResult,
)
from delayd.protocol.frames import FLAG_CLOSE, begin_frame, finish_frame

U8 = struct.Struct("<B")
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")
F64 = struct.Struct("<d")
MAX_STR_BYTES = 2**16 - 1  # str lengths are u16
MAX_COUNT_U16 = 2**16 - 1

# A message starts with a fixed head holding every length, so that encoding and decoding
# it take one struct call instead of six (a third of the time of a 100-message batch).
MSG_HEAD = struct.Struct("<HHHHHI")  # mask, message_id, subject, key lengths, properties, body
assert MSG_HEAD.size == 2 + 2 + 2 + 2 + 2 + 4 == 14
# Message mask: which optional fields are present (bits of the u16, in wire order).
MSG_KEY = 0x0001
MSG_AT_MS = 0x0002  # i64
MSG_DELAY_MS = 0x0004  # i64
MSG_STORE_MS = 0x0008  # i64
MSG_COMMITLOG_OFFSET = 0x0010  # u64
MSG_QUEUE = 0x0020  # u32
MSG_QUEUE_OFFSET = 0x0040  # u64
MSG_DUE_MS = 0x0080  # i64
MSG_DISPATCHED_MS = 0x0100  # i64
MSG_KNOWN = 0x01FF
MSG_INT_BITS = MSG_KNOWN & ~MSG_KEY  # the fixed-size integers after the body
# (bit, attribute, struct) for the fixed-size optional fields, in wire order.
MSG_INTS = (
    (MSG_AT_MS, "at_ms", I64),
    (MSG_DELAY_MS, "delay_ms", I64),
    (MSG_STORE_MS, "store_ms", I64),
    (MSG_COMMITLOG_OFFSET, "commitlog_offset", U64),
    (MSG_QUEUE, "queue", U32),
    (MSG_QUEUE_OFFSET, "queue_offset", U64),
    (MSG_DUE_MS, "due_ms", I64),
    (MSG_DISPATCHED_MS, "dispatched_ms", I64),
)
_NO_INTS = (None,) * len(MSG_INTS)


class _IntLayout:
    """The integers one mask announces: their total size, one struct for all of them,
    and how to spread the unpacked values over Message's eight integer fields."""

    __slots__ = ("expand", "size", "struct")

    def __init__(self, mask: int) -> None:
        present = [(bit, fmt) for bit, _, fmt in MSG_INTS if mask & bit]
        self.struct = struct.Struct("<" + "".join(fmt.format[1:] for _, fmt in present))
        self.size = self.struct.size
        # expand(values + (None,)): absent fields pick the None appended at the end.
        order = [bit for bit, _ in present]
        picks = [order.index(bit) if mask & bit else len(order) for bit, _, _ in MSG_INTS]
        self.expand = itemgetter(*picks)


# One layout per combination of integer bits (256 of them), indexed by ``mask >> 1``;
# built up front so that the hot paths do a list lookup, not a dict miss.
_INT_LAYOUTS = [_IntLayout(ints << 1) for ints in range((MSG_INT_BITS >> 1) + 1)]
assert len(_INT_LAYOUTS) == 256 and _INT_LAYOUTS[MSG_INT_BITS >> 1].size == 8 * 7 + 4
_NONE = (None,)

# What the broker adds to a message it stores (docs/broker.md, commitlog record): these
# three integers, in wire order; at_ms, delay_ms and commitlog_offset are never stored.
_STAMP_BITS = MSG_STORE_MS | MSG_QUEUE | MSG_QUEUE_OFFSET
_STAMP = struct.Struct("<qIQ")  # store_ms, queue, queue_offset
_STAMP_KEEPS = MSG_KEY | MSG_DUE_MS | MSG_DISPATCHED_MS
_MASK_BYTES = [U16.pack(mask) for mask in range(MSG_KNOWN + 1)]  # a head's first 2 bytes
# Integers that follow commitlog_offset (queue, queue_offset, due_ms, dispatched_ms).
_AFTER_COMMITLOG_OFFSET = MSG_INT_BITS & ~(2 * MSG_COMMITLOG_OFFSET - 1)
assert _STAMP.size == 8 + 4 + 8

# SendResult: the same idea, bits of a u8 mask.
RES_STORE_MS = 0x01  # i64
RES_COMMITLOG_OFFSET = 0x02  # u64
RES_QUEUE = 0x04  # u32
RES_QUEUE_OFFSET = 0x08  # u64
RES_DUE_MS = 0x10  # i64
RES_KNOWN = 0x1F
_RES_INTS = (
    (RES_STORE_MS, "store_ms", I64),
    (RES_COMMITLOG_OFFSET, "commitlog_offset", U64),
    (RES_QUEUE, "queue", U32),
    (RES_QUEUE_OFFSET, "queue_offset", U64),
    (RES_DUE_MS, "due_ms", I64),
)
# The common result, a stored message with no reason, in one struct call: code, mask,
# reason length 0, store_ms, commitlog_offset, queue, queue_offset [, due_ms].
_RES_STORED = RES_STORE_MS | RES_COMMITLOG_OFFSET | RES_QUEUE | RES_QUEUE_OFFSET
_STORED_RESULT = struct.Struct("<BBHqQIQ")
_STORED_DUE_RESULT = struct.Struct("<BBHqQIQq")
assert _STORED_RESULT.size == 1 + 1 + 2 + 8 + 8 + 4 + 8
# The delay server's accepted message: code, mask, reason length 0, queue_offset (its
# sequence), due_ms.
_RES_SCHEDULED = RES_QUEUE_OFFSET | RES_DUE_MS
_SCHEDULED_RESULT = struct.Struct("<BBHQq")
assert _SCHEDULED_RESULT.size == 1 + 1 + 2 + 8 + 8

QUERY_BY_MESSAGE_ID = 1
QUERY_BY_KEY = 2

STAT_STR = 0
STAT_INT = 1  # i64
STAT_FLOAT = 2  # f64

_RESULT_CODES = {int(c): c for c in ResultCode}
_ERROR_CODES = {int(c): c for c in ErrorCode}
_CANCEL_OUTCOMES = {int(c): c for c in CancelOutcome}
_RESCHEDULE_OUTCOMES = {int(c): c for c in RescheduleOutcome}


# --- encoding -------------------------------------------------------------------------


def _put_str(out: bytearray, value: str, what: str) -> None:
    data = value.encode()
    if len(data) > MAX_STR_BYTES:
        raise LocalProtocolError(
            f"{what} is {len(data)} bytes of UTF-8; the wire allows at most {MAX_STR_BYTES}"
        )
    out += U16.pack(len(data))
    out += data


def _put_opt_str(out: bytearray, value: str | None, what: str) -> None:
    if value is None:
        out.append(0)
    else:
        out.append(1)
        _put_str(out, value, what)


def _put_opt_i64(out: bytearray, value: int | None) -> None:
    if value is None:
        out.append(0)
    else:
        out.append(1)
        out += I64.pack(value)


def _too_long(m: Message, message_id: bytes, subject: bytes, key: bytes) -> LocalProtocolError:
    what, size = next(
        (what, size)
        for what, size in (
            ("message_id", len(message_id)),
            ("subject", len(subject)),
            ("key", len(key)),
            ("number of properties", len(m.properties)),
        )
        if size > MAX_STR_BYTES
    )
    return LocalProtocolError(
        f"message {m.message_id[:100]!r}: {what} is {size} (bytes of UTF-8 for "
        f"text), the wire allows at most {MAX_STR_BYTES}"
    )


def _put_message(out: bytearray, m: Message) -> None:
    ints = (
        m.at_ms,
        m.delay_ms,
        m.store_ms,
        m.commitlog_offset,
        m.queue,
        m.queue_offset,
        m.due_ms,
        m.dispatched_ms,
    )
    mask = 0 if m.key is None else MSG_KEY
    if ints != _NO_INTS:  # the common case, a plain message, skips the loop
        for (bit, _, _), value in zip(MSG_INTS, ints):  # noqa: B905  # both have 8
            if value is not None:
                mask |= bit
    message_id = m.message_id.encode()
    subject = m.subject.encode()
    key = b"" if m.key is None else m.key.encode()
    props = m.properties
    if max(len(message_id), len(subject), len(key), len(props)) > MAX_STR_BYTES:
        raise _too_long(m, message_id, subject, key)
    out += MSG_HEAD.pack(mask, len(message_id), len(subject), len(key), len(props), len(m.body))
    out += message_id
    out += subject
    out += key
    for name, value in props.items():
        _put_str(out, name, "property name")
        _put_str(out, value, "property value")
    out += m.body
    if mask & MSG_INT_BITS:
        out += _INT_LAYOUTS[mask >> 1].struct.pack(*[v for v in ints if v is not None])


def _put_messages(out: bytearray, messages: tuple[Message, ...]) -> None:
    out += U32.pack(len(messages))
    for m in messages:
        _put_message(out, m)


def encode_message(message: Message) -> bytes:
    """One ``message`` of docs/protocol.md, as it appears inside SEND_BATCH, PULL_RESULT
    and QUERY_RESULT bodies (and as the broker's commitlog record payload).

    Raises LocalProtocolError for a message the wire cannot carry (see encode_event).
    """
    out = bytearray()
    try:
        _put_message(out, message)
    except (struct.error, UnicodeEncodeError, TypeError) as exc:
        raise LocalProtocolError(f"cannot encode message: {exc}") from exc
    return bytes(out)


def stamp_message(
    data: bytes, start: int, end: int, store_ms: int, queue: int, queue_offset: int
) -> bytes:
    """The message encoded in ``data[start:end]`` as the broker stores it: ``store_ms``,
    ``queue`` and ``queue_offset`` set to these values, ``at_ms``, ``delay_ms`` and
    ``commitlog_offset`` absent, every other field as it was.

    The bytes are copied, not re-encoded: the head's mask is rewritten, the three integers
    go where their bits put them (after the body, before ``due_ms``/``dispatched_ms``),
    and integers the sender set in their place are dropped. ``data[start:end]`` must be
    one message this codec decoded (SEND_BATCH's ``encoded`` spans) or encoded; the
    result equals ``encode_message`` of the stored Message.
    """
    mask = data[start] | data[start + 1] << 8
    ints = mask & MSG_INT_BITS
    stamp = _STAMP.pack(store_ms, queue, queue_offset)
    if not ints:  # a plain message: the integers go at the very end
        return b"".join((U16.pack(mask | _STAMP_BITS), data[start + 2 : end], stamp))
    body_end = end - _INT_LAYOUTS[ints >> 1].size
    kept = _INT_LAYOUTS[(ints & _STAMP_KEEPS) >> 1].size  # due_ms, dispatched_ms
    return b"".join(
        (
            U16.pack(mask & _STAMP_KEEPS | _STAMP_BITS),
            data[start + 2 : body_end],
            stamp,
            data[end - kept : end],
        )
    )


def stamp_messages(
    data: bytes,
    bounds: tuple[int, ...],
    indices: list[int],
    store_ms: int,
    queues: list[int],
    queue_offsets: list[int],
) -> list[bytes]:
    """``stamp_message`` of message ``indices[j]`` of ``data`` (its span is
    ``bounds[indices[j]]:bounds[indices[j] + 1]``, as in EncodedMessages) into
    ``queues[j]`` at ``queue_offsets[j]``, for every ``j``, all at ``store_ms``: the
    records of a SEND_BATCH in one call (the broker's produce path)."""
    out: list[bytes] = []
    append, pack, join = out.append, _STAMP.pack, b"".join
    for i, queue, queue_offset in zip(indices, queues, queue_offsets, strict=True):
        start = bounds[i]
        end = bounds[i + 1]
        mask = data[start] | data[start + 1] << 8
        if not mask & MSG_INT_BITS:  # a plain message: the integers go at the very end
            stamp = pack(store_ms, queue, queue_offset)
            append(join((_MASK_BYTES[mask | _STAMP_BITS], data[start + 2 : end], stamp)))
        elif mask & _STAMP_KEEPS == mask:
            # Only due_ms and dispatched_ms (a delay server's delivery): they stay last,
            # the stamp goes before them — stamp_message's work without the call.
            tail = end - _INT_LAYOUTS[(mask & MSG_INT_BITS) >> 1].size
            stamp = pack(store_ms, queue, queue_offset)
            append(
                join(
                    (_MASK_BYTES[mask | _STAMP_BITS], data[start + 2 : tail], stamp, data[tail:end])
                )
            )
        else:
            append(stamp_message(data, start, end, store_ms, queue, queue_offset))
    return out


def with_commitlog_offset(data: bytes, commitlog_offset: int) -> bytes:
    """The message encoded in ``data`` (exactly one, well-formed: a stored record) with
    ``commitlog_offset`` set: what a consumer receives. Copies, never re-encodes."""
    mask = data[0] | data[1] << 8
    cut = len(data) - _INT_LAYOUTS[(mask & _AFTER_COMMITLOG_OFFSET) >> 1].size
    offset = U64.pack(commitlog_offset)
    if mask & MSG_COMMITLOG_OFFSET:
        return b"".join((data[: cut - 8], offset, data[cut:]))
    return b"".join((U16.pack(mask | MSG_COMMITLOG_OFFSET), data[2:cut], offset, data[cut:]))


def message_ints(data: bytes) -> tuple[int | None, ...]:
    """The eight optional integers of the message encoded in ``data`` (exactly one) —
    at_ms, delay_ms, store_ms, commitlog_offset, queue, queue_offset, due_ms,
    dispatched_ms, None where the mask has no bit — read from the end without decoding
    the rest.

    Raises ValueError when ``data`` is too short for its head and integers.
    """
    if len(data) < MSG_HEAD.size:
        raise ValueError(f"{len(data)} bytes cannot hold a message head")
    mask, id_len, subject_len, key_len, _, body_len = MSG_HEAD.unpack_from(data)
    layout = _INT_LAYOUTS[(mask & MSG_INT_BITS) >> 1]
    position = len(data) - layout.size
    if position < MSG_HEAD.size + id_len + subject_len + key_len + body_len:
        raise ValueError("message too short for the integers its mask announces")
    return layout.expand(layout.struct.unpack_from(data, position) + _NONE)


def _put_queues(out: bytearray, queues: tuple[int, ...]) -> None:
    if len(queues) > MAX_COUNT_U16:
        raise LocalProtocolError(f"{len(queues)} queues; at most {MAX_COUNT_U16}")
    out += U16.pack(len(queues))
    for q in queues:
        out += U32.pack(q)


def _enc_hello(out: bytearray, e: Hello) -> None:
    out += U16.pack(e.min_version)
    out += U16.pack(e.max_version)
    _put_opt_str(out, e.token, "token")
    _put_str(out, e.client_name, "client_name")


def _enc_hello_ok(out: bytearray, e: HelloOk) -> None:
    out += U16.pack(e.version)
    out += U64.pack(e.max_frame_size)
    _put_str(out, e.server_name, "server_name")


def _enc_send_batch(out: bytearray, e: SendBatch) -> None:
    _put_messages(out, e.messages)


def _enc_send_batch_result(out: bytearray, e: SendBatchResult) -> None:
    out += U32.pack(len(e.results))
    stored, stored_due = _STORED_RESULT.pack, _STORED_DUE_RESULT.pack
    scheduled = _SCHEDULED_RESULT.pack
    for r in e.results:
        store_ms, queue_offset, due_ms = r.store_ms, r.queue_offset, r.due_ms
        if not r.reason and queue_offset is not None:
            # The common results in one struct call each: a message the broker stored,
            # or one the delay server accepted (sequence and due time only).
            offset, queue = r.commitlog_offset, r.queue
            if store_ms is not None and offset is not None and queue is not None:
                if due_ms is None:
                    out += stored(r.code, _RES_STORED, 0, store_ms, offset, queue, queue_offset)
                else:
                    mask = _RES_STORED | RES_DUE_MS
                    out += stored_due(
                        r.code, mask, 0, store_ms, offset, queue, queue_offset, due_ms
                    )
                continue
            if store_ms is None and offset is None and queue is None and due_ms is not None:
                out += scheduled(r.code, _RES_SCHEDULED, 0, queue_offset, due_ms)
                continue
        mask = 0
        for bit, name, _ in _RES_INTS:
            if getattr(r, name) is not None:
                mask |= bit
        out += U8.pack(r.code)
        out += U8.pack(mask)
        _put_str(out, r.reason, "reason")
        for bit, name, fmt in _RES_INTS:
            if mask & bit:
                out += fmt.pack(getattr(r, name))


def _enc_pull(out: bytearray, e: Pull) -> None:
    _put_str(out, e.subject, "subject")
    _put_str(out, e.group, "group")
    _put_str(out, e.consumer_id, "consumer_id")
    out += U32.pack(e.max_messages)
    out += U32.pack(e.wait_ms)


def _enc_messages_response(out: bytearray, e: PullResult | QueryResult) -> None:
    encoded = e.encoded
    if encoded is None:
        _put_messages(out, e.messages)
        return
    if e.messages:
        raise LocalProtocolError(
            f"{type(e).__name__} has both messages and encoded messages; give one of them"
        )
    out += U32.pack(len(encoded.bounds) - 1)
    out += encoded.data[encoded.bounds[0] : encoded.bounds[-1]]


def _enc_commit_offset(out: bytearray, e: CommitOffset) -> None:
    _put_str(out, e.group, "group")
    _put_str(out, e.subject, "subject")
    out += U32.pack(e.queue)
    out += U64.pack(e.offset)
    if e.durable:
        # Optional trailing byte: a periodic commit stays byte for byte what brokers
        # before it understand.
        out += U8.pack(1)


def _enc_empty(out: bytearray, e: Event) -> None:
    pass


def _enc_membership(out: bytearray, e: JoinGroup | Heartbeat) -> None:
    _put_str(out, e.group, "group")
    _put_str(out, e.subject, "subject")
    _put_str(out, e.consumer_id, "consumer_id")


def _enc_assignment(out: bytearray, e: JoinGroupResult | HeartbeatResult) -> None:
    _put_queues(out, e.queues)


def _enc_query(out: bytearray, e: Query) -> None:
    if (e.message_id is None) == (e.key is None):
        raise LocalProtocolError("Query needs exactly one of message_id and key")
    _put_str(out, e.subject, "subject")
    if e.message_id is not None:
        out.append(QUERY_BY_MESSAGE_ID)
        _put_str(out, e.message_id, "message_id")
    else:
        assert e.key is not None
        out.append(QUERY_BY_KEY)
        _put_str(out, e.key, "key")


def _enc_stats_result(out: bytearray, e: StatsResult) -> None:
    out += U32.pack(len(e.stats))
    for name, value in e.stats.items():
        _put_str(out, name, "stat name")
        if isinstance(value, str):
            out.append(STAT_STR)
            _put_str(out, value, f"stat {name!r}")
        elif isinstance(value, int):
            out.append(STAT_INT)
            out += I64.pack(value)
        elif isinstance(value, float):
            out.append(STAT_FLOAT)
            out += F64.pack(value)
        else:
            raise LocalProtocolError(
                f"stat {name!r} is a {type(value).__name__}; only str, int and float travel"
            )


def _enc_cancel(out: bytearray, e: Cancel) -> None:
    _put_str(out, e.message_id, "message_id")


def _enc_cancel_batch(out: bytearray, e: CancelBatch) -> None:
    if len(e.message_ids) > MAX_COUNT_U16:
        raise LocalProtocolError(
            f"CANCEL_BATCH of {len(e.message_ids)} ids; the wire allows at most {MAX_COUNT_U16}"
        )
    out += U16.pack(len(e.message_ids))
    for message_id in e.message_ids:
        _put_str(out, message_id, "message_id")


def _enc_cancel_batch_result(out: bytearray, e: CancelBatchResult) -> None:
    if len(e.results) > MAX_COUNT_U16:
        raise LocalProtocolError(
            f"CANCEL_BATCH_RESULT of {len(e.results)}; the wire allows at most {MAX_COUNT_U16}"
        )
    out += U16.pack(len(e.results))
    for outcome, dispatched_ms in e.results:
        out.append(outcome)
        _put_opt_i64(out, dispatched_ms)


def _enc_outcome(out: bytearray, e: CancelResult | RescheduleResult) -> None:
    out += U8.pack(e.outcome)
    _put_opt_i64(out, e.dispatched_ms)


def _enc_reschedule(out: bytearray, e: Reschedule) -> None:
    _put_str(out, e.message_id, "message_id")
    out += I64.pack(e.at_ms)


def _enc_error(out: bytearray, e: Error) -> None:
    out += U16.pack(e.code)
    _put_str(out, e.reason, "reason")


_ENCODERS: dict[type[Event], Callable[[bytearray, Event], None]] = {
    Hello: _enc_hello,
    HelloOk: _enc_hello_ok,
    SendBatch: _enc_send_batch,
    SendBatchResult: _enc_send_batch_result,
    Pull: _enc_pull,
    PullResult: _enc_messages_response,
    CommitOffset: _enc_commit_offset,
    CommitOffsetOk: _enc_empty,
    JoinGroup: _enc_membership,
    JoinGroupResult: _enc_assignment,
    Heartbeat: _enc_membership,
    HeartbeatResult: _enc_assignment,
    Query: _enc_query,
    QueryResult: _enc_messages_response,
    Stats: _enc_empty,
    StatsResult: _enc_stats_result,
    Cancel: _enc_cancel,
    CancelResult: _enc_outcome,
    CancelBatch: _enc_cancel_batch,
    CancelBatchResult: _enc_cancel_batch_result,
    Reschedule: _enc_reschedule,
    RescheduleResult: _enc_outcome,
    Error: _enc_error,
}  # type: ignore[dict-item]  # each encoder takes its own event type


def encode_event(event: Event) -> bytes:
    """The complete frame for ``event`` (no size limit or state checks: see Connection).

    Raises LocalProtocolError for an event the wire cannot carry: a string over 65535
    bytes of UTF-8 or not encodable as UTF-8, an integer out of its field's range, a
    Query with both or neither of message_id and key.
    """
    encoder = _ENCODERS.get(type(event))
    if encoder is None:
        raise LocalProtocolError(f"{type(event).__name__} is not an event that can be sent")
    out = begin_frame()
    try:
        encoder(out, event)
    except (struct.error, UnicodeEncodeError, TypeError) as exc:
        raise LocalProtocolError(f"cannot encode {type(event).__name__}: {exc}") from exc
    flags = FLAG_CLOSE if isinstance(event, Error) and event.close else 0
    return finish_frame(out, event.command, event.request_id, flags)  # type: ignore[attr-defined]


# --- decoding -------------------------------------------------------------------------


class _Reader:
    """A cursor over one frame body; every read checks the bytes left first."""

    __slots__ = ("body", "end", "name", "pos", "request_id")

    def __init__(self, body: bytes, name: str, request_id: int) -> None:
        self.body = body
        self.pos = 0
        self.end = len(body)
        self.name = name
        self.request_id = request_id

    def error(self, problem: str) -> RemoteProtocolError:
        return RemoteProtocolError(
            f"malformed {self.name} body at byte {self.pos}: {problem}",
            code=ErrorCode.MALFORMED,
            request_id=self.request_id,
        )

    def _short(self, what: str, need: int) -> RemoteProtocolError:
        return self.error(f"{what} needs {need} bytes, only {self.end - self.pos} left")

    def fixed(self, fmt: struct.Struct, what: str) -> int:
        pos = self.pos
        if self.end - pos < fmt.size:
            raise self._short(what, fmt.size)
        self.pos = pos + fmt.size
        return fmt.unpack_from(self.body, pos)[0]

    def u8(self, what: str) -> int:
        if self.pos >= self.end:
            raise self._short(what, 1)
        self.pos += 1
        return self.body[self.pos - 1]

    def flag(self, what: str) -> bool:
        value = self.u8(what)
        if value > 1:
            raise self.error(f"{what} presence byte is {value}, must be 0 or 1")
        return value == 1

    def text(self, what: str) -> str:
        pos = self.pos
        if self.end - pos < 2:
            raise self._short(f"length of {what}", 2)
        (n,) = U16.unpack_from(self.body, pos)
        pos += 2
        if self.end - pos < n:
            self.pos = pos
            raise self._short(what, n)
        try:
            value = self.body[pos : pos + n].decode()
        except UnicodeDecodeError as exc:
            raise self.error(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
        self.pos = pos + n
        return value

    def opt_str(self, what: str) -> str | None:
        return self.text(what) if self.flag(what) else None

    def opt_i64(self, what: str) -> int | None:
        return self.fixed(I64, what) if self.flag(what) else None

    def enum(self, table: dict[int, object], value: int, what: str) -> object:
        member = table.get(value)
        if member is None:
            raise self.error(f"unknown {what} {value}")
        return member

    def finish(self) -> None:
        if self.pos != self.end:
            raise self.error(f"{self.end - self.pos} trailing bytes after the last field")


class _Short(Exception):
    """Inside _get_message: ``what`` at byte ``pos`` needs ``need`` bytes, more than are
    left."""

    def __init__(self, what: str, need: int, pos: int) -> None:
        self.what = what
        self.need = need
        self.pos = pos


class _Bad(Exception):
    """Inside _get_message: any other violation of the grammar, found at byte ``pos``."""

    def __init__(self, problem: str, pos: int) -> None:
        self.problem = problem
        self.pos = pos


class _MessageBuilder:
    """Builds a Message faster than its frozen dataclass __init__ (which assigns each of
    13 fields through object.__setattr__, 1.4 us per Message; this takes 0.3 us, and
    decoding a PULL_RESULT is mostly building Messages).

    An instance of this plain class with Message's exact slots is filled by ordinary
    attribute stores, then becomes a Message by ``__class__`` assignment, which CPython
    allows between classes of identical layout. The result is an ordinary Message
    (frozen from that moment; Message has no __post_init__ to skip).
    """

    __slots__ = Message.__slots__

    def __init__(self, message_id, subject, key, properties, body, ints) -> None:
        self.message_id = message_id
        self.subject = subject
        self.key = key
        self.properties = properties
        self.body = body
        (
            self.at_ms,
            self.delay_ms,
            self.store_ms,
            self.commitlog_offset,
            self.queue,
            self.queue_offset,
            self.due_ms,
            self.dispatched_ms,
        ) = ints
        self.__class__ = Message  # type: ignore[assignment]


class _SendResultBuilder:
    """SendResult's fields by plain stores, as _MessageBuilder (one per stored message)."""

    __slots__ = SendResult.__slots__

    def __init__(
        self,
        code: ResultCode,
        reason: str = "",
        store_ms: int | None = None,
        commitlog_offset: int | None = None,
        queue: int | None = None,
        queue_offset: int | None = None,
        due_ms: int | None = None,
    ) -> None:
        self.code = code
        self.reason = reason
        self.store_ms = store_ms
        self.commitlog_offset = commitlog_offset
        self.queue = queue
        self.queue_offset = queue_offset
        self.due_ms = due_ms
        self.__class__ = SendResult  # type: ignore[assignment]


assert [f.name for f in dataclasses.fields(Message)][5:] == [a for _, a, _ in MSG_INTS]
assert Message.__slots__ == tuple(f.name for f in dataclasses.fields(Message))
assert SendResult.__slots__ == tuple(f.name for f in dataclasses.fields(SendResult))


new_send_result: Callable[..., SendResult] = _SendResultBuilder  # type: ignore[assignment]
"""``new_send_result(code, reason="", store_ms=None, commitlog_offset=None, queue=None,
queue_offset=None, due_ms=None)``: ``SendResult(...)`` built the faster way (the class
call itself, no wrapper: a broker makes one per stored message)."""


def _get_properties(r: _Reader, pos: int, count: int) -> tuple[dict[str, str], int]:
    body, end = r.body, r.end
    properties: dict[str, str] = {}
    for _ in range(count):
        if end - pos < 2:
            raise _Short("length of property name", 2, pos)
        (n,) = U16.unpack_from(body, pos)
        pos += 2
        if end - pos < n + 2:
            raise _Short("property name and value length", n + 2, pos)
        name = body[pos : pos + n].decode()
        pos += n
        (n,) = U16.unpack_from(body, pos)
        pos += 2
        if end - pos < n:
            raise _Short("property value", n, pos)
        if name in properties:
            raise _Bad(f"property {name!r} appears twice", pos)
        properties[name] = body[pos : pos + n].decode()
        pos += n
    return properties, pos


def _get_message(r: _Reader) -> Message:
    # The hot path of SEND_BATCH, PULL and QUERY, so it reads the body with local
    # variables instead of _Reader calls (about twice as fast); the checks are the same.
    body, pos, end = r.body, r.pos, r.end
    try:
        if end - pos < 14:  # MSG_HEAD.size
            raise _Short("message head", MSG_HEAD.size, pos)
        mask, id_len, subject_len, key_len, count, body_len = MSG_HEAD.unpack_from(body, pos)
        pos += 14
        if mask & ~MSG_KNOWN:
            raise _Bad(f"unknown message field bits 0x{mask & ~MSG_KNOWN:04x}", pos)
        if key_len and not mask & MSG_KEY:
            raise _Bad(f"key length {key_len} for a message without a key", pos)
        subject_at = pos + id_len
        key_at = subject_at + subject_len
        text_end = key_at + key_len
        if text_end > end:
            raise _Short("message_id, subject and key", text_end - pos, pos)
        message_id = body[pos:subject_at].decode()
        subject = body[subject_at:key_at].decode()
        key = body[key_at:text_end].decode() if mask & MSG_KEY else None
        pos = text_end
        if count:
            properties, pos = _get_properties(r, pos, count)
        else:
            properties = {}
        body_end = pos + body_len
        if body_end > end:
            raise _Short("body", body_len, pos)
        data = body[pos:body_end]
        pos = body_end
        if mask & MSG_INT_BITS:
            layout = _INT_LAYOUTS[(mask & MSG_INT_BITS) >> 1]
            if end - pos < layout.size:
                raise _short_int(mask, end - pos, pos)
            ints = layout.expand(layout.struct.unpack_from(body, pos) + _NONE)
            pos += layout.size
        else:
            ints = _NO_INTS
    except _Short as exc:
        r.pos = exc.pos
        raise r.error(f"{exc.what} needs {exc.need} bytes, only {end - exc.pos} left") from None
    except _Bad as exc:
        r.pos = exc.pos
        raise r.error(exc.problem) from None
    except UnicodeDecodeError as exc:
        r.pos = pos
        raise r.error(f"a string is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    r.pos = pos
    return _MessageBuilder(message_id, subject, key, properties, data, ints)  # type: ignore[return-value]


def _short_int(mask: int, left: int, pos: int) -> _Short:
    """Which of the integers ``mask`` announces does not fit in ``left`` bytes."""
    for bit, attr, fmt in MSG_INTS:
        if mask & bit:
            if left < fmt.size:
                return _Short(attr, fmt.size, pos)
            left -= fmt.size
            pos += fmt.size
    raise AssertionError("the integers fit")


def _get_messages(r: _Reader) -> tuple[Message, ...]:
    count = r.fixed(U32, "message count")
    # A message takes at least its head; checking first refuses a lying count at once.
    if count * MSG_HEAD.size > r.end - r.pos:
        raise r.error(f"{count} messages cannot fit in {r.end - r.pos} bytes")
    return tuple([_get_message(r) for _ in range(count)])


def decode_message(data: bytes, start: int = 0, end: int | None = None) -> Message:
    """The Message encoded in ``data[start:end]``, which must hold exactly one.

    Raises RemoteProtocolError (code MALFORMED) when it does not.
    """
    r = _Reader(data, "message", 0)
    r.pos = start
    if end is not None:
        r.end = end
    message = _get_message(r)
    r.finish()
    return message


def _get_queues(r: _Reader) -> tuple[int, ...]:
    count = r.fixed(U16, "queue count")
    return tuple(r.fixed(U32, "queue") for _ in range(count))


def _dec_hello(r: _Reader) -> Hello:
    min_version = r.fixed(U16, "min_version")
    max_version = r.fixed(U16, "max_version")
    token = r.opt_str("token")
    client_name = r.text("client_name")
    return Hello(token, client_name, min_version, max_version, request_id=r.request_id)


def _dec_hello_ok(r: _Reader) -> HelloOk:
    version = r.fixed(U16, "version")
    max_frame_size = r.fixed(U64, "max_frame_size")
    return HelloOk(version, r.text("server_name"), max_frame_size, request_id=r.request_id)


def _dec_send_batch(r: _Reader) -> SendBatch:
    count = r.fixed(U32, "message count")
    if count * MSG_HEAD.size > r.end - r.pos:
        raise r.error(f"{count} messages cannot fit in {r.end - r.pos} bytes")
    # Where each message starts and ends, so that a broker can store the bytes as they
    # arrived instead of encoding the Messages again (stamp_message).
    bounds = [r.pos]
    messages = []
    for _ in range(count):
        messages.append(_get_message(r))
        bounds.append(r.pos)
    encoded = EncodedMessages(r.body, tuple(bounds))
    return SendBatch(tuple(messages), encoded=encoded, request_id=r.request_id)


def _dec_send_batch_result(r: _Reader) -> SendBatchResult:
    count = r.fixed(U32, "result count")
    if count * 4 > r.end - r.pos:  # code, mask, reason length: at least 4 bytes each
        raise r.error(f"{count} results cannot fit in {r.end - r.pos} bytes")
    results = []
    body, end = r.body, r.end
    stored, size = _STORED_RESULT, _STORED_RESULT.size
    scheduled, scheduled_size = _SCHEDULED_RESULT, _SCHEDULED_RESULT.size
    for _ in range(count):
        pos = r.pos
        # The common results (stored by a broker, or accepted by a delay server; no
        # reason) in one struct call each.
        if end - pos >= size and body[pos + 1] == _RES_STORED and body[pos] in _RESULT_CODES:
            code, _, reason_len, store_ms, offset, queue, queue_offset = stored.unpack_from(
                body, pos
            )
            if not reason_len:
                r.pos = pos + size
                results.append(
                    _SendResultBuilder(
                        _RESULT_CODES[code], "", store_ms, offset, queue, queue_offset, None
                    )
                )
                continue
        if (
            end - pos >= scheduled_size
            and body[pos + 1] == _RES_SCHEDULED
            and body[pos] in _RESULT_CODES
        ):
            code, _, reason_len, queue_offset, due_ms = scheduled.unpack_from(body, pos)
            if not reason_len:
                r.pos = pos + scheduled_size
                results.append(
                    _SendResultBuilder(
                        _RESULT_CODES[code], "", None, None, None, queue_offset, due_ms
                    )
                )
                continue
        code = r.enum(_RESULT_CODES, r.u8("result code"), "result code")
        mask = r.u8("result field mask")
        if mask & ~RES_KNOWN:
            raise r.error(f"unknown result field bits 0x{mask & ~RES_KNOWN:02x}")
        reason = r.text("reason")
        ints = [r.fixed(fmt, name) if mask & bit else None for bit, name, fmt in _RES_INTS]
        results.append(_SendResultBuilder(code, reason, *ints))
    return SendBatchResult(tuple(results), request_id=r.request_id)


def _dec_pull(r: _Reader) -> Pull:
    subject = r.text("subject")
    group = r.text("group")
    consumer_id = r.text("consumer_id")
    max_messages = r.fixed(U32, "max_messages")
    wait_ms = r.fixed(U32, "wait_ms")
    return Pull(subject, group, consumer_id, max_messages, wait_ms, request_id=r.request_id)


def _dec_pull_result(r: _Reader) -> PullResult:
    return PullResult(_get_messages(r), request_id=r.request_id)


def _dec_commit_offset(r: _Reader) -> CommitOffset:
    group = r.text("group")
    subject = r.text("subject")
    queue = r.fixed(U32, "queue")
    offset = r.fixed(U64, "offset")
    durable = r.flag("durable") if r.pos < r.end else False
    return CommitOffset(group, subject, queue, offset, durable, request_id=r.request_id)


def _dec_commit_offset_ok(r: _Reader) -> CommitOffsetOk:
    return CommitOffsetOk(request_id=r.request_id)


def _dec_join_group(r: _Reader) -> JoinGroup:
    group, subject = r.text("group"), r.text("subject")
    return JoinGroup(group, subject, r.text("consumer_id"), request_id=r.request_id)


def _dec_join_group_result(r: _Reader) -> JoinGroupResult:
    return JoinGroupResult(_get_queues(r), request_id=r.request_id)


def _dec_heartbeat(r: _Reader) -> Heartbeat:
    group, subject = r.text("group"), r.text("subject")
    return Heartbeat(group, subject, r.text("consumer_id"), request_id=r.request_id)


def _dec_heartbeat_result(r: _Reader) -> HeartbeatResult:
    return HeartbeatResult(_get_queues(r), request_id=r.request_id)


def _dec_query(r: _Reader) -> Query:
    subject = r.text("subject")
    by = r.u8("query kind")
    if by == QUERY_BY_MESSAGE_ID:
        return Query(subject, message_id=r.text("message_id"), request_id=r.request_id)
    if by == QUERY_BY_KEY:
        return Query(subject, key=r.text("key"), request_id=r.request_id)
    raise r.error(f"unknown query kind {by}")


def _dec_query_result(r: _Reader) -> QueryResult:
    return QueryResult(_get_messages(r), request_id=r.request_id)


def _dec_stats(r: _Reader) -> Stats:
    return Stats(request_id=r.request_id)


def _dec_stats_result(r: _Reader) -> StatsResult:
    count = r.fixed(U32, "stat count")
    stats: dict[str, str | int | float] = {}
    for _ in range(count):
        name = r.text("stat name")
        if name in stats:
            raise r.error(f"stat {name!r} appears twice")
        kind = r.u8("stat kind")
        if kind == STAT_STR:
            stats[name] = r.text(f"stat {name!r}")
        elif kind == STAT_INT:
            stats[name] = r.fixed(I64, f"stat {name!r}")
        elif kind == STAT_FLOAT:
            stats[name] = r.fixed(F64, f"stat {name!r}")
        else:
            raise r.error(f"unknown kind {kind} of stat {name!r}")
    return StatsResult(stats, request_id=r.request_id)


def _dec_cancel(r: _Reader) -> Cancel:
    return Cancel(r.text("message_id"), request_id=r.request_id)


def _dec_cancel_result(r: _Reader) -> CancelResult:
    outcome = r.enum(_CANCEL_OUTCOMES, r.u8("outcome"), "cancel outcome")
    dispatched_ms = r.opt_i64("dispatched_ms")
    return CancelResult(outcome, dispatched_ms, request_id=r.request_id)  # type: ignore[arg-type]


def _dec_cancel_batch(r: _Reader) -> CancelBatch:
    count = r.fixed(U16, "id count")
    ids = tuple([r.text("message_id") for _ in range(count)])
    return CancelBatch(ids, request_id=r.request_id)


def _dec_cancel_batch_result(r: _Reader) -> CancelBatchResult:
    count = r.fixed(U16, "result count")
    results = []
    for _ in range(count):
        outcome = r.enum(_CANCEL_OUTCOMES, r.u8("outcome"), "cancel outcome")
        results.append((outcome, r.opt_i64("dispatched_ms")))
    return CancelBatchResult(tuple(results), request_id=r.request_id)  # type: ignore[arg-type]


def _dec_reschedule(r: _Reader) -> Reschedule:
    message_id = r.text("message_id")
    return Reschedule(message_id, r.fixed(I64, "at_ms"), request_id=r.request_id)


def _dec_reschedule_result(r: _Reader) -> RescheduleResult:
    outcome = r.enum(_RESCHEDULE_OUTCOMES, r.u8("outcome"), "reschedule outcome")
    dispatched_ms = r.opt_i64("dispatched_ms")
    return RescheduleResult(outcome, dispatched_ms, request_id=r.request_id)  # type: ignore[arg-type]


def _dec_error(r: _Reader) -> Error:
    code = r.enum(_ERROR_CODES, r.fixed(U16, "error code"), "error code")
    return Error(code, r.text("reason"), request_id=r.request_id)  # type: ignore[arg-type]


_DECODERS: dict[Command, Callable[[_Reader], Event]] = {
    Command.HELLO: _dec_hello,
    Command.HELLO_OK: _dec_hello_ok,
    Command.SEND_BATCH: _dec_send_batch,
    Command.SEND_BATCH_RESULT: _dec_send_batch_result,
    Command.PULL: _dec_pull,
    Command.PULL_RESULT: _dec_pull_result,
    Command.COMMIT_OFFSET: _dec_commit_offset,
    Command.COMMIT_OFFSET_OK: _dec_commit_offset_ok,
    Command.JOIN_GROUP: _dec_join_group,
    Command.JOIN_GROUP_RESULT: _dec_join_group_result,
    Command.HEARTBEAT: _dec_heartbeat,
    Command.HEARTBEAT_RESULT: _dec_heartbeat_result,
    Command.QUERY: _dec_query,
    Command.QUERY_RESULT: _dec_query_result,
    Command.STATS: _dec_stats,
    Command.STATS_RESULT: _dec_stats_result,
    Command.CANCEL: _dec_cancel,
    Command.CANCEL_RESULT: _dec_cancel_result,
    Command.CANCEL_BATCH: _dec_cancel_batch,
    Command.CANCEL_BATCH_RESULT: _dec_cancel_batch_result,
    Command.RESCHEDULE: _dec_reschedule,
    Command.RESCHEDULE_RESULT: _dec_reschedule_result,
    Command.ERROR: _dec_error,
}
assert set(_DECODERS) == set(Command), "every command needs a decoder"
assert {cls.command for cls in _ENCODERS} == set(Command), "every command needs an encoder"  # type: ignore[attr-defined]


def decode_event(command: Command, flags: int, request_id: int, body: bytes) -> Event:
    """The event a frame carries (its header fields already checked by FrameDecoder).

    Raises RemoteProtocolError for a body that does not follow its command's grammar,
    or for flags the command does not allow.
    """
    r = _Reader(body, command.name, request_id)
    if flags and command is not Command.ERROR:
        raise r.error(f"flags 0x{flags:04x} are only allowed on ERROR")
    event = _DECODERS[command](r)
    r.finish()
    if flags & FLAG_CLOSE:
        assert isinstance(event, Error)
        return Error(event.code, event.reason, close=True, request_id=request_id)
    return event
