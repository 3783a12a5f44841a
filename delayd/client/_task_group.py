"""A task group for a client's background tasks that does not wrap the user's errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc


@asynccontextmanager
async def background_task_group() -> AsyncIterator[anyio.abc.TaskGroup]:
    """A task group whose tasks are cancelled when the body ends.

    ``open_producer`` and ``open_consumer`` run the user's ``async with`` body inside
    their task group. A task group (trio's nursery, strictly) would report an exception
    from that body wrapped in an ExceptionGroup, so a ``ValueError`` raised by user code
    would reach its ``except ValueError`` as something else. The body's exception is
    therefore caught here, the background tasks cancelled, and the exception raised
    again outside the group, as it was. The background tasks themselves never raise
    (links and heartbeats turn failures into state); if one did, that is a bug and its
    ExceptionGroup propagates.
    """
    error: BaseException | None = None
    async with anyio.create_task_group() as tg:
        try:
            yield tg
        except BaseException as exc:
            error = exc
        tg.cancel_scope.cancel()
    if error is not None:
        raise error
