"""delayd.timestamps: ISO-8601 with a UTC offset <-> epoch milliseconds."""

from __future__ import annotations

import pytest

from delayd.timestamps import format_utc, parse_utc_ms


def test_utc_times_round_trip():
    for text, ms in {
        "2026-11-22T10:00:00Z": 1_795_341_600_000,
        "2026-11-22T10:00:00.250Z": 1_795_341_600_250,
        "2026-11-22T11:00:00+01:00": 1_795_341_600_000,
        "1970-01-01T00:00:00Z": 0,
    }.items():
        assert parse_utc_ms(text) == ms, text
        assert parse_utc_ms(format_utc(ms)) == ms


def test_formatted_in_utc_with_milliseconds():
    assert format_utc(1_795_341_600_250) == "2026-11-22T10:00:00.250Z"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("2026-11-22T10:00:00", "has no time zone"),
        ("22/11/2026", "not an ISO-8601 time"),
        ("tomorrow", "not an ISO-8601 time"),
    ],
)
def test_a_time_without_offset_or_form_is_refused(text, why):
    with pytest.raises(ValueError, match=why):
        parse_utc_ms(text)
