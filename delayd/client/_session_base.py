"""What a session knows of its server besides the link, shared by the async and the
blocking session: the address (one server, or a group's members: which one to talk to
is delayd.client._leader's), the back-off between connection attempts, the last
problem (for time-out messages), and whether a first connection that fails is retried.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from delayd.address import Address, parse_address
from delayd.client._backoff import Backoff
from delayd.client._leader import LeaderFinder
from delayd.errors import DelaydError, DelaydTimeout, NotLeaderError, UnreachableError
from delayd.group_address import parse_group_address
from delayd.tls import ClientTls

if TYPE_CHECKING:
    from delayd.cluster.group_state import GroupState
    from delayd.cluster.members import MemberInfo

# NOT_LEADER answers naming a leader followed at once; past these, the session waits its
# back-off between redirects (an election under way can bounce a client between two).
IMMEDIATE_REDIRECTS = 2


class _Link(Protocol):
    @property
    def closed(self) -> bool: ...


LinkT = TypeVar("LinkT", bound=_Link)


class SessionBase(Generic[LinkT]):
    """The I/O-free part of a session over links of type LinkT; the clock is the
    caller's (``now_s``). ``addr`` is one ``host:port``, a member list or an
    ``etcd://`` address (delayd.group_address).

    ``listener``: ``intake`` (a producer) or ``broker`` (a consumer), the address of a
    member an ``etcd://`` address resolves to.

    ``tls``: connect to every member over TLS with these settings (None: plain TCP);
    its files are read here, so a TlsError names them before any connection.

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
        listener: str = "intake",
        tls: ClientTls | None = None,
    ) -> None:
        target = parse_group_address(addr)
        if target.whole_cluster:
            raise ValueError(
                f"{addr!r} names every group of a cluster; this client talks to one group: "
                "name it (etcd://HOST:PORT/GROUP)"
            )
        self.finder = LeaderFinder(target)
        self.addr = addr
        self._tls = tls
        if tls is not None:
            tls.ssl_context  # noqa: B018  # its files read now: a TlsError names them
        self.listener = listener  # which of a member's addresses etcd:// resolves to
        self._token = token
        self._client_name = client_name
        self._backoff = backoff or Backoff()
        self._link: LinkT | None = None
        self.retry_first_connect = True
        self.last_problem: BaseException | None = None  # for time-out messages
        self.connects = 0  # links opened so far (statistics, tests)
        self._redirects = 0  # NOT_LEADER answers since the last success

    def next_address(self) -> Address:
        """The member to connect to now (the finder's current one, noted as tried)."""
        return parse_address(self.finder.attempt())

    def learned(self, state: GroupState) -> None:
        """What etcd said of the group (an ``etcd://`` address): its members' and its
        leader's addresses for this session's ``listener``."""
        members = [a for m in state.members if (a := self.listener_address(m))]
        leader = self.listener_address(state.leader) if state.leader else None
        self.finder.learned(members, leader or None)

    def listener_address(self, member: MemberInfo) -> str:
        """The member's address for this session: a consumer's is the broker's; a
        producer's the intake's, or the broker's in a broker group (no intake)."""
        if self.listener == "broker":
            return member.broker
        return member.intake or member.broker

    def lookup_failed(self, exc: BaseException, now_s: float) -> None:
        """etcd could not be read, or named no member: as a connection that failed."""
        if isinstance(exc, LookupError):
            exc = UnreachableError(f"{self.addr}: {exc}")
        self.connect_failed(exc, now_s)

    def redirect(self, exc: NotLeaderError, now_s: float) -> None:
        """The member answered NOT_LEADER: the next link goes to the leader it named
        (or to the next member when it named none), after the back-off when this has
        happened more than IMMEDIATE_REDIRECTS times in a row. The caller drops the
        link and sends the same request again: its message ids make that safe."""
        self.last_problem = exc
        self._redirects += 1
        self.finder.redirected(exc.leader)
        if exc.leader is None or self._redirects > IMMEDIATE_REDIRECTS:
            self._backoff.failed(now_s)

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
        self.finder.failed()
        if self.connects or self.retry_first_connect or self.finder.untried:
            return
        if isinstance(exc, OSError) and not isinstance(exc, DelaydError):  # DelaydTimeout is one
            raise UnreachableError(
                f"cannot connect to {self.finder.describe_tried()}: {_reason(exc)}. Is "
                "`delayd serve` (or `delayd broker`) running there, and is the port right?"
            ) from None
        raise exc

    def describe_problem(self) -> str:
        """The last failure in words, for time-out messages."""
        tried = ""
        if self.finder.target.single is None:
            tried = f"; members tried: {self.finder.describe_tried()}"
        if self.last_problem is None:
            return f"no answer from {self.addr}{tried}"
        return f"last problem: {self.last_problem!r}{tried}"

    def took_too_long(self, what: str, timeout_s: float) -> DelaydTimeout:
        """The error of a call that spent its ``timeout_s`` on ``what`` ("sending 3
        message(s)") without an answer."""
        return DelaydTimeout(
            f"{what} at {self.addr} took over {timeout_s} s ({self.describe_problem()})"
        )

    def succeeded(self) -> None:
        """A request got its answer: the server is healthy, restart the back-off."""
        self._backoff.reset()
        self._redirects = 0
        self.finder.answered()


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
