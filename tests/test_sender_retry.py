"""Retry back-off, max attempts and dead-letter subjects."""

from __future__ import annotations

import random
import statistics

import pytest

from delayd.protocol import MAX_SUBJECT_LENGTH, validate_subject
from delayd.sender import (
    DEAD_LETTER_PREFIX,
    MAX_DEAD_LETTERED_SUBJECT_LENGTH,
    RetryPolicy,
    dead_letter_subject,
)


def test_delay_doubles_from_base_and_caps_without_jitter():
    policy = RetryPolicy(base_ms=100, max_ms=1000, jitter=0)
    rng = random.Random(1)
    assert [policy.delay_ms(a, rng) for a in range(1, 8)] == [100, 200, 400, 800, 1000, 1000, 1000]
    # Huge attempt numbers stay at the cap (no overflow, no giant integers).
    assert policy.delay_ms(10_000, rng) == 1000


def test_jitter_stays_within_its_fraction_and_spreads():
    policy = RetryPolicy(base_ms=1000, max_ms=60_000, jitter=0.2)
    rng = random.Random(7)
    delays = [policy.delay_ms(1, rng) for _ in range(2000)]
    assert 800 <= min(delays) < 820 and 1180 < max(delays) <= 1200
    assert 980 < statistics.mean(delays) < 1020
    assert len(set(delays)) > 300  # spread out, not a few values


def test_jitter_never_exceeds_max_nor_goes_negative():
    rng = random.Random(3)
    capped = RetryPolicy(base_ms=100, max_ms=1000, jitter=0.5)
    delays = [capped.delay_ms(10, rng) for _ in range(1000)]
    assert max(delays) == 1000 and min(delays) >= 500
    full = RetryPolicy(base_ms=10, max_ms=10, jitter=1.0)
    assert all(0 <= full.delay_ms(1, rng) <= 10 for _ in range(1000))
    assert RetryPolicy(base_ms=0, max_ms=0).delay_ms(3, rng) == 0


def test_same_seed_same_schedule():
    policy = RetryPolicy()
    first = [policy.delay_ms(a, random.Random(42)) for a in range(1, 10)]
    assert first == [policy.delay_ms(a, random.Random(42)) for a in range(1, 10)]


def test_exhausted_counts_sends_first_included():
    policy = RetryPolicy(max_attempts=3)
    assert [policy.exhausted(n) for n in range(5)] == [False, False, False, True, True]
    assert RetryPolicy(max_attempts=1).exhausted(1)  # never retried
    assert RetryPolicy().max_attempts == 5 and not RetryPolicy().exhausted(4)


def test_attempt_numbers_start_at_one():
    with pytest.raises(ValueError):
        RetryPolicy().delay_ms(0, random.Random())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"base_ms": -1},
        {"base_ms": 200, "max_ms": 100},
        {"jitter": -0.1},
        {"jitter": 1.5},
    ],
)
def test_bad_values(kwargs):
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def test_dead_letter_subject_is_prefixed_and_valid():
    assert DEAD_LETTER_PREFIX == "DLQ."
    assert dead_letter_subject("orders") == "DLQ.orders"
    assert dead_letter_subject("DLQ.orders") == "DLQ.DLQ.orders"
    for subject in ("a", "-x", "_y", "A.b-c_9", "x" * MAX_DEAD_LETTERED_SUBJECT_LENGTH):
        assert validate_subject(subject) is None
        assert validate_subject(dead_letter_subject(subject)) is None


def test_dead_letter_subject_length_limit_is_explained_not_truncated():
    assert MAX_DEAD_LETTERED_SUBJECT_LENGTH == MAX_SUBJECT_LENGTH - 4 == 251
    longest = "s" * MAX_DEAD_LETTERED_SUBJECT_LENGTH
    assert len(dead_letter_subject(longest)) == MAX_SUBJECT_LENGTH
    for length in range(MAX_DEAD_LETTERED_SUBJECT_LENGTH + 1, MAX_SUBJECT_LENGTH + 1):
        subject = "s" * length
        assert validate_subject(subject) is None  # valid, but no room for the prefix
        with pytest.raises(ValueError, match="at most 251 characters"):
            dead_letter_subject(subject)


@pytest.mark.parametrize("subject", ["", ".hidden", "a/b", "ü"])
def test_dead_letter_subject_of_invalid_subject(subject):
    with pytest.raises(ValueError, match="invalid subject"):
        dead_letter_subject(subject)
