"""message_log: the delay server's intake log, one record per accepted message.

The receiver appends a record here (a SegmentedLog under ``<data>/delay/message_log/``)
and acknowledges the producer once it is durable; the replayer copies each record into
the schedule_log bucket of its due time. This module is the one codec of the format —
the server, ``delayd inspect`` and the Spark audit all decode with it. The grammar, with
a worked example, is in docs/delay-formats.md; storage framing (length, crc32c, type)
wraps every payload, so every byte below is under the record's CRC.

Payload of a record of type MESSAGE (little-endian)::

    message := due_ms:i64 sequence:u64 receive_ms:i64 flags:u8
               id_len:u16 subject_len:u16 key_len:u16 properties_len:u32 body_len:u32
               id:byte[id_len] subject:byte[subject_len] key:byte[key_len]
               properties:byte[properties_len] body:byte[body_len]
    properties := (name_len:u16 name:byte[name_len] value_len:u16 value:byte[value_len])*
    flags   := bit 0: key present (key_len is 0 without it); other bits 0

Text is UTF-8. ``due_ms`` comes first so that the replayer and the wheel read it at a
fixed offset without decoding the rest (QMQ's DelayRawMessageAppender layout has
magic, attributes, timestamp, schedule_time, sequence, then length-prefixed fields; we
drop the magic because the frame's type byte already says what the record is).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field

from storage.errors import StorageError
from storage.framing import FIRST_USER_TYPE, HEADER_SIZE

# Record types in message_log (the frame's type byte; storage reserves 0 and 1).
TYPE_MESSAGE = FIRST_USER_TYPE  # 2: an accepted message, layout above
TYPE_CANCEL = 3  # a cancel tombstone: delayd.logs.tombstone, docs/cancel.md
# Reschedule tombstones (delayd.logs.tombstone, docs/cancel.md). Type 4, written before
# groups replicated, appends the moved copy only when the replaying server moved the
# message; type 5 always appends it (and the leader voids a copy it did not move in
# dispatch_log), so every member derives the same schedule_log from message_log. Both
# mean the same to a reader of the answers (the audit, inspect): one name.
TYPE_RESCHEDULE = 4
TYPE_RESCHEDULE_COPY = 5
RESCHEDULE_TYPES = (TYPE_RESCHEDULE, TYPE_RESCHEDULE_COPY)
TOMBSTONE_TYPES = {
    TYPE_CANCEL: "cancel",
    TYPE_RESCHEDULE: "reschedule",
    TYPE_RESCHEDULE_COPY: "reschedule",
}
# A bucket deletion (delayd.logs.retirement): retention on the leader appends it, and
# every member deletes the bucket's files when its replay reaches it, so the members'
# schedule_log stays the same function of message_log. Not a message, not a tombstone.
TYPE_RETIRE_BUCKET = 6
RETIRE_BUCKET = "retire_bucket"

HEAD = struct.Struct("<qQqBHHHII")
HEAD_SIZE = HEAD.size  # 8 + 8 + 8 + 1 + 2 + 2 + 2 + 4 + 4 = 39
assert HEAD_SIZE == 8 + 8 + 8 + 1 + 2 + 2 + 2 + 4 + 4
DUE_MS = struct.Struct("<q")  # at payload offset 0
SEQUENCE = struct.Struct("<Q")  # at payload offset 8
SEQUENCE_AT = 8
RECEIVE_MS = struct.Struct("<q")
RECEIVE_MS_AT = 8 + 8  # after due_ms and sequence
ID_LEN = struct.Struct("<H")
ID_LEN_AT = 8 + 8 + 8 + 1  # after due_ms, sequence, receive_ms and flags
FLAG_KEY = 0x01
KNOWN_FLAGS = FLAG_KEY
U16 = struct.Struct("<H")
MAX_TEXT_BYTES = 0xFFFF  # id, subject, key, property names and values: u16 lengths


class RecordFormatError(StorageError):
    """A record whose CRC holds but whose payload breaks the grammar.

    A crash cannot produce one (the CRC would fail first): it means a bug or a record
    written by a newer version. ``reason`` says which field.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class MessageRecord:
    """One decoded message_log record. Times are epoch milliseconds (UTC)."""

    due_ms: int
    sequence: int
    receive_ms: int
    message_id: str
    subject: str
    key: str | None = None
    properties: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


def encode_properties(properties: Mapping[str, str]) -> bytes:
    """The ``properties`` field: name/value pairs, each a u16 length and UTF-8 bytes.

    Raises ValueError when a name or value is longer than 65,535 bytes of UTF-8.
    """
    if not properties:
        return b""
    parts: list[bytes] = []
    for name, value in properties.items():
        for text in (name, value):
            data = text.encode()
            if len(data) > MAX_TEXT_BYTES:
                raise ValueError(
                    f"property {name[:40]!r}: {len(data)} bytes of UTF-8, at most "
                    f"{MAX_TEXT_BYTES} allowed"
                )
            parts.append(U16.pack(len(data)))
            parts.append(data)
    return b"".join(parts)


def encode_message(
    due_ms: int,
    sequence: int,
    receive_ms: int,
    message_id: bytes,
    subject: bytes,
    key: bytes | None,
    properties: bytes,
    body: bytes,
) -> bytes:
    """A MESSAGE payload from already encoded fields (the receiver encodes text once,
    to check sizes, then passes the bytes here). ``properties`` is encode_properties's
    output. Raises struct.error when a length does not fit its field."""
    return b"".join(
        (
            HEAD.pack(
                due_ms,
                sequence,
                receive_ms,
                0 if key is None else FLAG_KEY,
                len(message_id),
                len(subject),
                0 if key is None else len(key),
                len(properties),
                len(body),
            ),
            message_id,
            subject,
            b"" if key is None else key,
            properties,
            body,
        )
    )


def encoded_size(id_len: int, subject_len: int, key_len: int, props_len: int, body_len: int) -> int:
    """Bytes of a MESSAGE payload with fields of these lengths (bytes)."""
    return HEAD_SIZE + id_len + subject_len + key_len + props_len + body_len


def framed_size(payload_size: int) -> int:
    """Bytes the record takes in the log, storage frame header included."""
    return HEADER_SIZE + payload_size


def encode_record(record: MessageRecord) -> bytes:
    """The MESSAGE payload of ``record``. Raises ValueError for oversized text."""
    for what, text in (("message_id", record.message_id), ("subject", record.subject)):
        if len(text.encode()) > MAX_TEXT_BYTES:
            raise ValueError(f"{what} is longer than {MAX_TEXT_BYTES} bytes of UTF-8")
    key = None if record.key is None else record.key.encode()
    if key is not None and len(key) > MAX_TEXT_BYTES:
        raise ValueError(f"key is longer than {MAX_TEXT_BYTES} bytes of UTF-8")
    return encode_message(
        due_ms=record.due_ms,
        sequence=record.sequence,
        receive_ms=record.receive_ms,
        message_id=record.message_id.encode(),
        subject=record.subject.encode(),
        key=key,
        properties=encode_properties(record.properties),
        body=record.body,
    )


def due_ms_of(payload: bytes | memoryview, at: int = 0) -> int:
    """The due_ms of the MESSAGE payload starting at byte ``at`` of ``payload``."""
    return DUE_MS.unpack_from(payload, at)[0]


def sequence_of(payload: bytes | memoryview, at: int = 0) -> int:
    """The sequence of the MESSAGE payload starting at byte ``at`` of ``payload``."""
    return SEQUENCE.unpack_from(payload, at + SEQUENCE_AT)[0]


def receive_ms_of(payload: bytes | memoryview, at: int = 0) -> int:
    """The receive_ms of the MESSAGE payload starting at byte ``at`` of ``payload``."""
    return RECEIVE_MS.unpack_from(payload, at + RECEIVE_MS_AT)[0]


def message_id_of(payload: bytes | memoryview, at: int = 0) -> bytes:
    """The message_id (UTF-8 bytes) of the MESSAGE payload starting at byte ``at``."""
    (id_len,) = ID_LEN.unpack_from(payload, at + ID_LEN_AT)
    return bytes(payload[at + HEAD_SIZE : at + HEAD_SIZE + id_len])


def identity_of(payload: bytes) -> tuple[int, bytes, int]:
    """(due_ms, message_id as UTF-8 bytes, receive_ms) of a MESSAGE payload, from one
    unpack of its head: what replay files and indexes a record by."""
    due_ms, _, receive_ms, _, id_len, _, _, _, _ = HEAD.unpack_from(payload)
    return due_ms, payload[HEAD_SIZE : HEAD_SIZE + id_len], receive_ms


class MessageHead:
    """A MESSAGE payload's head with its texts decoded (read_head): due_ms,
    message_id, subject, key, and the lengths of the id, subject, key, properties and
    body fields (key_len None without a key)."""

    __slots__ = (
        "body_len",
        "due_ms",
        "id_len",
        "key",
        "key_len",
        "message_id",
        "properties_len",
        "subject",
        "subject_len",
    )

    def __init__(self, due_ms, message_id, subject, key, lengths) -> None:
        self.due_ms = due_ms
        self.message_id = message_id
        self.subject = subject
        self.key = key
        self.id_len, self.subject_len, self.key_len, self.properties_len, self.body_len = lengths


def read_head(payload: bytes, at: int = 0) -> MessageHead | None:
    """The head of the MESSAGE payload starting at byte ``at`` (running to the end of
    ``payload``) with message_id, subject and key decoded, properties and body not; None
    when the head does not hold as decode_message checks it (which then says why).
    Raises nothing."""
    text_at = at + HEAD_SIZE
    if len(payload) < text_at:
        return None
    due_ms, _, _, flags, id_len, subject_len, key_len, props_len, body_len = HEAD.unpack_from(
        payload, at
    )
    if flags & ~KNOWN_FLAGS or (key_len and not flags & FLAG_KEY):
        return None
    if text_at + id_len + subject_len + key_len + props_len + body_len != len(payload):
        return None
    subject_at = text_at + id_len
    key_at = subject_at + subject_len
    try:
        message_id = payload[text_at:subject_at].decode()
        subject = payload[subject_at:key_at].decode()
        key = payload[key_at : key_at + key_len].decode() if flags & FLAG_KEY else None
    except UnicodeDecodeError:
        return None
    lengths = (id_len, subject_len, None if key is None else key_len, props_len, body_len)
    return MessageHead(due_ms, message_id, subject, key, lengths)


def _text(payload: bytes, start: int, length: int, what: str) -> str:
    try:
        return payload[start : start + length].decode()
    except UnicodeDecodeError:
        raise RecordFormatError(f"{what} is not valid UTF-8") from None


def decode_properties(data: bytes) -> dict[str, str]:
    """The dict encoded by encode_properties. Raises RecordFormatError."""
    properties: dict[str, str] = {}
    i, end = 0, len(data)
    while i < end:
        texts = []
        for what in ("property name", "property value"):
            if i + 2 > end:
                raise RecordFormatError(f"{what} length runs past the properties field")
            (length,) = U16.unpack_from(data, i)
            i += 2
            if i + length > end:
                raise RecordFormatError(f"{what} runs past the properties field")
            texts.append(_text(data, i, length, what))
            i += length
        name, value = texts
        if name in properties:
            raise RecordFormatError(f"property {name!r} appears twice")
        properties[name] = value
    return properties


def decode_message(payload: bytes, at: int = 0) -> MessageRecord:
    """The MessageRecord of the MESSAGE payload starting at byte ``at``; it must run to
    the end of ``payload``. Raises RecordFormatError when the layout does not hold."""
    if len(payload) - at < HEAD_SIZE:
        raise RecordFormatError(
            f"message record of {len(payload) - at} bytes is shorter than its {HEAD_SIZE}-byte head"
        )
    (due_ms, sequence, receive_ms, flags, id_len, subject_len, key_len, props_len, body_len) = (
        HEAD.unpack_from(payload, at)
    )
    if flags & ~KNOWN_FLAGS:
        raise RecordFormatError(f"unknown flag bits {flags:#04x}")
    if not flags & FLAG_KEY and key_len:
        raise RecordFormatError(f"key_len is {key_len} but the key flag is not set")
    i = at + HEAD_SIZE
    expected = i + id_len + subject_len + key_len + props_len + body_len
    if expected != len(payload):
        raise RecordFormatError(
            f"the lengths in the head add up to {expected - at} bytes, the record has "
            f"{len(payload) - at}"
        )
    message_id = _text(payload, i, id_len, "message_id")
    i += id_len
    subject = _text(payload, i, subject_len, "subject")
    i += subject_len
    key = _text(payload, i, key_len, "key") if flags & FLAG_KEY else None
    i += key_len
    properties = decode_properties(payload[i : i + props_len])
    i += props_len
    return MessageRecord(
        due_ms=due_ms,
        sequence=sequence,
        receive_ms=receive_ms,
        message_id=message_id,
        subject=subject,
        key=key,
        properties=properties,
        body=payload[i:],
    )


def describe_type(rtype: int) -> str:
    """A name for a message_log record type, for error messages and ``delayd inspect``."""
    if rtype == TYPE_MESSAGE:
        return "message"
    if rtype == TYPE_RETIRE_BUCKET:
        return RETIRE_BUCKET
    return TOMBSTONE_TYPES.get(rtype, f"unknown type {rtype}")


def check_type(rtype: int, path: str, offset: int) -> None:
    """Raise RecordFormatError unless ``rtype`` is a record type this version reads
    (a message, a cancel or reschedule tombstone, a bucket retirement)."""
    if rtype != TYPE_MESSAGE and rtype != TYPE_RETIRE_BUCKET and rtype not in TOMBSTONE_TYPES:
        raise RecordFormatError(
            f"{os.path.basename(path) or path}@{offset}: record of type {rtype} "
            f"({describe_type(rtype)}) is not supported by this version of delayd"
        )
