"""The message_log and schedule_log record codecs (delayd.logs): round trips, the worked
example of docs/delay-formats.md, and every malformed payload refused as such."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delayd.logs import message_log, retirement, schedule_log
from delayd.logs.message_log import MessageRecord, RecordFormatError
from storage.framing import HEADER_SIZE, encode_record

EXAMPLE = MessageRecord(
    due_ms=1_795_341_600_000,  # 2026-11-22T10:00:00Z
    sequence=42,
    receive_ms=1_795_341_510_000,  # 90 s earlier
    message_id="m-1",
    subject="orders",
    key="k",
    properties={"a": "b"},
    body=b"hi",
)
# The framed bytes of docs/delay-formats.md, "Worked example".
EXAMPLE_FRAMED = bytes.fromhex(
    "39000000 0ec93392 02"  # length 57, crc32c, type MESSAGE
    "00c5b202a2010000"  # due_ms
    "2a00000000000000"  # sequence 42
    "7065b102a2010000"  # receive_ms
    "01"  # flags: key present
    "0300 0600 0100 06000000 02000000"  # id, subject, key, properties, body lengths
    "6d2d31 6f7264657273 6b"  # "m-1" "orders" "k"
    "0100 61 0100 62"  # property a=b
    "6869"  # body "hi"
)

text = st.text(max_size=40)
records = st.builds(
    MessageRecord,
    due_ms=st.integers(-(2**63), 2**63 - 1),
    sequence=st.integers(0, 2**64 - 1),
    receive_ms=st.integers(-(2**63), 2**63 - 1),
    message_id=text,
    subject=text,
    key=st.none() | text,
    properties=st.dictionaries(text, text, max_size=5),
    body=st.binary(max_size=300),
)


def test_worked_example_bytes():
    payload = message_log.encode_record(EXAMPLE)
    assert len(payload) == message_log.HEAD_SIZE + 3 + 6 + 1 + 6 + 2 == 57
    assert encode_record(payload, message_log.TYPE_MESSAGE) == EXAMPLE_FRAMED
    assert message_log.decode_message(EXAMPLE_FRAMED[HEADER_SIZE:]) == EXAMPLE
    scheduled = schedule_log.encode_scheduled(4096, payload)
    assert scheduled[:8] == bytes.fromhex("0010000000000000")
    assert scheduled[8:] == payload
    assert len(encode_record(scheduled, schedule_log.TYPE_SCHEDULED)) == 9 + 8 + 57


@given(records)
def test_message_round_trip(record):
    payload = message_log.encode_record(record)
    assert message_log.decode_message(payload) == record
    assert message_log.due_ms_of(payload) == record.due_ms
    assert message_log.sequence_of(payload) == record.sequence


@given(records, st.integers(0, 2**64 - 1))
def test_head_readers_agree_with_the_decoder(record, offset):
    payload = message_log.encode_record(record)
    message_id = record.message_id.encode()
    assert message_log.identity_of(payload) == (record.due_ms, message_id, record.receive_ms)
    scheduled = schedule_log.encode_scheduled(offset, payload)
    at = schedule_log.PREFIX_SIZE
    assert message_log.message_id_of(scheduled, at) == message_id
    assert message_log.receive_ms_of(scheduled, at) == record.receive_ms
    head = message_log.read_head(scheduled, at)
    assert head is not None
    assert (head.due_ms, head.message_id, head.subject, head.key) == (
        record.due_ms,
        record.message_id,
        record.subject,
        record.key,
    )
    props = message_log.encode_properties(record.properties)
    assert (head.subject_len, head.properties_len, head.body_len) == (
        len(record.subject.encode()),
        len(props),
        len(record.body),
    )
    assert head.key_len == (None if record.key is None else len(record.key.encode()))


@given(st.binary(max_size=120))
def test_read_head_is_none_only_where_the_decoder_refuses(data):
    head = message_log.read_head(data)
    try:
        record = message_log.decode_message(data)
    except RecordFormatError:
        return  # the head may hold while the properties do not
    assert head is not None and head.message_id == record.message_id


@given(records, st.integers(0, 2**64 - 1))
def test_schedule_round_trip_embeds_the_message_unchanged(record, offset):
    payload = schedule_log.encode_scheduled(offset, message_log.encode_record(record))
    decoded = schedule_log.decode_scheduled(payload)
    assert decoded.message_log_offset == offset == schedule_log.message_log_offset_of(payload)
    assert decoded.message == record
    assert schedule_log.due_ms_of(payload) == record.due_ms


def test_key_absent_and_key_empty_differ():
    absent = message_log.encode_record(MessageRecord(1, 2, 3, "id", "s", key=None))
    empty = message_log.encode_record(MessageRecord(1, 2, 3, "id", "s", key=""))
    assert absent != empty
    assert message_log.decode_message(absent).key is None
    assert message_log.decode_message(empty).key == ""


def corrupt(offset: int, value: bytes) -> bytes:
    payload = bytearray(message_log.encode_record(EXAMPLE))
    payload[offset : offset + len(value)] = value
    return bytes(payload)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\x00" * 38, "shorter than its 39-byte head"),
        (message_log.encode_record(EXAMPLE)[:-1], "add up to 57 bytes, the record has 56"),
        (message_log.encode_record(EXAMPLE) + b"x", "add up to 57 bytes, the record has 58"),
        (corrupt(24, b"\x03"), "unknown flag bits"),
        (corrupt(24, b"\x00"), "key_len is 1 but the key flag is not set"),
        (corrupt(39, b"\xff"), "message_id is not valid UTF-8"),
        (corrupt(49, b"\x09"), "property name runs past"),
        (corrupt(52, b"\x05\x00"), "property value runs past"),
    ],
)
def test_malformed_payloads_are_refused_with_the_field(payload, reason):
    with pytest.raises(RecordFormatError, match=reason):
        message_log.decode_message(payload)


def test_duplicate_property_is_refused():
    props = message_log.encode_properties({"a": "1"}) * 2
    payload = message_log.encode_message(1, 2, 3, b"i", b"s", None, props, b"")
    with pytest.raises(RecordFormatError, match="appears twice"):
        message_log.decode_message(payload)


@given(st.binary(max_size=120))
def test_random_bytes_decode_or_raise_record_format_error(data):
    for decode in (message_log.decode_message, schedule_log.decode_scheduled):
        with contextlib.suppress(RecordFormatError):
            decode(data)


def test_unknown_record_types_are_refused_by_name():
    message_log.check_type(message_log.TYPE_MESSAGE, "/d/message_log", 0)
    message_log.check_type(message_log.TYPE_CANCEL, "/d/message_log", 0)  # issue 8
    message_log.check_type(message_log.TYPE_RESCHEDULE, "/d/message_log", 0)
    message_log.check_type(message_log.TYPE_RESCHEDULE_COPY, "/d/message_log", 0)
    message_log.check_type(message_log.TYPE_RETIRE_BUCKET, "/d/message_log", 0)
    with pytest.raises(RecordFormatError, match=r"type 7 \(unknown type 7\) is not supported"):
        message_log.check_type(7, "/d/message_log", 14)
    with pytest.raises(RecordFormatError, match="type 200"):
        message_log.check_type(200, "/d/message_log", 14)
    with pytest.raises(RecordFormatError, match="schedule_log record of type 3"):
        schedule_log.check_type(3, "/d/202611221000", 0)


def test_oversized_property_text_is_a_value_error():
    with pytest.raises(ValueError, match="65535"):
        message_log.encode_properties({"k": "x" * 65_536})


def test_a_bucket_retirement_round_trips_and_a_wrong_length_is_refused():
    retired = retirement.Retirement(start_ms=1_795_341_600_000, schedule_bytes=4242, receive_ms=7)
    payload = retirement.encode(retired)
    assert len(payload) == 8 + 8 + 8
    assert retirement.decode(payload) == retired
    assert message_log.describe_type(message_log.TYPE_RETIRE_BUCKET) == "retire_bucket"
    with pytest.raises(RecordFormatError, match="retirement has 24 bytes, this record has 23"):
        retirement.decode(payload[:-1])


def test_the_retirement_of_the_worked_example_in_the_docs():
    retired = retirement.Retirement(1_795_341_600_000, 1370, 1_795_600_860_000)
    documented = "00 c5 b2 02 a2 01 00 00 5a 05 00 00 00 00 00 00 60 c3 26 12 a2 01 00 00"
    assert retirement.encode(retired) == bytes.fromhex(documented)
