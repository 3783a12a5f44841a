"""FrameBudget: the bytes a listener's connections may hold for frames still arriving.

A frame's header announces its size (up to max_frame_size, 16 MiB by default), and its
body is buffered as it arrives: forty connections that each send 15 MiB of a frame and
stop hold 600 MB. So a frame larger than UNBUDGETED_FRAME_BYTES reserves its announced
size here before its body is read, and gives it back once complete (or when its
connection ends); a frame that finds no room waits, unread, its sender pushed back by
TCP. Reserving the announced size rather than counting bytes as they come means a frame
that got its reservation can always finish: frames that each hold part of the budget
can never all wait for one another. Waiters are served in order (trio.Lock is fair).

Smaller frames (every frame before HELLO among them: PRE_HELLO_MAX_FRAME_SIZE) are not
counted: they cost at most that much per connection, which the connection cap bounds.
"""

from __future__ import annotations

import trio

from delayd.protocol.connection import PRE_HELLO_MAX_FRAME_SIZE

UNBUDGETED_FRAME_BYTES = PRE_HELLO_MAX_FRAME_SIZE


class FrameBudget:
    """At most ``max_bytes`` reserved at a time; a single frame larger than that waits
    until nothing else is reserved and then takes the whole budget."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self.reserved = 0
        self.waiting = 0  # frames waiting for room now
        self._turn = trio.Lock()  # the first waiter waits for room; the others for it
        self._released = trio.Event()

    async def reserve(self, size: int) -> int:
        """Take room for a frame of ``size`` bytes, waiting for it when the budget is
        full; returns what was taken (pass it to ``release``)."""
        size = min(size, self.max_bytes)
        if not self._turn.locked() and self.reserved + size <= self.max_bytes:
            self.reserved += size  # room at once: no scheduling step (delayd.nowait_acquire)
            return size
        self.waiting += 1
        try:
            async with self._turn:
                while self.reserved + size > self.max_bytes:
                    self._released = trio.Event()
                    await self._released.wait()
                self.reserved += size
        finally:
            self.waiting -= 1
        return size

    def release(self, size: int) -> None:
        """Give back what ``reserve`` returned."""
        self.reserved -= size
        self._released.set()
