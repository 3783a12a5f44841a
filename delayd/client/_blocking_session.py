"""BlockingSession: the current BlockingLink to one server, re-opened with back-off."""

from __future__ import annotations

import math
import time

from delayd.client._blocking_link import BlockingLink
from delayd.client._session_base import SessionBase
from delayd.errors import (
    BusyError,
    ConnectionClosedError,
    DelaydTimeout,
    EtcdError,
    NotLeaderError,
)

# As in the async session: worth another attempt, unlike a wrong token or a peer that
# does not speak the protocol. A time-out of one attempt (a server that accepted the
# connection but never answered HELLO) is retried too, within the caller's deadline.
RETRYABLE_CONNECT_ERRORS = (OSError, ConnectionClosedError, BusyError, DelaydTimeout)


class BlockingSession(SessionBase[BlockingLink]):
    """Hands out a working BlockingLink, reconnecting after losses. Not thread-safe.

    Consecutive failures are spaced by ``backoff``; ``succeeded()`` resets it. Without
    ``retry_first_connect``, a first connection that fails raises (SessionBase).
    """

    def link(self, deadline: float) -> BlockingLink:
        """The current link, or a new one once the back-off since the last failure ran.

        Raises DelaydTimeout when ``deadline`` (monotonic seconds; ``math.inf`` waits
        for ever) passes first — having waited until then, so that a caller polling in
        a loop does not spin — what BlockingLink.open raises that is not retryable, and
        what SessionBase.connect_failed raises. The back-off runs from the last
        failure, across calls: a caller whose deadline is shorter than the delay still
        gets its attempt on a later call.
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
            if self.finder.needs_lookup and not self._lookup():
                continue
            try:
                self._link = BlockingLink.open(
                    self.next_address(),
                    token=self._token,
                    client_name=self._client_name,
                    deadline=attempt_deadline,
                    tls=self._tls,
                )
            except RETRYABLE_CONNECT_ERRORS as exc:
                self.connect_failed(exc, time.monotonic())
                continue
            self.connects += 1

    def _lookup(self) -> bool:
        """Read the group's members and leader from etcd (in a trio run of its own:
        this thread runs none); False (after counting it as a failed connection) when
        etcd cannot say."""
        import trio

        from delayd.cluster.group_state import lookup_group

        target = self.finder.target
        try:
            self.learned(trio.run(lookup_group, target))
            if self.finder.needs_lookup:
                raise LookupError(f"etcd lists no member of group {target.group}")
        except (EtcdError, LookupError) as exc:
            self.lookup_failed(exc, time.monotonic())
            return False
        return True

    def redirected(self, exc: NotLeaderError) -> None:
        """The server answered NOT_LEADER: drop the link, go where it said
        (SessionBase.redirect); the caller sends the request again."""
        self.redirect(exc, time.monotonic())
        if self._link is not None:
            self._link.close()

    def lost(self, exc: BaseException) -> None:
        """The current link failed: close it; the next link() reconnects after back-off."""
        self.last_problem = exc
        self._backoff.failed(time.monotonic())
        if self._link is not None:
            self._link.close()

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
