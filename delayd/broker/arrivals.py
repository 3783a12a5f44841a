"""ArrivalHub: held PULLs wait here until a message arrives in one of their queues.

RocketMQ parks a PULL that found nothing in PullRequestHoldService and wakes it from the
store's messageArrivingListener when the reput appends to the queue; it also re-checks
every few seconds. Here there is no re-check loop: a held PULL registers one trio.Event
under every key it cares about — (subject, queue) for each assigned queue, and its
group's key so that a rebalance wakes it too — and the reput sets the events of the keys
it grew. Registration happens in the same synchronous step as the empty read, so an
arrival can never fall in between.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import trio


class ArrivalHub:
    def __init__(self) -> None:
        self._waiters: dict[Hashable, set[trio.Event]] = {}

    @property
    def held(self) -> int:
        """Distinct events registered (held PULLs), for STATS."""
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
            for key in keys:
                events = self._waiters.get(key)
                if events is not None:
                    events.discard(event)
                    if not events:
                        del self._waiters[key]
        return event.is_set()
