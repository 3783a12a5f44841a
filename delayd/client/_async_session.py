"""AsyncSession: the current AsyncLink to one server, re-opened with back-off when lost."""

from __future__ import annotations

import ssl
from typing import Any

import anyio
import anyio.abc

from delayd.client._async_link import AsyncLink
from delayd.client._session_base import SessionBase
from delayd.errors import BusyError, ConnectionClosedError, EtcdError, NotLeaderError
from delayd.tls import handshake_failure

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
        """``options``: SessionBase's (token, client_name, backoff, tls)."""
        super().__init__(addr, **options)
        self._task_group = task_group
        self._lock = anyio.Lock()

    async def link(self) -> AsyncLink:
        """The current link, or a new one once the back-off since the last failure ran;
        retries until cancelled.

        Raises what AsyncLink.open raises that is not retryable (RejectedError for a
        wrong token, TlsError, ProtocolError), and what SessionBase.connect_failed raises; the
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
                if self.finder.needs_lookup and not await self._lookup():
                    continue
                try:
                    link = await self._open_link()
                except RETRYABLE_CONNECT_ERRORS as exc:
                    self.connect_failed(exc, anyio.current_time())
                    continue
                self._link = link
                self.connects += 1
                self._task_group.start_soon(link.run)
            return self._link

    async def _open_link(self) -> AsyncLink:
        """A link to the member to try now (SessionBase.next_address), over the
        session's TLS: a redirect to another member keeps the same settings."""
        address = self.next_address()
        try:
            return await AsyncLink.open(
                address, token=self._token, client_name=self._client_name, tls=self._tls
            )
        except ssl.SSLError as exc:  # after the handshake: the client's certificate refused
            raise handshake_failure(exc, str(address)) from None

    async def _lookup(self) -> bool:
        """Read the group's members and leader from etcd; False (after counting it as
        a failed connection) when etcd cannot say."""
        from delayd.cluster.group_state import lookup_group

        target = self.finder.target
        try:
            self.learned(await lookup_group(target))
            if self.finder.needs_lookup:
                raise LookupError(f"etcd lists no member of group {target.group}")
        except (EtcdError, LookupError) as exc:
            self.lookup_failed(exc, anyio.current_time())
            return False
        return True

    def redirected(self, link: AsyncLink, exc: NotLeaderError) -> None:
        """``link``'s server answered NOT_LEADER: drop it, go where it said
        (SessionBase.redirect); the caller sends the request again."""
        self.redirect(exc, anyio.current_time())
        if link is self._link:
            link.abort("not the leader")

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
