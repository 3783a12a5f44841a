"""The commitlog record of one stored message: the wire protocol's message layout.

A record's payload (inside the storage framing ``length crc type payload``, type
RECORD_TYPE) is exactly one ``message`` of docs/protocol.md, made and read by
delayd.protocol.message_layout, so the layout exists once. The broker fills
``store_ms``, ``queue`` and ``queue_offset`` before appending, and the delay server ``due_ms`` /
``dispatched_ms`` when it delivered the message; ``at_ms``/``delay_ms`` are never
stored (the broker refuses them) and ``commitlog_offset`` is not stored either — it is
where the record is, added on reading. docs/broker.md has the worked example.

The produce path never encodes a record: it copies the bytes the producer sent and
stamps the broker's integers into them (``stamp_record``); PULL sends a record's bytes
with ``commitlog_offset`` spliced in (``delivered``). Both give exactly the bytes
``encode_record``/``encode_message`` would, without building a Message.
"""

from __future__ import annotations

from delayd.errors import RemoteProtocolError
from delayd.protocol.events import Message
from delayd.protocol.message_layout import (
    decode_message,
    encode_message,
    message_ints,
    read_heads,
    stamp_message,
    stamp_messages,
    with_commitlog_offset,
)
from storage.framing import FIRST_USER_TYPE

RECORD_TYPE = FIRST_USER_TYPE  # storage record type of a message record
_set_commitlog_offset = Message.commitlog_offset.__set__  # type: ignore[attr-defined]

stamp_record = stamp_message
"""``stamp_record(data, start, end, store_ms, queue, queue_offset)``: the record payload
of the received message ``data[start:end]`` (see delayd.protocol.message_layout.stamp_message)."""

stamp_records = stamp_messages
"""``stamp_records(data, bounds, indices, store_ms, queues, queue_offsets)``: the record
payloads of several received messages at once (delayd.protocol.message_layout.stamp_messages)."""

delivered = with_commitlog_offset
"""``delivered(payload, commitlog_offset)``: a record as a consumer receives it."""


def encode_record(message: Message, store_ms: int, queue: int, queue_offset: int) -> bytes:
    """The record payload for ``message`` stored at ``store_ms`` in ``queue`` at
    ``queue_offset``, for a message given as a Message (the embedded ``send_batch``);
    the same bytes as ``stamp_record`` of its encoding.

    Raises LocalProtocolError for a message the wire layout cannot carry.
    """
    data = encode_message(message)
    return stamp_message(data, 0, len(data), store_ms, queue, queue_offset)


def decode_record(payload: bytes, commitlog_offset: int) -> Message:
    """The Message stored in ``payload``, with ``commitlog_offset`` filled in.

    Raises RecordError when the payload is not one well-formed message.
    """
    try:
        message = decode_message(payload)
    except RemoteProtocolError as exc:
        raise RecordError(f"record at commitlog offset {commitlog_offset}: {exc}") from None
    # The Message was just built and nobody else holds it: filling one slot of a frozen
    # dataclass through its descriptor is how message_layout builds them in the first place.
    _set_commitlog_offset(message, commitlog_offset)
    return message


def record_identity(payload: bytes) -> tuple[bytes, bytes, bytes | None]:
    """(message_id, subject, key) of a record as UTF-8 bytes, reading only its head.

    The cheap check behind dedupe and index lookups. Raises RecordError when the head
    does not fit in the payload.
    """
    try:
        _, message_id, subject, key, _, _, _ = read_heads(payload, (0, len(payload)))[0]
    except ValueError as exc:
        raise RecordError(f"record head: {exc}") from None
    return message_id, subject, key


def record_summary(payload: bytes) -> tuple[bytes, int]:
    """(message_id as UTF-8 bytes, store_ms) of a record, without decoding the rest.

    Raises RecordError for a payload too short for what its head announces or without
    store_ms.
    """
    message_id, _, _ = record_identity(payload)
    try:
        store_ms = message_ints(payload)[2]
    except ValueError as exc:
        raise RecordError(str(exc)) from None
    if store_ms is None:
        raise RecordError("record without store_ms")
    return message_id, store_ms


def record_position(payload: bytes) -> tuple[bytes, int | None, int | None]:
    """(subject as UTF-8 bytes, queue, queue_offset) of a record, reading only its head
    and its integers: what a consume queue entry pointing at it must agree with.

    Raises RecordError for a payload too short for what its head announces.
    """
    _, subject, _ = record_identity(payload)
    try:
        ints = message_ints(payload)
    except ValueError as exc:
        raise RecordError(str(exc)) from None
    return subject, ints[4], ints[5]


class RecordError(ValueError):
    """A commitlog payload that is not a message record."""
