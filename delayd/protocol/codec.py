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
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable

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
    CancelResult,
    CommitOffset,
    CommitOffsetOk,
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
# (bit, attribute, struct) for the fixed-size optional fields, in wire order.
_MSG_INTS = (
    (MSG_AT_MS, "at_ms", I64),
    (MSG_DELAY_MS, "delay_ms", I64),
    (MSG_STORE_MS, "store_ms", I64),
    (MSG_COMMITLOG_OFFSET, "commitlog_offset", U64),
    (MSG_QUEUE, "queue", U32),
    (MSG_QUEUE_OFFSET, "queue_offset", U64),
    (MSG_DUE_MS, "due_ms", I64),
    (MSG_DISPATCHED_MS, "dispatched_ms", I64),
)
_NO_INTS = (None,) * len(_MSG_INTS)

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
        for (bit, _, _), value in zip(_MSG_INTS, ints):  # noqa: B905  # both have 8
            if value is not None:
                mask |= bit
    message_id = m.message_id.encode()
    subject = m.subject.encode()
    key = b"" if m.key is None else m.key.encode()
    props = m.properties
    if max(len(message_id), len(subject), len(key), len(props)) > MAX_STR_BYTES:
        for what, size in (
            ("message_id", len(message_id)),
            ("subject", len(subject)),
            ("key", len(key)),
            ("number of properties", len(props)),
        ):
            if size > MAX_STR_BYTES:
                raise LocalProtocolError(
                    f"message {m.message_id[:100]!r}: {what} is {size} (bytes of UTF-8 for "
                    f"text), the wire allows at most {MAX_STR_BYTES}"
                )
    out += MSG_HEAD.pack(mask, len(message_id), len(subject), len(key), len(props), len(m.body))
    out += message_id
    out += subject
    out += key
    for name, value in props.items():
        _put_str(out, name, "property name")
        _put_str(out, value, "property value")
    out += m.body
    if mask & ~MSG_KEY:
        for (_, _, fmt), value in zip(_MSG_INTS, ints):  # noqa: B905
            if value is not None:
                out += fmt.pack(value)


def _put_messages(out: bytearray, messages: tuple[Message, ...]) -> None:
    out += U32.pack(len(messages))
    for m in messages:
        _put_message(out, m)


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
    for r in e.results:
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
    _put_messages(out, e.messages)


def _enc_commit_offset(out: bytearray, e: CommitOffset) -> None:
    _put_str(out, e.group, "group")
    _put_str(out, e.subject, "subject")
    out += U32.pack(e.queue)
    out += U64.pack(e.offset)


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
    """Inside _get_message: ``what`` needs ``need`` bytes, more than are left."""

    def __init__(self, what: str, need: int) -> None:
        self.what = what
        self.need = need


class _Bad(Exception):
    """Inside _get_message: any other violation of the grammar."""

    def __init__(self, problem: str) -> None:
        self.problem = problem


# Message's fields in order, as slot setters. A frozen dataclass's __init__ assigns each
# field through object.__setattr__ (about 100 ns apiece, 1.3 us for a Message); setting
# the slots directly takes a third less, and Message has no __post_init__ to skip.
_MESSAGE_SETTERS = tuple(getattr(Message, f.name).__set__ for f in dataclasses.fields(Message))
assert [f.name for f in dataclasses.fields(Message)][5:] == [a for _, a, _ in _MSG_INTS]


def _new_message(values: list) -> Message:
    message = object.__new__(Message)
    # zip(strict=True) would add a fifth to the cost; values always has every field.
    for set_field, value in zip(_MESSAGE_SETTERS, values):  # noqa: B905
        set_field(message, value)
    return message


def _get_message(r: _Reader) -> Message:
    # The hot path of SEND_BATCH, PULL and QUERY, so it reads the body with local
    # variables instead of _Reader calls (about twice as fast); the checks are the same.
    body, pos, end = r.body, r.pos, r.end
    try:
        if end - pos < MSG_HEAD.size:
            raise _Short("message head", MSG_HEAD.size)
        mask, id_len, subject_len, key_len, count, body_len = MSG_HEAD.unpack_from(body, pos)
        pos += MSG_HEAD.size
        if mask & ~MSG_KNOWN:
            raise _Bad(f"unknown message field bits 0x{mask & ~MSG_KNOWN:04x}")
        if key_len and not mask & MSG_KEY:
            raise _Bad(f"key length {key_len} for a message without a key")
        n = id_len + subject_len + key_len
        if end - pos < n:
            raise _Short("message_id, subject and key", n)
        message_id = body[pos : pos + id_len].decode()
        pos += id_len
        subject = body[pos : pos + subject_len].decode()
        pos += subject_len
        key = body[pos : pos + key_len].decode() if mask & MSG_KEY else None
        pos += key_len
        properties: dict[str, str] = {}
        for _ in range(count):
            if end - pos < 2:
                raise _Short("length of property name", 2)
            (n,) = U16.unpack_from(body, pos)
            pos += 2
            if end - pos < n + 2:
                raise _Short("property name and value length", n + 2)
            name = body[pos : pos + n].decode()
            pos += n
            (n,) = U16.unpack_from(body, pos)
            pos += 2
            if end - pos < n:
                raise _Short("property value", n)
            if name in properties:
                raise _Bad(f"property {name!r} appears twice")
            properties[name] = body[pos : pos + n].decode()
            pos += n
        if end - pos < body_len:
            raise _Short("body", body_len)
        values = [message_id, subject, key, properties, body[pos : pos + body_len]]
        pos += body_len
        if not mask & ~MSG_KEY:
            r.pos = pos
            values += _NO_INTS
            return _new_message(values)
        for bit, attr, fmt in _MSG_INTS:
            if mask & bit:
                if end - pos < fmt.size:
                    raise _Short(attr, fmt.size)
                values.append(fmt.unpack_from(body, pos)[0])
                pos += fmt.size
            else:
                values.append(None)
    except _Short as exc:
        r.pos = pos
        raise r.error(f"{exc.what} needs {exc.need} bytes, only {end - pos} left") from None
    except _Bad as exc:
        r.pos = pos
        raise r.error(exc.problem) from None
    except UnicodeDecodeError as exc:
        r.pos = pos
        raise r.error(f"a string is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    r.pos = pos
    return _new_message(values)


def _get_messages(r: _Reader) -> tuple[Message, ...]:
    count = r.fixed(U32, "message count")
    # A message takes at least its head; checking first refuses a lying count at once.
    if count * MSG_HEAD.size > r.end - r.pos:
        raise r.error(f"{count} messages cannot fit in {r.end - r.pos} bytes")
    return tuple(_get_message(r) for _ in range(count))


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
    return SendBatch(_get_messages(r), request_id=r.request_id)


def _dec_send_batch_result(r: _Reader) -> SendBatchResult:
    count = r.fixed(U32, "result count")
    if count * 4 > r.end - r.pos:  # code, mask, reason length: at least 4 bytes each
        raise r.error(f"{count} results cannot fit in {r.end - r.pos} bytes")
    results = []
    for _ in range(count):
        code = r.enum(_RESULT_CODES, r.u8("result code"), "result code")
        mask = r.u8("result field mask")
        if mask & ~RES_KNOWN:
            raise r.error(f"unknown result field bits 0x{mask & ~RES_KNOWN:02x}")
        reason = r.text("reason")
        ints = {name: r.fixed(fmt, name) for bit, name, fmt in _RES_INTS if mask & bit}
        results.append(SendResult(code, reason, **ints))  # type: ignore[arg-type]
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
    return CommitOffset(group, subject, queue, offset, request_id=r.request_id)


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
