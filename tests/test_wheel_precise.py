"""PreciseTimer (delayd/wheel/precise.py) and the ticker on it, in real time: the one
part of the wheel that cannot run on trio's MockClock. Short sleeps, generous upper
bounds (a loaded CI machine), exact lower bounds: never early."""

from __future__ import annotations

import math
import os
import time

import pytest
import trio

from delayd.wheel.precise import PreciseTimer
from delayd.wheel.ticker import Ticker
from delayd.wheel.timer import TimingWheel


def _has_timerfd() -> bool:
    probe = PreciseTimer.open()
    if probe is not None:
        os.close(probe.fd)
    return probe is not None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _has_timerfd(), reason="timerfd is Linux only (the ticker falls back)"),
]


@pytest.fixture
async def timer():
    opened = PreciseTimer.open()
    assert opened is not None
    yield opened
    opened.close()


async def test_a_sleep_is_never_short(timer):
    for seconds in (0.0005, 0.003, 0.02):
        started = time.monotonic()
        await timer.sleep(seconds)
        slept = time.monotonic() - started
        assert seconds <= slept < seconds + 0.5


async def test_a_fired_or_cancelled_sleep_does_not_end_the_next_one_early(timer):
    # An expiration that nobody read (the timer fired, or fired after its sleep was
    # cancelled) must not make the next sleep return at once.
    await timer.sleep(0.001)
    time.sleep(0.01)  # would fire again were it still armed; it is not
    with trio.move_on_after(0.001):
        await timer.sleep(0.002)
    time.sleep(0.01)  # the cancelled sleep's expiration passes, unread
    started = time.monotonic()
    await timer.sleep(0.03)
    assert time.monotonic() - started >= 0.03


async def test_the_precise_ticker_releases_entries_at_their_due_millisecond_never_before():
    # As Delivery.run sets it: the ticker's clock is never ahead of the wall clock.
    origin_ms = time.time_ns() // 1_000_000 - math.ceil(trio.current_time() * 1000)
    now_ms = origin_ms + math.floor(trio.current_time() * 1000)
    ticker = Ticker(TimingWheel(now_ms, tick_ms=1, slots=64), origin_ms=origin_ms, precise=True)
    dues = [now_ms + d for d in (2, 3, 17, 40, 41, 120)]
    released: list[tuple[int, int]] = []  # (due_ms, wall ms when handed over)

    async def on_due(entries, at_ms):
        wall_ms = time.time_ns() / 1e6
        released.extend((due_ms, wall_ms) for due_ms in entries.due_ms)

    async with trio.open_nursery() as nursery:
        await nursery.start(ticker.run, on_due)
        for i, due_ms in enumerate(dues):
            ticker.add(due_ms, 0, i)
        with trio.move_on_after(5):
            while len(released) < len(dues):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert sorted(d for d, _ in released) == dues
    assert all(wall_ms >= due_ms for due_ms, wall_ms in released)
    assert ticker.statistics().timer_wakeups >= 3  # it slept between them
