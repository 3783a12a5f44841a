"""BlockingSession: the current BlockingLink to one server, re-opened with back-off."""

from __future__ import annotations

import math
import time

from delayd.client._addr import parse_addr
from delayd.client._backoff import Backoff
from delayd.client._blocking_link import BlockingLink
from delayd.errors import BusyError, ConnectionClosedError, DelaydTimeout
from delayd.tls import ClientTls

# As in the async session: worth another attempt, unlike a wrong token or a peer that
# does not speak the protocol. A time-out of one attempt (a server that accepted the
# connection but never answered HELLO) is retried too, within the caller's deadline.
RETRYABLE_CONNECT_ERRORS = (OSError, ConnectionClosedError, BusyError, DelaydTimeout)


class BlockingSession:
    """Hands out a working BlockingLink, reconnecting after losses. Not thread-safe.

    Consecutive failures are spaced by ``backoff``; ``succeeded()`` resets it.
    """

    def __init__(
        self,
        addr: str,
        *,
        token: str | None,
        client_name: str,
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
        self._backoff = backoff or Backoff()
        self._link: BlockingLink | None = None
        self.last_problem: BaseException | None = None
        self.connects = 0  # links opened so far (statistics, tests)

    @property
    def current(self) -> BlockingLink | None:
        """The open link, if any, without connecting."""
        link = self._link
        return link if link is not None and not link.closed else None

    def link(self, deadline: float) -> BlockingLink:
        """The current link, or a new one once the back-off since the last failure ran.

        Raises DelaydTimeout when ``deadline`` (monotonic seconds; ``math.inf`` waits
        for ever) passes first — having waited until then, so that a caller polling in
        a loop does not spin — and what BlockingLink.open raises that is not retryable.
        The back-off runs from the last failure, across calls: a caller whose deadline
        is shorter than the delay still gets its attempt on a later call.
        """
        while True:
            link = self.current
            if link is not None:
                return link
            wait_s = self._backoff.wait_s(time.monotonic())
            if time.monotonic() + wait_s >= deadline:
                time.sleep(max(0.0, deadline - time.monotonic()))
                raise DelaydTimeout(
                    f"could not reach {self.addr} in time ({self.describe_problem()})"
                )
            time.sleep(wait_s)
            # One attempt may take the rest of the time, but no more than a short while
            # when waiting for ever, so a hung server is retried rather than waited on.
            attempt_deadline = deadline if not math.isinf(deadline) else time.monotonic() + 10
            try:
                self._link = BlockingLink.open(
                    self.host,
                    self.port,
                    token=self._token,
                    client_name=self._client_name,
                    deadline=attempt_deadline,
                    tls=self._tls,
                )
            except RETRYABLE_CONNECT_ERRORS as exc:
                self.last_problem = exc
                self._backoff.failed(time.monotonic())
                continue
            self.connects += 1

    def describe_problem(self) -> str:
        """The last failure in words, for time-out messages."""
        if self.last_problem is None:
            return f"no answer from {self.addr}"
        return f"last problem: {self.last_problem!r}"

    def lost(self, exc: BaseException) -> None:
        """The current link failed: close it; the next link() reconnects after back-off."""
        self.last_problem = exc
        self._backoff.failed(time.monotonic())
        if self._link is not None:
            self._link.close()

    def succeeded(self) -> None:
        """A request got its answer: restart the back-off."""
        self._backoff.reset()

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
