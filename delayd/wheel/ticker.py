"""Ticker: the trio task that drives a TimingWheel on trio's clock.

The wheel (timer.py) never reads a clock; this is the only place of the wheel that does.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from delayd.wheel.precise import PreciseTimer
from delayd.wheel.timer import DueEntries, TimingWheel

PRECISE_SAFETY_S = 0.002  # trio's own deadline behind the timerfd, should it fail to fire

OnDue = Callable[[DueEntries, int], Awaitable[object]]
"""``await on_due(entries, now_ms)``: hand released entries over (e.g. to the sender's
bounded channel, so a slow sender slows the ticker instead of growing memory)."""


@dataclass(frozen=True, slots=True)
class TickerStatistics:
    """``timer_wakeups``: sleeps ended by the next due time; ``add_wakeups``: sleeps
    ended because an earlier entry was added; ``fired``: entries handed to on_due;
    ``sleeping_until_ms``: the due time slept towards (None while awake, inf when idle)."""

    timer_wakeups: int
    add_wakeups: int
    fired: int
    sleeping_until_ms: float | None


class Ticker:
    """Drives a TimingWheel on trio's clock: release what is due, hand it to ``on_due``,
    then sleep until the next due entry — or until an earlier one is added. An idle
    wheel sleeps without a deadline, so it costs no CPU (QMQ's HashWheelTimer, as
    Netty's, wakes every tick whether or not anything is due).

    The clock is the only thing read here, and only through trio: ``now_ms`` is
    ``origin_ms + floor(trio.current_time() * 1000)``, where ``origin_ms`` is the epoch
    ms at trio time 0 (the server measures it once at start). Add and remove through
    the ticker while it runs, so that it learns about earlier entries.

    ``precise``: sleep on a timerfd (precise.py) instead of trio's deadline, which
    wakes up to 1 ms late (the server sets it; ignored under trio's MockClock, whose
    time is not real). trio's deadline stays as a safety net, 2 ms after.
    """

    def __init__(self, wheel: TimingWheel, *, origin_ms: int = 0, precise: bool = False) -> None:
        self.wheel = wheel
        self.origin_ms = origin_ms
        self.precise = precise
        self._sleep: trio.CancelScope | None = None  # the ticker's sleep, while it sleeps
        self._added_earlier = False
        self._sleeping_until_ms: float | None = None
        self._timer_wakeups = 0
        self._add_wakeups = 0
        self._fired = 0

    def now_ms(self) -> int:
        """The current time in epoch ms, from trio's clock."""
        return self.origin_ms + math.floor(trio.current_time() * 1000)

    def deadline(self, due_ms: int) -> float:
        """The first trio time (a float, in seconds) at which ``now_ms() >= due_ms``.

        ``(due_ms - origin_ms) / 1000`` can round down so that floor(t * 1000) is one ms
        short; sleeping until then would wake to find nothing due, and spin.
        """
        target = due_ms - self.origin_ms
        deadline = target / 1000
        # t -> floor(t * 1000) is monotonic (rounded multiplication is), so walk up to
        # the first float that reaches the ms, then down while the one below still does.
        while math.floor(deadline * 1000) < target:
            deadline = math.nextafter(deadline, math.inf)
        while math.floor((lower := math.nextafter(deadline, -math.inf)) * 1000) >= target:
            deadline = lower
        return deadline

    def add(self, due_ms: int, bucket: int, offset: int) -> None:
        """``TimingWheel.add``, waking the ticker if the entry is due before the time it
        sleeps towards. Raises as TimingWheel.add."""
        self.wheel.add(due_ms, bucket, offset)
        if self._sleeping_until_ms is not None and due_ms < self._sleeping_until_ms:
            self._added_earlier = True
            if self._sleep is not None:
                self._sleep.cancel()

    def remove(self, due_ms: int, bucket: int, offset: int) -> bool:
        """``TimingWheel.remove``. The ticker may still wake at the removed entry's due
        time, find nothing, and sleep again."""
        return self.wheel.remove(due_ms, bucket, offset)

    def statistics(self) -> TickerStatistics:
        return TickerStatistics(
            self._timer_wakeups, self._add_wakeups, self._fired, self._sleeping_until_ms
        )

    async def run(
        self, on_due: OnDue, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run until cancelled. Exceptions from ``on_due`` propagate (the entries it was
        given are then not retried here: the sender owns them once handed over)."""
        # A MockClock (tests) is not real time: a timer in real time cannot serve it.
        real_clock = not _is_mock_clock(trio.lowlevel.current_clock())
        timer = PreciseTimer.open() if self.precise and real_clock else None
        task_status.started()
        try:
            await self._run(on_due, timer)
        finally:
            if timer is not None:
                timer.close()

    async def _run(self, on_due: OnDue, timer: PreciseTimer | None) -> None:
        while True:
            now_ms = self.now_ms()
            due = self.wheel.expire(now_ms)
            if due:
                self._fired += len(due)
                await on_due(due, now_ms)
                next_ms = self.wheel.next_due_ms()
                if next_ms is not None and next_ms <= self.now_ms():
                    # on_due may not have yielded; under a steady stream of due entries
                    # this loop would otherwise never let other tasks run. (Otherwise
                    # the sleep below yields, a scheduling step sooner.)
                    await trio.lowlevel.checkpoint()
                    continue
            else:
                next_ms = self.wheel.next_due_ms()
            self._added_earlier = False
            if next_ms is None:
                self._sleeping_until_ms = math.inf
                deadline = math.inf
            else:
                self._sleeping_until_ms = next_ms
                deadline = self.deadline(next_ms)
            with trio.CancelScope(deadline=deadline) as self._sleep:
                left_s = deadline - trio.current_time()
                if timer is not None and 0 < left_s < math.inf:
                    self._sleep.deadline = deadline + PRECISE_SAFETY_S
                    await timer.sleep(left_s)
                else:
                    await trio.sleep_forever()
            self._sleep = None
            self._sleeping_until_ms = None
            if self._added_earlier:
                self._add_wakeups += 1
            else:
                self._timer_wakeups += 1


def _is_mock_clock(clock: trio.abc.Clock) -> bool:
    """Whether ``clock`` is trio's MockClock — without importing trio.testing, which
    imports pytest (a sixth of the server's start-up). A MockClock exists only once
    trio.testing has been imported."""
    testing = sys.modules.get("trio.testing")
    return testing is not None and isinstance(clock, testing.MockClock)
