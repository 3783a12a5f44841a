"""Bucket arithmetic and names (delayd.logs.buckets): pure, UTC, every scale 1..60."""

from __future__ import annotations

import calendar
import datetime as dt

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delayd.logs.buckets import (
    MAX_BUCKET_START_MS,
    bucket_name,
    bucket_of,
    bucket_starts,
    bucket_width_ms,
    check_segment_scale,
    is_bucket_name,
    parse_bucket_name,
)

MINUTE = 60_000
T = 1_795_341_600_000  # 2026-11-22T10:00:00Z
SCALES = range(1, 61)
FULL_WIDTH = "".join(chr(0xFF10 + int(c)) for c in "202611221530")  # isdigit() is True


def utc_ms(*fields: int) -> int:
    return calendar.timegm(dt.datetime(*fields).timetuple()) * 1000


def test_the_example_of_the_issue():
    assert utc_ms(2026, 11, 22, 10, 0) == T
    due = utc_ms(2026, 11, 22, 15, 30) + 59_999  # 15:30:59.999
    assert bucket_name(bucket_of(due, 1)) == "202611221530"
    assert bucket_name(bucket_of(due, 60)) == "202611221500"
    assert bucket_name(bucket_of(due, 15)) == "202611221530"
    assert bucket_name(bucket_of(due, 20)) == "202611221520"


@pytest.mark.parametrize("scale", SCALES)
def test_every_scale_tiles_time_from_the_epoch(scale):
    width = scale * MINUTE
    assert bucket_width_ms(scale) == width
    for due in (0, 1, width - 1, width, T, T + 1, T + width * 7 + 12_345, MAX_BUCKET_START_MS):
        start = bucket_of(due, scale)
        assert start <= due < start + width
        assert start % width == 0
        assert bucket_of(start, scale) == start
        assert bucket_of(start + width - 1, scale) == start
        assert bucket_of(start + width, scale) == start + width
        assert parse_bucket_name(bucket_name(start)) == start


@pytest.mark.parametrize("scale", [s for s in SCALES if 60 % s == 0])
def test_scales_dividing_an_hour_align_with_the_hour(scale):
    hour = utc_ms(2026, 11, 22, 10, 0)
    assert bucket_of(hour + 59 * MINUTE, scale) == hour + (59 // scale) * scale * MINUTE
    assert bucket_of(hour, scale) == hour


@pytest.mark.parametrize("bad", [0, 61, -1, 1.5, "1", True, None])
def test_scale_outside_1_to_60_is_refused(bad):
    with pytest.raises(ValueError, match="segment_scale"):
        check_segment_scale(bad)
    with pytest.raises(ValueError, match="segment_scale"):
        bucket_of(T, bad)


def test_names_are_utc_with_no_dst_gap_or_repeat():
    # 2026-03-29 and 2026-10-25: the European DST changes, 2026-03-08 and 2026-11-01
    # the American ones. In local time QMQ's names repeat or skip an hour; in UTC every
    # minute of those days has exactly one name, in order.
    for day in ((2026, 3, 29), (2026, 10, 25), (2026, 3, 8), (2026, 11, 1)):
        start = utc_ms(*day, 0, 0)
        names = [bucket_name(start + i * MINUTE) for i in range(24 * 60)]
        assert len(set(names)) == len(names) == 1440
        assert names == sorted(names)
        prefix = "{:04d}{:02d}{:02d}".format(*day)
        assert names[0] == prefix + "0000"
        assert names[150] == prefix + "0230"


def test_leap_day_and_year_boundaries():
    assert bucket_name(utc_ms(2028, 2, 29, 23, 59)) == "202802292359"
    assert bucket_name(utc_ms(2028, 2, 29, 23, 59) + MINUTE) == "202803010000"
    assert bucket_name(utc_ms(2026, 12, 31, 23, 59) + MINUTE) == "202701010000"
    assert bucket_name(0) == "197001010000"
    assert bucket_name(MAX_BUCKET_START_MS) == "999912312359"


@pytest.mark.parametrize(
    "bad",
    [
        "20261122153",
        "2026112215300",
        "202613011200",
        "202602301200",
        "202611222400",
        "202611221560",
        "2026112215a0",
        FULL_WIDTH,
        "",
        "recovery.checkpoint",
    ],
)
def test_parse_refuses_what_is_not_a_bucket_name(bad):
    with pytest.raises(ValueError):
        parse_bucket_name(bad)
    assert not is_bucket_name(bad)


def test_bucket_starts_lists_the_buckets_of_a_directory_ascending_and_skips_other_files():
    listing = ["202611221530", "recovery.checkpoint", "202611221000", FULL_WIDTH, "2026112215"]
    assert bucket_starts(listing) == [T, utc_ms(2026, 11, 22, 15, 30)]


@pytest.mark.parametrize("bad", [-MINUTE, T + 1, MAX_BUCKET_START_MS + MINUTE])
def test_bucket_name_needs_a_whole_minute_in_range(bad):
    with pytest.raises(ValueError):
        bucket_name(bad)


@given(st.integers(0, MAX_BUCKET_START_MS), st.sampled_from(list(SCALES)))
def test_names_sort_like_times_and_round_trip(due, scale):
    start = bucket_of(due, scale)
    name = bucket_name(start)
    assert len(name) == 12 and name.isdigit()
    assert parse_bucket_name(name) == start
    later = start + bucket_width_ms(scale)
    if later <= MAX_BUCKET_START_MS:
        assert bucket_name(later) > name
