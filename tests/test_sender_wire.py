"""The sender's wire fast path (delayd/sender/wire.py): the bytes it builds from a
schedule_log record are exactly what encoding the decoded Message gives, and what it
cannot copy (properties, a malformed record) takes the full decoding path."""

from __future__ import annotations

import pytest

from delayd.logs import message_log, schedule_log
from delayd.logs.message_log import MessageRecord, RecordFormatError
from delayd.protocol import EncodedMessages, Message
from delayd.protocol.message_layout import decode_message, encode_message
from delayd.sender.ledger import Item
from delayd.sender.wire import encode_batch


def scheduled(key: str | None = None, properties: dict | None = None, body=b"body") -> bytes:
    record = MessageRecord(
        due_ms=1_795_341_600_123,
        sequence=7,
        receive_ms=1_795_341_500_000,
        message_id="id-é-1",
        subject="orders.eu",
        key=key,
        properties=properties or {},
        body=body,
    )
    return schedule_log.encode_scheduled(4096, message_log.encode_record(record))


def expected(payload: bytes, dispatched_ms: int) -> bytes:
    r = schedule_log.decode_scheduled(payload).message
    return encode_message(
        Message(
            r.message_id,
            r.subject,
            r.key,
            r.properties,
            r.body,
            due_ms=r.due_ms,
            dispatched_ms=dispatched_ms,
        )
    )


@pytest.mark.parametrize("key", [None, "", "customer-42"])
@pytest.mark.parametrize("body", [b"", b"x" * 1000])
def test_the_copied_wire_message_equals_the_encoded_message(key, body):
    payload = scheduled(key=key, body=body)
    item = Item(3, 0, 64, payload)
    assert item.wire_head is not None
    assert (item.message_id, item.subject, item.key) == ("id-é-1", "orders.eu", key)
    encoded = encode_batch([item, item], 1_795_341_600_125)
    one = expected(payload, 1_795_341_600_125)
    assert encoded == EncodedMessages(one + one, (0, len(one), 2 * len(one)))
    assert decode_message(encoded.data, 0, len(one)).due_ms == 1_795_341_600_123


def test_properties_and_dead_letters_go_through_a_message():
    payload = scheduled(properties={"trace": "abc", "ü": "v"})
    item = Item(3, 0, 64, payload)
    assert item.wire_head is None  # the wire counts properties
    assert encode_batch([item], 5).data == expected(payload, 5)
    plain = Item(3, 0, 64, scheduled())
    plain.dead, plain.reason = True, "BODY_TOO_LARGE: test"
    dead = decode_message(encode_batch([plain], 5).data)
    assert dead.subject == "DLQ.orders.eu" and dead.properties["delayd.original_subject"]


@pytest.mark.parametrize(
    "damage",
    [
        lambda p: p[:-1],  # lengths no longer add up
        lambda p: p[:20],  # shorter than a head
        lambda p: p[: 8 + 24] + b"\x80" + p[8 + 25 :],  # unknown flag bit
    ],
)
def test_a_malformed_record_is_refused_by_the_full_decoder(damage):
    payload = damage(scheduled())
    assert message_log.read_head(payload, schedule_log.PREFIX_SIZE) is None
    with pytest.raises(RecordFormatError):
        Item(3, 0, 64, payload)
