"""Event bodies: each event to the bytes of its frame's body and back, by hand with
``struct`` (docs/protocol.md has the grammar of every body).

Bodies are built of the primitives (str, opt_str, opt_i64, u8..u64; delayd.protocol.
primitives) and of messages (delayd.protocol.message_layout), plus::

    queues    := count:u16 queue:u32{count}

Decoding trusts nothing: enum values must be known and the body must be consumed
exactly, besides the checks of the primitives. Each failure raises RemoteProtocolError
naming the command and the field.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable

from delayd.errors import LocalProtocolError
from delayd.protocol import events as ev
from delayd.protocol.codes import (
    CancelOutcome,
    Command,
    ErrorCode,
    RescheduleOutcome,
    ResultCode,
)
from delayd.protocol.events import Error, Event, SendResult
from delayd.protocol.frames import FLAG_CLOSE, begin_frame, finish_frame
from delayd.protocol.message_layout import get_messages, put_messages
from delayd.protocol.primitives import (
    F64,
    I64,
    MAX_COUNT_U16,
    U8,
    U16,
    U32,
    U64,
    BodyReader,
    put_opt_i64,
    put_opt_str,
    put_str,
)

# SendResult: which optional integers are present, bits of a u8 mask (as a message's).
RES_STORE_MS = 0x01  # i64
RES_COMMITLOG_OFFSET = 0x02  # u64
RES_QUEUE = 0x04  # u32
RES_QUEUE_OFFSET = 0x08  # u64
RES_DUE_MS = 0x10  # i64
RES_KNOWN = 0x1F
RES_INTS = (
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


def _put_queues(out: bytearray, queues: tuple[int, ...]) -> None:
    if len(queues) > MAX_COUNT_U16:
        raise LocalProtocolError(f"{len(queues)} queues; at most {MAX_COUNT_U16}")
    out += U16.pack(len(queues))
    for q in queues:
        out += U32.pack(q)


def _enc_hello(out: bytearray, e: ev.Hello) -> None:
    out += U16.pack(e.min_version)
    out += U16.pack(e.max_version)
    put_opt_str(out, e.token, "token")
    put_str(out, e.client_name, "client_name")


def _enc_hello_ok(out: bytearray, e: ev.HelloOk) -> None:
    out += U16.pack(e.version)
    out += U64.pack(e.max_frame_size)
    put_str(out, e.server_name, "server_name")


def _enc_send_batch(out: bytearray, e: ev.SendBatch) -> None:
    put_messages(out, e.messages)


def _enc_send_batch_result(out: bytearray, e: ev.SendBatchResult) -> None:
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
        for bit, name, _ in RES_INTS:
            if getattr(r, name) is not None:
                mask |= bit
        out += U8.pack(r.code)
        out += U8.pack(mask)
        put_str(out, r.reason, "reason")
        for bit, name, fmt in RES_INTS:
            if mask & bit:
                out += fmt.pack(getattr(r, name))


def _enc_pull(out: bytearray, e: ev.Pull) -> None:
    put_str(out, e.subject, "subject")
    put_str(out, e.group, "group")
    put_str(out, e.consumer_id, "consumer_id")
    out += U32.pack(e.max_messages)
    out += U32.pack(e.wait_ms)


def _enc_messages_response(out: bytearray, e: ev.PullResult | ev.QueryResult) -> None:
    encoded = e.encoded
    if encoded is None:
        put_messages(out, e.messages)
        return
    if e.messages:
        raise LocalProtocolError(
            f"{type(e).__name__} has both messages and encoded messages; give one of them"
        )
    out += U32.pack(len(encoded.bounds) - 1)
    out += encoded.data[encoded.bounds[0] : encoded.bounds[-1]]


def _enc_commit_offset(out: bytearray, e: ev.CommitOffset) -> None:
    put_str(out, e.group, "group")
    put_str(out, e.subject, "subject")
    out += U32.pack(e.queue)
    out += U64.pack(e.offset)
    if e.durable:
        # Optional trailing byte: a periodic commit stays byte for byte what brokers
        # before it understand.
        out += U8.pack(1)


def _enc_empty(out: bytearray, e: Event) -> None:
    pass


def _enc_membership(out: bytearray, e: ev.JoinGroup | ev.Heartbeat) -> None:
    put_str(out, e.group, "group")
    put_str(out, e.subject, "subject")
    put_str(out, e.consumer_id, "consumer_id")


def _enc_holding(out: bytearray, e: ev.JoinGroup | ev.Heartbeat) -> None:
    _enc_membership(out, e)
    if e.held is not None:
        # Optional trailing list (HEARTBEAT version 2, JOIN_GROUP version 3): without it
        # the request stays byte for byte what brokers before it understand.
        _put_queues(out, e.held)


def _enc_assignment(out: bytearray, e: ev.JoinGroupResult | ev.HeartbeatResult) -> None:
    _put_queues(out, e.queues)


def _enc_query(out: bytearray, e: ev.Query) -> None:
    if (e.message_id is None) == (e.key is None):
        raise LocalProtocolError("Query needs exactly one of message_id and key")
    put_str(out, e.subject, "subject")
    if e.message_id is not None:
        out.append(QUERY_BY_MESSAGE_ID)
        put_str(out, e.message_id, "message_id")
    else:
        assert e.key is not None
        out.append(QUERY_BY_KEY)
        put_str(out, e.key, "key")


def _enc_stats_result(out: bytearray, e: ev.StatsResult) -> None:
    out += U32.pack(len(e.stats))
    for name, value in e.stats.items():
        put_str(out, name, "stat name")
        if isinstance(value, str):
            out.append(STAT_STR)
            put_str(out, value, f"stat {name!r}")
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


def _enc_cancel(out: bytearray, e: ev.Cancel) -> None:
    put_str(out, e.message_id, "message_id")


def _put_count(out: bytearray, count: int, what: str) -> None:
    """The u16 count of a list body; LocalProtocolError naming ``what`` when over it."""
    if count > MAX_COUNT_U16:
        raise LocalProtocolError(f"{what} of {count}; the wire allows at most {MAX_COUNT_U16}")
    out += U16.pack(count)


def _put_ids(out: bytearray, message_ids: tuple[str, ...], what: str) -> None:
    _put_count(out, len(message_ids), f"{what} ids")
    for message_id in message_ids:
        put_str(out, message_id, "message_id")


def _enc_cancel_batch(out: bytearray, e: ev.CancelBatch) -> None:
    _put_ids(out, e.message_ids, "CANCEL_BATCH")


def _enc_cancel_batch_result(out: bytearray, e: ev.CancelBatchResult) -> None:
    _put_count(out, len(e.results), "CANCEL_BATCH_RESULT results")
    for outcome, dispatched_ms in e.results:
        out.append(outcome)
        put_opt_i64(out, dispatched_ms)


def _enc_held_ids(out: bytearray, e: ev.HeldIds) -> None:
    _put_ids(out, e.message_ids, "HELD_IDS")


def _enc_held_ids_result(out: bytearray, e: ev.HeldIdsResult) -> None:
    _put_count(out, len(e.due_ms), "HELD_IDS_RESULT results")
    for due_ms in e.due_ms:
        put_opt_i64(out, due_ms)


def _enc_outcome(out: bytearray, e: ev.CancelResult | ev.RescheduleResult) -> None:
    out += U8.pack(e.outcome)
    put_opt_i64(out, e.dispatched_ms)


def _enc_reschedule(out: bytearray, e: ev.Reschedule) -> None:
    put_str(out, e.message_id, "message_id")
    out += I64.pack(e.at_ms)


def _enc_error(out: bytearray, e: Error) -> None:
    out += U16.pack(e.code)
    put_str(out, e.reason, "reason")


_ENCODERS: dict[type[Event], Callable[[bytearray, Event], None]] = {
    ev.Hello: _enc_hello,
    ev.HelloOk: _enc_hello_ok,
    ev.SendBatch: _enc_send_batch,
    ev.SendBatchResult: _enc_send_batch_result,
    ev.Pull: _enc_pull,
    ev.PullResult: _enc_messages_response,
    ev.CommitOffset: _enc_commit_offset,
    ev.CommitOffsetOk: _enc_empty,
    ev.JoinGroup: _enc_holding,
    ev.JoinGroupResult: _enc_assignment,
    ev.Heartbeat: _enc_holding,
    ev.HeartbeatResult: _enc_assignment,
    ev.Query: _enc_query,
    ev.QueryResult: _enc_messages_response,
    ev.Stats: _enc_empty,
    ev.StatsResult: _enc_stats_result,
    ev.Cancel: _enc_cancel,
    ev.CancelResult: _enc_outcome,
    ev.CancelBatch: _enc_cancel_batch,
    ev.CancelBatchResult: _enc_cancel_batch_result,
    ev.HeldIds: _enc_held_ids,
    ev.HeldIdsResult: _enc_held_ids_result,
    ev.Reschedule: _enc_reschedule,
    ev.RescheduleResult: _enc_outcome,
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
        self.code, self.reason = code, reason
        self.store_ms, self.commitlog_offset = store_ms, commitlog_offset
        self.queue, self.queue_offset, self.due_ms = queue, queue_offset, due_ms
        self.__class__ = SendResult  # type: ignore[assignment]


assert SendResult.__slots__ == tuple(f.name for f in dataclasses.fields(SendResult))

new_send_result: Callable[..., SendResult] = _SendResultBuilder  # type: ignore[assignment]
"""``new_send_result(code, reason="", store_ms=None, commitlog_offset=None, queue=None,
queue_offset=None, due_ms=None)``: ``SendResult(...)`` built the faster way (the class
call itself, no wrapper: a broker makes one per stored message)."""


def _get_queues(r: BodyReader) -> tuple[int, ...]:
    count = r.fixed(U16, "queue count")
    return tuple(r.fixed(U32, "queue") for _ in range(count))


def _dec_hello(r: BodyReader) -> ev.Hello:
    min_version = r.fixed(U16, "min_version")
    max_version = r.fixed(U16, "max_version")
    token = r.opt_str("token")
    client_name = r.text("client_name")
    return ev.Hello(token, client_name, min_version, max_version, request_id=r.request_id)


def _dec_hello_ok(r: BodyReader) -> ev.HelloOk:
    version = r.fixed(U16, "version")
    max_frame_size = r.fixed(U64, "max_frame_size")
    return ev.HelloOk(version, r.text("server_name"), max_frame_size, request_id=r.request_id)


def _dec_send_batch(r: BodyReader) -> ev.SendBatch:
    # Where each message starts and ends, so that a broker can store the bytes as they
    # arrived instead of encoding the Messages again (stamp_messages).
    bounds: list[int] = []
    messages = get_messages(r, bounds)
    encoded = ev.EncodedMessages(r.body, tuple(bounds))
    return ev.SendBatch(messages, encoded=encoded, request_id=r.request_id)


def _dec_send_batch_result(r: BodyReader) -> ev.SendBatchResult:
    count = r.fixed(U32, "result count")
    if count * 4 > r.end - r.pos:  # code, mask, reason length: at least 4 bytes each
        raise r.error(f"{count} results cannot fit in {r.end - r.pos} bytes")
    if count and r.end - r.pos == count * _SCHEDULED_RESULT.size:
        scheduled_only = _scheduled_results(r, count)
        if scheduled_only is not None:
            return ev.SendBatchResult(scheduled_only, request_id=r.request_id)
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
        ints = [r.fixed(fmt, name) if mask & bit else None for bit, name, fmt in RES_INTS]
        results.append(_SendResultBuilder(code, reason, *ints))
    return ev.SendBatchResult(tuple(results), request_id=r.request_id)


def _scheduled_results(r: BodyReader, count: int) -> tuple[SendResult, ...] | None:
    """The ``count`` results left in ``r`` when every one is a delay server's plain
    acceptance (queue_offset and due_ms, no reason), unpacked in one pass — a
    producer's answer to each frame it sends; None (``r`` untouched) otherwise."""
    codes = _RESULT_CODES
    results = []
    append = results.append
    view = memoryview(r.body)[r.pos : r.end]
    for code, mask, reason_len, queue_offset, due_ms in _SCHEDULED_RESULT.iter_unpack(view):
        if mask != _RES_SCHEDULED or reason_len or code not in codes:
            return None
        append(_SendResultBuilder(codes[code], "", None, None, None, queue_offset, due_ms))
    r.pos = r.end
    return tuple(results)


def _dec_pull(r: BodyReader) -> ev.Pull:
    subject = r.text("subject")
    group = r.text("group")
    consumer_id = r.text("consumer_id")
    max_messages = r.fixed(U32, "max_messages")
    wait_ms = r.fixed(U32, "wait_ms")
    return ev.Pull(subject, group, consumer_id, max_messages, wait_ms, request_id=r.request_id)


def _dec_pull_result(r: BodyReader) -> ev.PullResult:
    return ev.PullResult(get_messages(r), request_id=r.request_id)


def _dec_commit_offset(r: BodyReader) -> ev.CommitOffset:
    group = r.text("group")
    subject = r.text("subject")
    queue = r.fixed(U32, "queue")
    offset = r.fixed(U64, "offset")
    durable = r.flag("durable") if r.pos < r.end else False
    return ev.CommitOffset(group, subject, queue, offset, durable, request_id=r.request_id)


def _dec_commit_offset_ok(r: BodyReader) -> ev.CommitOffsetOk:
    return ev.CommitOffsetOk(request_id=r.request_id)


def _dec_join_group(r: BodyReader) -> ev.JoinGroup:
    group, subject = r.text("group"), r.text("subject")
    consumer_id = r.text("consumer_id")
    held = _get_queues(r) if r.pos < r.end else None
    return ev.JoinGroup(group, subject, consumer_id, held, request_id=r.request_id)


def _dec_join_group_result(r: BodyReader) -> ev.JoinGroupResult:
    return ev.JoinGroupResult(_get_queues(r), request_id=r.request_id)


def _dec_heartbeat(r: BodyReader) -> ev.Heartbeat:
    group, subject = r.text("group"), r.text("subject")
    consumer_id = r.text("consumer_id")
    held = _get_queues(r) if r.pos < r.end else None
    return ev.Heartbeat(group, subject, consumer_id, held, request_id=r.request_id)


def _dec_heartbeat_result(r: BodyReader) -> ev.HeartbeatResult:
    return ev.HeartbeatResult(_get_queues(r), request_id=r.request_id)


def _dec_query(r: BodyReader) -> ev.Query:
    subject = r.text("subject")
    by = r.u8("query kind")
    if by == QUERY_BY_MESSAGE_ID:
        return ev.Query(subject, message_id=r.text("message_id"), request_id=r.request_id)
    if by == QUERY_BY_KEY:
        return ev.Query(subject, key=r.text("key"), request_id=r.request_id)
    raise r.error(f"unknown query kind {by}")


def _dec_query_result(r: BodyReader) -> ev.QueryResult:
    return ev.QueryResult(get_messages(r), request_id=r.request_id)


def _dec_stats(r: BodyReader) -> ev.Stats:
    return ev.Stats(request_id=r.request_id)


def _dec_stats_result(r: BodyReader) -> ev.StatsResult:
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
    return ev.StatsResult(stats, request_id=r.request_id)


def _dec_cancel(r: BodyReader) -> ev.Cancel:
    return ev.Cancel(r.text("message_id"), request_id=r.request_id)


def _dec_cancel_result(r: BodyReader) -> ev.CancelResult:
    outcome = r.enum(_CANCEL_OUTCOMES, r.u8("outcome"), "cancel outcome")
    dispatched_ms = r.opt_i64("dispatched_ms")
    return ev.CancelResult(outcome, dispatched_ms, request_id=r.request_id)  # type: ignore[arg-type]


def _dec_cancel_batch(r: BodyReader) -> ev.CancelBatch:
    count = r.fixed(U16, "id count")
    ids = tuple([r.text("message_id") for _ in range(count)])
    return ev.CancelBatch(ids, request_id=r.request_id)


def _dec_cancel_batch_result(r: BodyReader) -> ev.CancelBatchResult:
    count = r.fixed(U16, "result count")
    results = []
    for _ in range(count):
        outcome = r.enum(_CANCEL_OUTCOMES, r.u8("outcome"), "cancel outcome")
        results.append((outcome, r.opt_i64("dispatched_ms")))
    return ev.CancelBatchResult(tuple(results), request_id=r.request_id)  # type: ignore[arg-type]


def _dec_held_ids(r: BodyReader) -> ev.HeldIds:
    count = r.fixed(U16, "id count")
    return ev.HeldIds(tuple([r.text("message_id") for _ in range(count)]), request_id=r.request_id)


def _dec_held_ids_result(r: BodyReader) -> ev.HeldIdsResult:
    count = r.fixed(U16, "result count")
    due_ms = tuple([r.opt_i64("due_ms") for _ in range(count)])
    return ev.HeldIdsResult(due_ms, request_id=r.request_id)


def _dec_reschedule(r: BodyReader) -> ev.Reschedule:
    message_id = r.text("message_id")
    return ev.Reschedule(message_id, r.fixed(I64, "at_ms"), request_id=r.request_id)


def _dec_reschedule_result(r: BodyReader) -> ev.RescheduleResult:
    outcome = r.enum(_RESCHEDULE_OUTCOMES, r.u8("outcome"), "reschedule outcome")
    dispatched_ms = r.opt_i64("dispatched_ms")
    return ev.RescheduleResult(outcome, dispatched_ms, request_id=r.request_id)  # type: ignore[arg-type]


def _dec_error(r: BodyReader) -> Error:
    code = r.enum(_ERROR_CODES, r.fixed(U16, "error code"), "error code")
    return Error(code, r.text("reason"), request_id=r.request_id)  # type: ignore[arg-type]


_DECODERS: dict[Command, Callable[[BodyReader], Event]] = {
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
    Command.HELD_IDS: _dec_held_ids,
    Command.HELD_IDS_RESULT: _dec_held_ids_result,
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
    r = BodyReader(body, command.name, request_id)
    if flags and command is not Command.ERROR:
        raise r.error(f"flags 0x{flags:04x} are only allowed on ERROR")
    event = _DECODERS[command](r)
    r.finish()
    if flags & FLAG_CLOSE:
        assert isinstance(event, Error)
        return Error(event.code, event.reason, close=True, request_id=request_id)
    return event
