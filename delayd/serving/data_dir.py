"""The frame `delayd serve` and `delayd broker` both run in: take the data directory's
lock, run the server, and turn what ended it into an exit status and a line an
operator can act on."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from delayd.errors import DelaydError
from storage.descriptor_limit import raise_descriptor_limit
from storage.dirlock import DirectoryLock
from storage.errors import StorageError


def serve_data_dir(
    log: logging.Logger,
    data: str,
    holder: str,
    main: Callable[..., Awaitable[object]],
    *args: Any,
) -> int:
    """Run ``trio.run(main, *args)`` as the one writer of ``data`` (``holder`` names
    the command in the lock file). Returns 0, or 1 after logging why the directory is
    taken or why the server stopped; a bug keeps its traceback."""
    raise_descriptor_limit()  # before anything sizes itself by it (DispatchFiles)
    try:
        # One writer per data directory, taken before anything there is read or cut.
        lock = DirectoryLock.acquire(data, holder)
    except StorageError as exc:
        log.error("cannot serve %s: %s", data, exc)
        return 1
    try:
        trio.run(main, *args)
    except BaseException as exc:
        reason = fatal_reason(exc)
        if reason is None:
            raise
        log.error("cannot serve %s: %s", data, reason)
        return 1
    finally:
        lock.release()
    return 0


def fatal_reason(exc: BaseException) -> str | None:
    """What to print for an error that ends a server for a reason an operator can act
    on (corruption, a changed segment_scale, a port in use, a full or failing disk), or
    None for a bug, which keeps its traceback. Trio reports task errors in exception
    groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, (DelaydError, StorageError, OSError)):
        return str(exc)  # an OSError names the address or file
    return None
