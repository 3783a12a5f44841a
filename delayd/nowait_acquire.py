"""Taking a trio Lock or Semaphore without a scheduling step when it is free.

trio's ``acquire()`` always yields to the scheduler (a checkpoint), even when the lock
is free. On a busy event loop each yield is one more step for the task, which can cost
more than the work around it (measured: docs/benchmarks.md, "2026-11-25 evening").
These take the lock at once when it is free, and wait with ``acquire()`` only when it is
not; fairness is kept (``acquire_nowait`` refuses while others wait). Use them on hot
paths that yield elsewhere anyway.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


async def acquire(resource: trio.Lock | trio.Semaphore) -> None:
    """``resource.acquire()``, without the yield when it is free."""
    try:
        resource.acquire_nowait()
    except trio.WouldBlock:
        await resource.acquire()


@asynccontextmanager
async def holding(lock: trio.Lock) -> AsyncIterator[None]:
    """``async with lock``, without the yield when it is free."""
    await acquire(lock)
    try:
        yield
    finally:
        lock.release()
