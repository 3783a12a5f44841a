"""The commitlog record of one stored message: the wire protocol's message layout.

A record's payload (inside the storage framing ``length crc type payload``, type
RECORD_TYPE) is exactly one ``message`` of docs/protocol.md, encoded and decoded by the
protocol's own codec, so the layout exists once. The broker fills ``store_ms``,
``queue`` and ``queue_offset`` before appending, and the delay server ``due_ms`` /
``dispatched_ms`` when it delivered the message; ``at_ms``/``delay_ms`` are never
stored (the broker refuses them) and ``commitlog_offset`` is not stored either — it is
where the record is, added on reading. docs/broker.md has the worked example.
"""

from __future__ import annotations

from delayd.errors import RemoteProtocolError
from delayd.protocol.codec import (
    _MSG_INTS,
    MSG_HEAD,
    MSG_KEY,
    MSG_STORE_MS,
    _get_message,
    _new_message,
    _put_message,
    _Reader,
)
from delayd.protocol.events import Message
from storage.framing import FIRST_USER_TYPE

RECORD_TYPE = FIRST_USER_TYPE  # storage record type of a message record

# Setting a slot of a Message we have just built, before anyone else sees it, is how the
# codec itself builds them (see delayd.protocol.codec._new_message): a frozen dataclass
# only forbids plain attribute assignment.
_set_commitlog_offset = Message.commitlog_offset.__set__  # type: ignore[attr-defined]


def stored_message(
    message_id: str,
    subject: str,
    key: str | None,
    properties: dict[str, str],
    body: bytes,
    store_ms: int,
    queue: int,
    queue_offset: int,
    due_ms: int | None,
    dispatched_ms: int | None,
) -> Message:
    """The Message a record holds (commitlog_offset still None: set it once appended).

    Built through the codec's slot setter, a third cheaper than Message(...): this is the
    produce hot path.
    """
    return _new_message(
        [
            message_id,
            subject,
            key,
            properties,
            body,
            None,  # at_ms
            None,  # delay_ms
            store_ms,
            None,  # commitlog_offset
            queue,
            queue_offset,
            due_ms,
            dispatched_ms,
        ]
    )


def encode_record(message: Message) -> bytes:
    """The record payload for ``message`` (already carrying store_ms, queue, queue_offset).

    Raises LocalProtocolError for a message the wire layout cannot carry.
    """
    out = bytearray()
    _put_message(out, message)
    return bytes(out)


def set_commitlog_offset(message: Message, offset: int) -> None:
    """Fill ``commitlog_offset`` of a Message this module's caller built and still owns."""
    _set_commitlog_offset(message, offset)


def decode_record(payload: bytes, commitlog_offset: int) -> Message:
    """The Message stored in ``payload``, with ``commitlog_offset`` filled in.

    Raises RecordError when the payload is not one well-formed message.
    """
    reader = _Reader(payload, "record", 0)
    try:
        message = _get_message(reader)
        reader.finish()
    except RemoteProtocolError as exc:
        raise RecordError(f"record at commitlog offset {commitlog_offset}: {exc}") from None
    _set_commitlog_offset(message, commitlog_offset)
    return message


def record_identity(payload: bytes) -> tuple[bytes, bytes, bytes | None]:
    """(message_id, subject, key) of a record as UTF-8 bytes, reading only its head.

    The cheap check behind dedupe and index lookups. Raises RecordError when the head
    does not fit in the payload.
    """
    if len(payload) < MSG_HEAD.size:
        raise RecordError("record shorter than a message head")
    mask, id_len, subject_len, key_len, _, _ = MSG_HEAD.unpack_from(payload, 0)
    start = MSG_HEAD.size
    end = start + id_len + subject_len + key_len
    if end > len(payload):
        raise RecordError("record head announces more bytes than the record holds")
    message_id = payload[start : start + id_len]
    subject = payload[start + id_len : start + id_len + subject_len]
    key = payload[start + id_len + subject_len : end] if mask & MSG_KEY else None
    return message_id, subject, key


def record_summary(payload: bytes) -> tuple[bytes, int]:
    """(message_id as UTF-8 bytes, store_ms) of a record, without decoding the rest.

    The optional integers end the record in the order of their mask bits, so store_ms is
    found by counting back from the end. Raises RecordError for a payload too short for
    what its head announces or without store_ms.
    """
    message_id, _, _ = record_identity(payload)
    mask = MSG_HEAD.unpack_from(payload, 0)[0]
    if not mask & MSG_STORE_MS:
        raise RecordError("record without store_ms")
    after = 0  # bytes of the integers stored after store_ms
    for bit, _, fmt in reversed(_MSG_INTS):
        if bit == MSG_STORE_MS:
            break
        if mask & bit:
            after += fmt.size
    position = len(payload) - after - 8
    if position < MSG_HEAD.size + len(message_id):
        raise RecordError("record too short for its integers")
    return message_id, int.from_bytes(payload[position : position + 8], "little", signed=True)


class RecordError(ValueError):
    """A commitlog payload that is not a message record."""
