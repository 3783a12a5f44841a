"""ArrivalHub: held PULLs wait here until a message arrives in one of their queues.

RocketMQ parks a PULL that found nothing in PullRequestHoldService and wakes it from the
store's messageArrivingListener when the reput appends to the queue; it also re-checks
every few seconds. Here there is no re-check loop: a held PULL registers under every key
it cares about — (subject, queue) for each assigned queue, and its group's key so that a
rebalance wakes it too — and the reput notifies the keys it grew. Registration happens
in the same synchronous step as the empty read, so an arrival can never fall in between.

Two kinds of waiter: a task awaiting :meth:`ArrivalHub.wait` (an in-process caller of
``Broker.pull``), and a :class:`Hold` — a PULL from a socket, whose wake-up is a
callback run in the notifying step itself (:meth:`ArrivalHub.hold`). A Hold costs no task:
the answer to a long poll leaves in the reput's own step instead of two steps later in
a request task's, which at a few thousand deliveries a second is a fifth of the
broker's CPU per delivery. Holds that time out are woken by :meth:`ArrivalHub.run`, one
task for all of them.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Hashable, Iterable

import trio


class Hold:
    """A PULL held by :meth:`ArrivalHub.hold`: ``wake(True)`` on an arrival under one of
    its keys, ``wake(False)`` at its deadline — once, whichever comes first."""

    __slots__ = ("_hub", "_keys", "_wake", "active", "deadline")

    def __init__(
        self, hub: ArrivalHub, keys: list[Hashable], deadline: float, wake: Callable[[bool], None]
    ) -> None:
        self._hub = hub
        self._keys = keys
        self._wake = wake
        self.deadline = deadline
        self.active = True

    def set(self) -> None:
        """An arrival (the name trio.Event uses, so notify treats both alike)."""
        self._end(True)

    def _end(self, arrived: bool) -> None:
        if self.active:
            self.active = False
            self._hub._unregister(self, self._keys)
            self._wake(arrived)


class ArrivalHub:
    def __init__(self) -> None:
        self._waiters: dict[Hashable, set[trio.Event | Hold]] = {}
        # Deadlines of holds, earliest first; answered holds stay until theirs passes
        # (they are skipped then), so adding one rarely has to move the timer.
        self._deadlines: list[tuple[float, int, Hold]] = []
        self._order = itertools.count()
        self._timer: trio.CancelScope | None = None

    @property
    def held(self) -> int:
        """Distinct waiters registered (held PULLs), for STATS."""
        return len({id(e) for events in self._waiters.values() for e in events})

    def notify(self, keys: Iterable[Hashable]) -> None:
        """Wake every PULL waiting on any of ``keys``."""
        waiters = self._waiters
        for key in keys:
            events = waiters.pop(key, None)
            if events:
                for event in events:
                    event.set()

    async def wait(self, keys: Iterable[Hashable], deadline: float) -> bool:
        """Wait until a notify names one of ``keys`` or trio's clock reaches ``deadline``
        (seconds, trio.current_time()); True when woken by an arrival."""
        keys = list(keys)
        event = trio.Event()
        for key in keys:
            self._waiters.setdefault(key, set()).add(event)
        try:
            with trio.move_on_at(deadline):
                await event.wait()
        finally:
            self._unregister(event, keys)
        return event.is_set()

    def hold(self, keys: Iterable[Hashable], deadline: float, wake: Callable[[bool], None]) -> Hold:
        """Register ``wake`` under ``keys`` until a notify names one of them
        (``wake(True)``, called in the notifying step) or trio's clock reaches
        ``deadline`` (``wake(False)``, from :meth:`run`). ``wake`` must not raise: it runs
        inside whatever step notified (the broker's reput)."""
        hold = Hold(self, list(keys), deadline, wake)
        for key in hold._keys:
            self._waiters.setdefault(key, set()).add(hold)
        heapq.heappush(self._deadlines, (deadline, next(self._order), hold))
        timer = self._timer
        if timer is not None and deadline < timer.deadline:
            timer.deadline = deadline
        return hold

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Wake holds whose deadline passed; runs until cancelled."""
        task_status.started()
        while True:
            with trio.CancelScope(
                deadline=self._deadlines[0][0] if self._deadlines else math.inf
            ) as self._timer:
                await trio.sleep_forever()
            self._timer = None
            self.expire(trio.current_time())

    def expire(self, now: float) -> None:
        """Wake (with ``wake(False)``) every hold whose deadline is at or before ``now``."""
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            heapq.heappop(deadlines)[2]._end(False)

    def _unregister(self, waiter: trio.Event | Hold, keys: list[Hashable]) -> None:
        for key in keys:
            events = self._waiters.get(key)
            if events is not None:
                events.discard(waiter)
                if not events:
                    del self._waiters[key]
