"""AsyncSession: the current AsyncLink to one server, re-opened with back-off when lost."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.abc

from delayd.client._async_link import AsyncLink
from delayd.client._session_base import SessionBase
from delayd.errors import BusyError, ConnectionClosedError

# Failures worth another connection attempt: the server is not there (yet), restarting,
# or shutting down. Wrong tokens and protocol errors are not retried: the next attempt
# would fail the same way, only later.
RETRYABLE_CONNECT_ERRORS = (OSError, ConnectionClosedError, BusyError)


class AsyncSession(SessionBase[AsyncLink]):
    """Hands out a working AsyncLink, reconnecting after losses.

    Readers of new links run in ``task_group``, which the producer or consumer owns.
    Consecutive failures (a connection that could not be made, a link lost) are spaced
    by ``backoff``; a successful request (``succeeded()``) resets it. Without
    ``retry_first_connect``, a first connection that fails raises (SessionBase).
    """

    def __init__(self, addr: str, *, task_group: anyio.abc.TaskGroup, **options: Any) -> None:
        """``options``: SessionBase's (token, client_name, backoff)."""
        super().__init__(addr, **options)
        self._task_group = task_group
        self._lock = anyio.Lock()

    async def link(self) -> AsyncLink:
        """The current link, or a new one once the back-off since the last failure ran;
        retries until cancelled.

        Raises what AsyncLink.open raises that is not retryable (RejectedError for a
        wrong token, ProtocolError), and what SessionBase.connect_failed raises; the
        caller's deadline bounds the retries. The back-off runs from the last failure,
        not from this call, so a call cancelled by a deadline shorter than the delay
        does not push the next attempt further away.
        """
        link = self._link
        if link is not None and not link.closed:
            return link
        async with self._lock:
            while self._link is None or self._link.closed:
                await anyio.sleep(self._backoff.wait_s(anyio.current_time()))
                try:
                    link = await AsyncLink.open(
                        self.address, token=self._token, client_name=self._client_name
                    )
                except RETRYABLE_CONNECT_ERRORS as exc:
                    self.connect_failed(exc, anyio.current_time())
                    continue
                self._link = link
                self.connects += 1
                self._task_group.start_soon(link.run)
            return self._link

    def lost(self, link: AsyncLink, exc: BaseException) -> None:
        """A request on ``link`` failed with the connection: the next link() reconnects."""
        self.last_problem = exc
        if link is self._link:
            self._backoff.failed(anyio.current_time())
            link.abort("dropped after a failed request")

    def abort(self) -> None:
        """Close the current link (after a time-out it is in an unknown state)."""
        if self._link is not None:
            self._link.abort("closed after a time-out")

    def close(self) -> None:
        """Close the current link; the session is not used afterwards."""
        if self._link is not None:
            self._link.abort("closed by the client")
