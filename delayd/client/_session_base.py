"""What a session knows of its server besides the link, shared by the async and the
blocking session: the address, the back-off between connection attempts, the last
problem (for time-out messages), and whether a first connection that fails is retried.
"""

from __future__ import annotations

import os
from typing import Generic, Protocol, TypeVar

from delayd.address import parse_address
from delayd.client._backoff import Backoff
from delayd.errors import DelaydError, DelaydTimeout, UnreachableError


class _Link(Protocol):
    @property
    def closed(self) -> bool: ...


LinkT = TypeVar("LinkT", bound=_Link)


class SessionBase(Generic[LinkT]):
    """The I/O-free part of a session over links of type LinkT; the clock is the
    caller's (``now_s``).

    ``retry_first_connect`` (an attribute, True unless the owner says otherwise):
    whether a first connection that cannot be made is retried (connect_failed). Raises
    ValueError for a malformed ``addr`` (delayd.address).
    """

    def __init__(
        self,
        addr: str,
        *,
        token: str | None,
        client_name: str,
        backoff: Backoff | None = None,
    ) -> None:
        self.address = parse_address(addr)
        self.addr = addr
        self._token = token
        self._client_name = client_name
        self._backoff = backoff or Backoff()
        self._link: LinkT | None = None
        self.retry_first_connect = True
        self.last_problem: BaseException | None = None  # for time-out messages
        self.connects = 0  # links opened so far (statistics, tests)

    @property
    def current(self) -> LinkT | None:
        """The open link, if any, without connecting."""
        link = self._link
        return link if link is not None and not link.closed else None

    def connect_failed(self, exc: BaseException, now_s: float) -> None:
        """An attempt to connect failed with ``exc``, a retryable error: the next may
        start after the back-off.

        Unless ``retry_first_connect``, a failure before any connection was made is
        raised at once: UnreachableError, naming the address and what to check, when
        the connection could not be made (OSError); ``exc`` itself otherwise.
        """
        self.last_problem = exc
        self._backoff.failed(now_s)
        if self.connects or self.retry_first_connect:
            return
        if isinstance(exc, OSError) and not isinstance(exc, DelaydError):  # DelaydTimeout is one
            raise UnreachableError(
                f"cannot connect to {self.addr}: {_reason(exc)}. Is `delayd serve` (or `delayd "
                "broker`) running there, and is the port right?"
            ) from None
        raise exc

    def describe_problem(self) -> str:
        """The last failure in words, for time-out messages."""
        if self.last_problem is None:
            return f"no answer from {self.addr}"
        return f"last problem: {self.last_problem!r}"

    def took_too_long(self, what: str, timeout_s: float) -> DelaydTimeout:
        """The error of a call that spent its ``timeout_s`` on ``what`` ("sending 3
        message(s)") without an answer."""
        return DelaydTimeout(
            f"{what} at {self.addr} took over {timeout_s} s ({self.describe_problem()})"
        )

    def succeeded(self) -> None:
        """A request got its answer: the server is healthy, restart the back-off."""
        self._backoff.reset()


def _reason(exc: OSError) -> str:
    """Why a connection could not be made, in words ("Connection refused").

    anyio reports "All connection attempts failed", caused by one error per address
    tried, and asyncio's strerror is "Connect call failed (...)": the errno says it.
    """
    cause = exc.__cause__
    causes = cause.exceptions if isinstance(cause, BaseExceptionGroup) else [cause or exc]
    return "; ".join(dict.fromkeys(_words(c) for c in causes))


def _words(exc: BaseException) -> str:
    number = getattr(exc, "errno", None)
    if isinstance(number, int) and number > 0:  # name lookups have negative ones
        return os.strerror(number)
    return getattr(exc, "strerror", None) or str(exc)
