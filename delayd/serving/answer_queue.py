"""Requests a connection has carried out and not yet answered, in arrival order.

The reader of a connection appends a SEND_BATCH here once its records are appended;
the connection's acker takes everything queued at once, waits for one group commit to
cover it all, and answers in order. One task per connection instead of one per batch:
a group commit then costs one wake-up, not a scheduling step per batch.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import trio

T = TypeVar("T")


class AnswerQueue(Generic[T]):
    def __init__(self) -> None:
        self._items: list[T] = []
        self._more = trio.Event()  # set when an item is added, or on close
        self._closed = False

    def append(self, item: T) -> None:
        self._items.append(item)
        self._more.set()

    def close(self) -> None:
        """No more items: ``take_all`` returns None once the queue is empty."""
        self._closed = True
        self._more.set()

    async def take_all(self) -> list[T] | None:
        """Every item queued so far, oldest first (waits for one); None once closed
        and empty."""
        while not self._items:
            if self._closed:
                return None
            self._more = trio.Event()
            await self._more.wait()
        items, self._items = self._items, []
        return items
