"""delayd.server.http.messages: the API's due times, bodies and ids to delayd Messages."""

from __future__ import annotations

import pytest

from delayd.protocol import Message
from delayd.server.http.messages import consumed, due, to_message
from delayd.server.http.models import ScheduleRequest
from delayd.server.http.problems import ProblemError


@pytest.mark.parametrize(
    ("delay", "ms"),
    [(0, 0), (90_000, 90_000), ("250ms", 250), ("90s", 90_000), ("1h30m", 5_400_000),
     ("2d12h", 216_000_000), (" 1.5s ", 1_500)],
)  # fmt: skip
def test_a_delay_is_milliseconds_or_durations_added_up(delay, ms):
    assert due(None, delay, "body") == (None, ms)


@pytest.mark.parametrize(
    ("at", "ms"),
    [(0, 0), (1_795_341_600_000, 1_795_341_600_000),
     ("2026-11-22T10:00:00Z", 1_795_341_600_000),
     ("2026-11-22T11:00:00+01:00", 1_795_341_600_000),
     ("2026-11-22T10:00:00.250Z", 1_795_341_600_250)],
)  # fmt: skip
def test_at_is_rfc3339_with_an_offset_or_epoch_ms(at, ms):
    assert due(at, None, "body") == (ms, None)


@pytest.mark.parametrize(
    ("at", "delay", "words"),
    [(1, 1, "both at and delay"), (None, "1h30", "not a duration"),
     (None, "1x", "not a duration"), (None, -5, "0 or more milliseconds"),
     (None, "0.5ms", "whole number"), ("2026-11-22T10:00:00", None, "no time zone"),
     ("tomorrow", None, "not an ISO-8601 time"), (-1, None, "from 0")],
)  # fmt: skip
def test_a_bad_due_time_is_a_422_naming_the_field(at, delay, words):
    with pytest.raises(ProblemError, match=words) as caught:
        due(at, delay, "body.messages.3")
    assert caught.value.status == 422 and "body.messages.3" in caught.value.detail


def test_a_message_without_an_id_gets_one_as_the_clients_make_them():
    first = to_message(ScheduleRequest(subject="s", body="x"), "body")
    second = to_message(ScheduleRequest(subject="s", body="x"), "body")
    assert len(first.message_id) == 32 and first.message_id < second.message_id
    given = to_message(ScheduleRequest(subject="s", id="mine", delay="1s"), "body")
    assert given.message_id == "mine" and given.delay_ms == 1000 and given.at_ms is None


def test_bodies_are_text_or_base64_and_come_back_as_both():
    assert to_message(ScheduleRequest(subject="s", body="hé"), "b").body == "hé".encode()
    raw = to_message(ScheduleRequest(subject="s", body_base64="AP8="), "b")
    assert raw.body == b"\x00\xff"
    assert to_message(ScheduleRequest(subject="s"), "b").body == b""
    with pytest.raises(ProblemError, match="not base64"):
        to_message(ScheduleRequest(subject="s", body_base64="AP8"), "b")
    with pytest.raises(ProblemError, match="give one"):
        to_message(ScheduleRequest(subject="s", body="a", body_base64="AP8="), "b")
    out = consumed(Message("i", "s", body=b"\xff", queue=1, queue_offset=7))
    assert out.body is None and out.body_base64 == "/w==" and out.queue_offset == 7
    assert consumed(Message("i", "s", body=b"ok", queue=0, queue_offset=0)).body == "ok"


def test_a_key_the_wire_cannot_carry_is_refused():
    with pytest.raises(ProblemError, match="at most 65,535"):
        to_message(ScheduleRequest(subject="s", key="é" * 40_000), "body")
