"""Task groups of the async clients that do not wrap errors in ExceptionGroups: one for
a client's background tasks, one for requests made at once."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
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


async def run_all(jobs: Sequence[Callable[[], Awaitable[None]]], *, stop_on_error: bool) -> None:
    """Run ``jobs`` at once (one alone is simply awaited) and raise the first error as
    itself, not wrapped in an ExceptionGroup, so a caller's ``except DelaydTimeout``
    works as with one request. ``stop_on_error``: cancel the other jobs at the first
    error; else let each run to its end first."""
    if len(jobs) == 1:
        await jobs[0]()
        return
    errors: list[Exception] = []

    async def one(job: Callable[[], Awaitable[None]]) -> None:
        try:
            await job()
        except Exception as exc:
            errors.append(exc)
            if stop_on_error:
                tasks.cancel_scope.cancel()

    async with anyio.create_task_group() as tasks:
        for job in jobs:
            tasks.start_soon(one, job)
    if errors:
        raise errors[0]
