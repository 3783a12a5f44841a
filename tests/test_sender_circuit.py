"""The per-group circuit breaker, driven through timelines of now_ms values."""

from __future__ import annotations

import pytest

from delayd.sender import CircuitBreaker, CircuitState

CLOSED, HALF_OPEN, OPEN = CircuitState.CLOSED, CircuitState.HALF_OPEN, CircuitState.OPEN


def failing(breaker: CircuitBreaker, now_ms: int, times: int) -> None:
    for _ in range(times):
        assert breaker.allow(now_ms)
        breaker.record_failure(now_ms)


def test_opens_after_threshold_consecutive_failures_only():
    breaker = CircuitBreaker(failure_threshold=3, open_ms=100)
    failing(breaker, 0, 2)
    assert breaker.state(0) is CLOSED and breaker.consecutive_failures == 2
    breaker.record_success(1)  # a success in between: the count starts again
    assert breaker.consecutive_failures == 0
    failing(breaker, 2, 2)
    assert breaker.state(2) is CLOSED and breaker.opened_total == 0
    failing(breaker, 3, 1)
    assert breaker.state(3) is OPEN
    assert breaker.opened_total == 1 and breaker.consecutive_failures == 3
    assert not breaker.allow(3)


def test_open_refuses_until_open_ms_then_exactly_one_probe():
    breaker = CircuitBreaker(failure_threshold=1, open_ms=100)
    failing(breaker, 1000, 1)
    assert [breaker.allow(t) for t in (1000, 1050, 1099)] == [False, False, False]
    assert breaker.state(1099) is OPEN
    # state() reports HALF_OPEN once the time has passed and does not take the probe.
    assert breaker.state(1100) is HALF_OPEN and breaker.state(1100) is HALF_OPEN
    assert not breaker.probe_in_flight
    assert breaker.allow(1100)  # the probe
    assert breaker.probe_in_flight
    assert [breaker.allow(t) for t in (1100, 1101, 5000)] == [False, False, False]
    assert breaker.state(5000) is HALF_OPEN


def test_successful_probe_closes():
    breaker = CircuitBreaker(failure_threshold=2, open_ms=100)
    failing(breaker, 0, 2)
    assert breaker.allow(100)
    breaker.record_success(120)
    assert breaker.state(120) is CLOSED and not breaker.probe_in_flight
    assert breaker.consecutive_failures == 0
    assert all(breaker.allow(120) for _ in range(10))
    # Closed again: it takes the whole threshold to open once more.
    failing(breaker, 130, 1)
    assert breaker.state(130) is CLOSED


def test_failed_probe_reopens_with_doubled_time_up_to_max():
    breaker = CircuitBreaker(failure_threshold=1, open_ms=100, max_open_ms=350)
    failing(breaker, 0, 1)
    now, open_times = 0, []
    for _ in range(5):
        open_time = breaker.open_ms
        open_times.append(open_time)
        assert not breaker.allow(now + open_time - 1)
        now += open_time
        assert breaker.allow(now)  # the probe ...
        breaker.record_failure(now)  # ... fails: open again, from now
        assert breaker.state(now) is OPEN and not breaker.probe_in_flight
    assert open_times == [100, 200, 350, 350, 350]
    assert breaker.opened_total == 6  # the first opening and five re-openings
    # A successful probe resets the back-off as well.
    now += breaker.open_ms
    assert breaker.allow(now)
    breaker.record_success(now)
    failing(breaker, now, 1)
    assert breaker.open_ms == 100
    assert not breaker.allow(now + 99) and breaker.allow(now + 100)


def test_late_outcomes_of_calls_sent_while_closed():
    breaker = CircuitBreaker(failure_threshold=2, open_ms=100)
    failing(breaker, 0, 2)
    # Failures of calls still in flight when it opened neither extend nor double it.
    breaker.record_failure(50)
    breaker.record_failure(60)
    assert breaker.consecutive_failures == 4 and breaker.opened_total == 1
    assert breaker.state(99) is OPEN and breaker.state(100) is HALF_OPEN
    assert breaker.open_ms == 100
    # A late success: the group answered, so the circuit closes.
    breaker.record_success(70)
    assert breaker.state(70) is CLOSED and breaker.allow(70)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"failure_threshold": 0},
        {"open_ms": 0},
        {"open_ms": -5},
        {"open_ms": 2000, "max_open_ms": 1000},
    ],
)
def test_bad_parameters(kwargs):
    with pytest.raises(ValueError):
        CircuitBreaker(**kwargs)


def test_defaults():
    breaker = CircuitBreaker()
    failing(breaker, 0, 4)
    assert breaker.state(0) is CLOSED
    failing(breaker, 0, 1)
    assert breaker.state(999) is OPEN and breaker.state(1000) is HALF_OPEN
    assert breaker.max_open_ms == 30_000
