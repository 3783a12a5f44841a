"""trio for tests: a task that runs for the length of a block."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import trio


@asynccontextmanager
async def running(task: Callable[..., Awaitable[object]]) -> AsyncIterator[None]:
    """``task`` started before the block (``nursery.start``: it has reported
    ``task_status.started()``) and cancelled when the block ends, however it ends."""
    async with trio.open_nursery() as nursery:
        await nursery.start(task)
        yield
        nursery.cancel_scope.cancel()
