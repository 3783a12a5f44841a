"""AsyncSession: the current AsyncLink to one server, re-opened with back-off when lost."""

from __future__ import annotations

import ssl

import anyio
import anyio.abc

from delayd.client._addr import parse_addr
from delayd.client._async_link import AsyncLink
from delayd.client._backoff import Backoff
from delayd.errors import BusyError, ConnectionClosedError
from delayd.tls import ClientTls, handshake_failure

# Failures worth another connection attempt: the server is not there (yet), restarting,
# or shutting down. Wrong tokens and protocol errors are not retried: the next attempt
# would fail the same way, only later.
RETRYABLE_CONNECT_ERRORS = (OSError, ConnectionClosedError, BusyError)


class AsyncSession:
    """Hands out a working AsyncLink, reconnecting after losses.

    Readers of new links run in ``task_group``, which the producer or consumer owns.
    Consecutive failures (a connection that could not be made, a link lost) are spaced
    by ``backoff``; a successful request (``succeeded()``) resets it.
    """

    def __init__(
        self,
        addr: str,
        *,
        token: str | None,
        client_name: str,
        task_group: anyio.abc.TaskGroup,
        backoff: Backoff | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        self.host, self.port = parse_addr(addr)
        self.addr = addr
        self._tls = tls
        if tls is not None:
            tls.ssl_context  # noqa: B018  # its files read now: a TlsError names them
        self._token = token
        self._client_name = client_name
        self._task_group = task_group
        self._backoff = backoff or Backoff()
        self._link: AsyncLink | None = None
        self._lock = anyio.Lock()
        self.last_problem: BaseException | None = None  # for time-out messages
        self.connects = 0  # links opened so far (statistics, tests)

    @property
    def current(self) -> AsyncLink | None:
        """The open link, if any, without connecting."""
        link = self._link
        return link if link is not None and not link.closed else None

    async def link(self) -> AsyncLink:
        """The current link, or a new one once the back-off since the last failure ran;
        retries until cancelled.

        Raises what AsyncLink.open raises that is not retryable (RejectedError for a
        wrong token, TlsError, ProtocolError); the caller's deadline bounds the retries. The
        back-off runs from the last failure, not from this call, so a call cancelled by
        a deadline shorter than the delay does not push the next attempt further away.
        """
        link = self._link
        if link is not None and not link.closed:
            return link
        async with self._lock:
            while self._link is None or self._link.closed:
                await anyio.sleep(self._backoff.wait_s(anyio.current_time()))
                try:
                    link = await self._open_link()
                except RETRYABLE_CONNECT_ERRORS as exc:
                    self.last_problem = exc
                    self._backoff.failed(anyio.current_time())
                    continue
                self._link = link
                self.connects += 1
                self._task_group.start_soon(link.run)
            return self._link

    async def _open_link(self) -> AsyncLink:
        try:
            return await AsyncLink.open(
                self.host,
                self.port,
                token=self._token,
                client_name=self._client_name,
                tls=self._tls,
            )
        except ssl.SSLError as exc:  # after the handshake: the client's certificate refused
            raise handshake_failure(exc, self.addr) from None

    def describe_problem(self) -> str:
        """The last failure in words, for time-out messages."""
        if self.last_problem is None:
            return f"no answer from {self.addr}"
        return f"last problem: {self.last_problem!r}"

    def lost(self, link: AsyncLink, exc: BaseException) -> None:
        """A request on ``link`` failed with the connection: the next link() reconnects."""
        self.last_problem = exc
        if link is self._link:
            self._backoff.failed(anyio.current_time())
            link.abort("dropped after a failed request")

    def succeeded(self) -> None:
        """A request got its answer: the server is healthy, restart the back-off."""
        self._backoff.reset()

    def abort(self) -> None:
        """Close the current link (after a time-out it is in an unknown state)."""
        if self._link is not None:
            self._link.abort("closed after a time-out")

    def close(self) -> None:
        """Close the current link; the session is not used afterwards."""
        if self._link is not None:
            self._link.abort("closed by the client")
