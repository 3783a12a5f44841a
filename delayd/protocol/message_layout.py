"""The message layout: one message's bytes, inside frame bodies and as the broker's
commitlog record (docs/protocol.md, Message; docs/broker.md, the commitlog record)::

    message := a 14-byte head with the mask and every length, then the bytes they
               measure, then the optional integers the mask announces (MSG_HEAD)

Every piece of delayd that reads or writes these bytes does it through this module:
the event bodies (SEND_BATCH, PULL_RESULT, QUERY_RESULT), the broker's produce path
(``read_heads``, ``stamp_messages``) and delivery (``with_commitlog_offset``), and the
delay server's sender, which writes due messages from their schedule_log records
(``delivered_head``, ``DELIVERED_TAIL``). The functions that work on one message's
bytes copy them rather than decode and encode them again.

Decoding checks every length against what is left before using it, as the rest of the
body grammar does (delayd.protocol.primitives).
"""

from __future__ import annotations

import dataclasses
import struct
from operator import itemgetter

from delayd.errors import LocalProtocolError
from delayd.protocol.events import Message
from delayd.protocol.primitives import I64, MAX_STR_BYTES, U16, U32, U64, BodyReader, put_str

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

# A message as the delay server delivers it: no properties (a message with some is
# encoded from its Message), due_ms and dispatched_ms set and last in the wire order.
_DELIVERED = MSG_DUE_MS | MSG_DISPATCHED_MS
DELIVERED_TAIL = _INT_LAYOUTS[_DELIVERED >> 1].struct
"""``DELIVERED_TAIL.pack(due_ms, dispatched_ms)``: the integers after the body."""
assert DELIVERED_TAIL.format == "<qq"
# due_ms is the last integer but for dispatched_ms: its distance from a message's end.
_DUE_FROM_END = {0: 8, MSG_DISPATCHED_MS: 16}


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


def put_message(out: bytearray, m: Message) -> None:
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
        put_str(out, name, "property name")
        put_str(out, value, "property value")
    out += m.body
    if mask & MSG_INT_BITS:
        out += _INT_LAYOUTS[mask >> 1].struct.pack(*[v for v in ints if v is not None])


def put_messages(out: bytearray, messages: tuple[Message, ...]) -> None:
    out += U32.pack(len(messages))
    # What a producer sends — no key, no properties, at most one of at_ms and delay_ms —
    # is written here in one pass and joined once: put_message's general mask loop cost
    # a producer more CPU per message than the server spends decoding it.
    parts: list[bytes] = []
    append = parts.append
    head, i64 = MSG_HEAD.pack, I64.pack
    for m in messages:
        if (
            m.key is None
            and not m.properties
            and m.store_ms is None
            and m.commitlog_offset is None
            and m.queue is None
            and m.queue_offset is None
            and m.due_ms is None
            and m.dispatched_ms is None
            and (m.at_ms is None or m.delay_ms is None)
        ):
            message_id = m.message_id.encode()
            subject = m.subject.encode()
            if len(message_id) <= MAX_STR_BYTES and len(subject) <= MAX_STR_BYTES:
                body = m.body
                at_ms, delay_ms = m.at_ms, m.delay_ms
                mask = 0 if at_ms is None else MSG_AT_MS
                if delay_ms is not None:
                    mask = MSG_DELAY_MS
                append(head(mask, len(message_id), len(subject), 0, 0, len(body)))
                append(message_id)
                append(subject)
                append(body)
                if mask:
                    append(i64(delay_ms if at_ms is None else at_ms))
                continue
        out += b"".join(parts)
        parts.clear()
        put_message(out, m)
    out += b"".join(parts)


def encode_message(message: Message) -> bytes:
    """One ``message`` of docs/protocol.md, as it appears inside SEND_BATCH, PULL_RESULT
    and QUERY_RESULT bodies (and as the broker's commitlog record payload).

    Raises LocalProtocolError for a message the wire cannot carry (see encode_event).
    """
    out = bytearray()
    try:
        put_message(out, message)
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
    one message this module decoded (SEND_BATCH's ``encoded`` spans) or encoded; the
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


def delivered_head(id_len: int, subject_len: int, key_len: int | None, body_len: int) -> bytes:
    """The head of a message without properties, with due_ms and dispatched_ms set
    (``key_len`` None: no key): what goes before the id, subject, key and body bytes,
    which ``DELIVERED_TAIL`` follows, to make the bytes ``encode_message`` gives."""
    mask = _DELIVERED if key_len is None else _DELIVERED | MSG_KEY
    return MSG_HEAD.pack(mask, id_len, subject_len, key_len or 0, 0, body_len)


def read_heads(
    data: bytes, bounds: tuple[int, ...]
) -> list[tuple[int, bytes, bytes, bytes | None, int, int, int | None]]:
    """Per message ``data[bounds[i]:bounds[i + 1]]`` (the spans of EncodedMessages):
    its mask, message_id, subject and key (UTF-8 bytes; key None without its bit),
    property count, body length and due_ms (None without its bit), read from its head
    and the end of its span without decoding the rest.

    Raises ValueError for a span too short for its head, texts or due_ms.
    """
    unpack_head, unpack_i64 = MSG_HEAD.unpack_from, I64.unpack_from
    head_size = MSG_HEAD.size
    out = []
    for i in range(len(bounds) - 1):
        start, end = bounds[i], bounds[i + 1]
        if end - start < head_size:
            raise ValueError(f"{end - start} bytes cannot hold a message head")
        mask, id_len, subject_len, key_len, count, body_len = unpack_head(data, start)
        at = start + head_size
        subject_at = at + id_len
        key_at = subject_at + subject_len
        text_end = key_at + key_len
        due_ms = None
        if mask & MSG_DUE_MS:
            due_at = end - _DUE_FROM_END[mask & MSG_DISPATCHED_MS]
            if due_at < text_end:
                raise ValueError("message too short for its due_ms")
            due_ms = unpack_i64(data, due_at)[0]
        elif text_end > end:
            raise ValueError("message head announces more bytes than the message holds")
        key = data[key_at:text_end] if mask & MSG_KEY else None
        out.append(
            (mask, data[at:subject_at], data[subject_at:key_at], key, count, body_len, due_ms)
        )
    return out


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


assert [f.name for f in dataclasses.fields(Message)][5:] == [a for _, a, _ in MSG_INTS]
assert Message.__slots__ == tuple(f.name for f in dataclasses.fields(Message))


def _get_properties(r: BodyReader, pos: int, count: int) -> tuple[dict[str, str], int]:
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


def get_message(r: BodyReader) -> Message:
    # The hot path of SEND_BATCH, PULL and QUERY, so it reads the body with local
    # variables instead of BodyReader calls (about twice as fast); the checks are the same.
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


def get_messages(r: BodyReader, bounds: list[int] | None = None) -> tuple[Message, ...]:
    """``messages`` at the reader's position: a u32 count, then the messages. With
    ``bounds``, also appends where the first starts and where each one ends (the spans
    of EncodedMessages). Raises RemoteProtocolError."""
    count = r.fixed(U32, "message count")
    # A message takes at least its head; checking first refuses a lying count at once.
    if count * MSG_HEAD.size > r.end - r.pos:
        raise r.error(f"{count} messages cannot fit in {r.end - r.pos} bytes")
    if bounds is None:
        return tuple([get_message(r) for _ in range(count)])
    bounds.append(r.pos)
    messages = []
    for _ in range(count):
        messages.append(get_message(r))
        bounds.append(r.pos)
    return tuple(messages)


def decode_message(data: bytes, start: int = 0, end: int | None = None) -> Message:
    """The Message encoded in ``data[start:end]``, which must hold exactly one.

    Raises RemoteProtocolError (code MALFORMED) when it does not.
    """
    r = BodyReader(data, "message", 0)
    r.pos = start
    if end is not None:
        r.end = end
    message = get_message(r)
    r.finish()
    return message
