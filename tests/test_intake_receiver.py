"""The receiver's decisions (delayd.server.receiver): one table row per rule, sequences, busy,
counters. Pure: the clock is an argument."""

from __future__ import annotations

import pytest

from delayd.logs import message_log
from delayd.protocol import Message, ResultCode, SendBatch, SendResult
from delayd.protocol.bodies import decode_event, encode_event
from delayd.protocol.frames import HEADER_SIZE
from delayd.server.receiver import DEFAULT_MAX_DELAY_MS, Intake, IntakeLimits, Receiver

NOW = 1_795_341_600_000  # 2026-11-22T10:00:00Z
DAY = 86_400_000
LIMITS = IntakeLimits(
    max_delay_ms=30 * DAY,
    max_body_bytes=100,
    max_properties_bytes=40,
    max_record_bytes=200,
    max_pending_acks=10,
    max_replay_lag_records=1000,
)


def msg(**fields) -> Message:
    fields.setdefault("message_id", "m")
    fields.setdefault("subject", "orders")
    return Message(**fields)


# (message, expected code, words the reason must contain, due_ms of an accepted one)
TABLE = [
    (msg(delay_ms=90_000), ResultCode.OK, [], NOW + 90_000),
    (msg(at_ms=NOW + 5), ResultCode.OK, [], NOW + 5),
    (msg(), ResultCode.OK, [], NOW),  # neither: due at once
    (msg(delay_ms=0), ResultCode.OK, [], NOW),
    (msg(at_ms=NOW - 3_600_000), ResultCode.OK, [], NOW),  # past: at once
    (msg(at_ms=1), ResultCode.OK, [], NOW),
    (msg(at_ms=NOW + 30 * DAY), ResultCode.OK, [], NOW + 30 * DAY),  # exactly max_delay
    (msg(at_ms=NOW + 30 * DAY + 1), ResultCode.DELAY_TOO_LONG, ["max_delay", "30.0 days"], None),
    (msg(delay_ms=10**15), ResultCode.DELAY_TOO_LONG, ["not clamped"], None),
    (msg(at_ms=NOW, delay_ms=5), ResultCode.INVALID_DELAY, ["both at_ms", "delay_ms"], None),
    (msg(delay_ms=-1), ResultCode.INVALID_DELAY, ["negative"], None),
    (msg(message_id=""), ResultCode.EMPTY_ID, ["message_id is empty"], None),
    (msg(subject=""), ResultCode.INVALID_SUBJECT, ["empty"], None),
    (msg(subject="a/b"), ResultCode.INVALID_SUBJECT, ["'/'"], None),
    (msg(subject=".hidden"), ResultCode.INVALID_SUBJECT, ["starts with '.'"], None),
    (msg(subject="x" * 256), ResultCode.INVALID_SUBJECT, ["256 characters"], None),
    (msg(subject="x" * 252), ResultCode.INVALID_SUBJECT, ["252 characters", "DLQ."], None),
    (msg(body=b"x" * 100), ResultCode.OK, [], NOW),
    (msg(body=b"x" * 101), ResultCode.BODY_TOO_LARGE, ["101 bytes", "max_body_bytes"], None),
    (msg(properties={"k": "v" * 35}), ResultCode.OK, [], NOW),  # 2+1+2+35 = 40 bytes
    (
        msg(properties={"k": "v" * 36}),
        ResultCode.PROPERTIES_TOO_LARGE,
        ["41 bytes", "max_properties_bytes"],
        None,
    ),
    (msg(properties={"k": "v" * 70_000}), ResultCode.PROPERTIES_TOO_LARGE, ["65535"], None),
    # 39 head + 1 id + 6 subject + 60 key + 40 properties + 55 body = 201 > 200
    (
        msg(key="k" * 60, properties={"k": "v" * 35}, body=b"x" * 55),
        ResultCode.BODY_TOO_LARGE,
        ["201 bytes as a record", "max_record_bytes"],
        None,
    ),
    (msg(key="k" * 60, properties={"k": "v" * 35}, body=b"x" * 54), ResultCode.OK, [], NOW),
    # Without properties: 39 head + 1 id + 6 subject + 100 key + 55 body = 201 > 200
    (msg(key="k" * 100, body=b"x" * 55), ResultCode.BODY_TOO_LARGE, ["201 bytes"], None),
    (msg(key="k" * 100, body=b"x" * 54), ResultCode.OK, [], NOW),
    (msg(message_id="заказ-1", key="ключ-订单", delay_ms=1), ResultCode.OK, [], NOW + 1),
]
# As received from a SEND_BATCH frame too, except what no frame can carry (the encoder
# refuses a property value over 65,535 bytes before it is sent).
CASES = [pytest.param(*row, False, id=f"{i}-messages") for i, row in enumerate(TABLE)] + [
    pytest.param(*row, True, id=f"{i}-wire") for i, row in enumerate(TABLE) if "65535" not in row[2]
]


def as_received(messages: list[Message]) -> SendBatch:
    """``messages`` as a server decodes them from a SEND_BATCH frame (with ``encoded``)."""
    frame = encode_event(SendBatch(messages, request_id=5))
    command, flags, request_id = SendBatch.command, 0, 5
    return decode_event(command, flags, request_id, frame[HEADER_SIZE:])  # type: ignore[return-value]


@pytest.mark.parametrize(("message", "code", "words", "due_ms", "from_wire"), CASES)
def test_validation_table(message, code, words, due_ms, from_wire):
    """The same answers and records whether the receiver encodes each message or
    slices it from the bytes it arrived in."""
    receiver = Receiver(LIMITS, next_sequence=7)
    if from_wire:
        batch = as_received([message])
        intake = receiver.accept(batch.messages, NOW, encoded=batch.encoded)
    else:
        intake = receiver.accept([message], NOW)
    (result,) = receiver.acknowledge(intake)
    assert result.code is code, result.reason
    for word in words:
        assert word in result.reason
    if code is ResultCode.OK:
        assert result.reason == ""
        assert (result.due_ms, result.queue_offset) == (due_ms, 7)
        record = message_log.decode_message(intake.payloads[0])
        assert record.due_ms == due_ms and record.sequence == 7 and record.receive_ms == NOW
        assert (record.message_id, record.subject, record.body) == (
            message.message_id,
            message.subject,
            message.body,
        )
        assert (record.key, record.properties) == (message.key, message.properties)
        assert intake.message_ids == [message.message_id.encode()]
        assert intake.receive_ms == NOW
        assert receiver.accepted_total == 1 and not receiver.refused_total
    else:
        assert result.reason and result.due_ms is None and result.queue_offset is None
        assert intake.payloads == [] and receiver.last_sequence == 6
        assert receiver.refused_total == {code: 1} and receiver.accepted_total == 0


def test_one_bad_message_does_not_fail_the_others_and_sequences_are_dense():
    receiver = Receiver(LIMITS, next_sequence=100)
    batch = [
        msg(message_id="a", delay_ms=1),
        msg(message_id=""),
        msg(message_id="b", delay_ms=2),
        msg(message_id="c", body=b"x" * 500),
        msg(message_id="d", delay_ms=3),
    ]
    intake = receiver.accept(batch, NOW)
    results = receiver.acknowledge(intake)
    assert [r.code for r in results] == [
        ResultCode.OK,
        ResultCode.EMPTY_ID,
        ResultCode.OK,
        ResultCode.BODY_TOO_LARGE,
        ResultCode.OK,
    ]
    assert [r.queue_offset for r in results] == [100, None, 101, None, 102]
    assert [r.due_ms for r in results] == [NOW + 1, None, NOW + 2, None, NOW + 3]
    assert [message_log.decode_message(p).message_id for p in intake.payloads] == ["a", "b", "d"]
    assert (intake.first_sequence, intake.last_sequence) == (100, 102)
    second = receiver.accept([msg(message_id="e")], NOW + 1)
    assert second.first_sequence == 103 and receiver.last_sequence == 103


def test_past_due_messages_are_counted():
    receiver = Receiver(LIMITS, next_sequence=1)
    receiver.accept([msg(at_ms=NOW - 1), msg(at_ms=NOW), msg(delay_ms=0), msg(at_ms=0)], NOW)
    assert receiver.past_due_total == 2
    receiver.accept([msg(at_ms=NOW - 1, body=b"x" * 101)], NOW)  # refused: not counted
    assert receiver.past_due_total == 2


@pytest.mark.parametrize(
    ("pending", "lag", "busy", "words"),
    [
        (9, 999, False, []),
        (10, 0, True, ["10 messages are waiting for their fsync", "max_pending_acks"]),
        (0, 1000, True, ["1,000 accepted messages", "max_replay_lag_records"]),
    ],
)
def test_busy_when_pending_acks_or_replay_lag_reach_their_limit(pending, lag, busy, words):
    receiver = Receiver(LIMITS, next_sequence=1)
    intake = receiver.accept(
        [msg(message_id="a"), msg(message_id="b")],
        NOW,
        pending_acks=pending,
        replay_lag_records=lag,
    )
    results = receiver.acknowledge(intake)
    if not busy:
        assert [r.code for r in results] == [ResultCode.OK] * 2
        return
    assert [r.code for r in results] == [ResultCode.BUSY] * 2
    assert results[0].code.is_retryable
    for word in words:
        assert word in results[0].reason
    assert intake.payloads == [] and receiver.last_sequence == 0  # nothing numbered
    assert receiver.refused_total == {ResultCode.BUSY: 2}


def test_default_max_delay_is_two_years_with_a_leap_day():
    receiver = Receiver(IntakeLimits(), next_sequence=1)
    assert DEFAULT_MAX_DELAY_MS == 731 * DAY
    ok, too_far = receiver.acknowledge(
        receiver.accept([msg(delay_ms=731 * DAY), msg(delay_ms=731 * DAY + 1)], NOW)
    )
    assert (ok.code, too_far.code) == (ResultCode.OK, ResultCode.DELAY_TOO_LONG)


@pytest.mark.parametrize("field", ["max_delay_ms", "max_body_bytes", "max_pending_acks"])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_limits_must_be_positive_integers(field, bad):
    with pytest.raises(ValueError, match=field):
        IntakeLimits(**{field: bad})


def test_acknowledge_of_a_fully_refused_batch():
    receiver = Receiver(LIMITS, next_sequence=1)
    intake = receiver.accept([msg(message_id="")], NOW)
    assert isinstance(intake, Intake) and intake.last_sequence == 0
    assert receiver.acknowledge(intake) == [
        SendResult(ResultCode.EMPTY_ID, intake.results[0].reason)
    ]
