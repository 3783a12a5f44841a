"""The delayd error tree (STYLE.md #9, after dramatiq/errors.py and h11/_util.py).

::

    DelaydError
    ├── ProtocolError               bytes on a connection broke the wire protocol
    │   ├── LocalProtocolError      ... because this side tried to send something invalid
    │   └── RemoteProtocolError     ... because the peer sent something invalid
    ├── RejectedError               the server refused a request; ``reason`` says what to change
    │   └── NotLeaderError          ... as it does not lead its group; ``leader`` names who does
    ├── BusyError                   the server is overloaded; retrying later is correct
    ├── ConnectionClosedError       the connection is gone; pending requests are lost
    ├── UnreachableError            no connection could be made (nothing listening, no route)
    ├── DelaydTimeout               a deadline passed (also a builtin ``TimeoutError``)
    └── EtcdError                   etcd answered with an error (``code``: its gRPC code)
        └── EtcdUnavailable         no etcd endpoint could be reached, or none answered in time

    StorageError                    from storage/, re-exported here
    └── CorruptionError

The storage errors are re-exported, not re-parented: storage/ knows nothing of delayd
(DESIGN.md, "Layers"), so code that wants "anything delayd can raise" catches
``(DelaydError, StorageError)``.
"""

from __future__ import annotations

from storage.errors import CorruptionError, StorageError

__all__ = [
    "BusyError",
    "ConnectionClosedError",
    "CorruptionError",
    "DelaydError",
    "DelaydTimeout",
    "EtcdError",
    "EtcdUnavailable",
    "LocalProtocolError",
    "NotLeaderError",
    "ProtocolError",
    "RejectedError",
    "RemoteProtocolError",
    "StorageError",
    "UnreachableError",
]


class DelaydError(Exception):
    """Base class of every error delayd raises on purpose."""


class ProtocolError(DelaydError):
    """The wire protocol was violated; the connection cannot be used any further.

    ``code`` is a hint for the ERROR frame to send before closing (a
    ``delayd.protocol.ErrorCode``; ``None`` means a generic protocol error), and
    ``request_id`` the request the error belongs to, or 0 when it concerns the whole
    connection (for example a frame whose header could not be trusted). Like h11's
    ``error_status_hint``, they let the server answer without knowing why it failed.
    """

    def __init__(self, message: str, *, code: int | None = None, request_id: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.request_id = request_id


class LocalProtocolError(ProtocolError):
    """This side tried to do something the protocol forbids (a bug in the caller)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that break the protocol (malformed, or not allowed now)."""


class RejectedError(DelaydError):
    """The server understood the request and refused it.

    ``code`` is the server's result or error code (an ``IntEnum`` of delayd.protocol),
    ``reason`` a sentence the user can act on ("delay of 3 years exceeds max_delay of
    2 years").
    """

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(f"{reason} ({getattr(code, 'name', code)})")
        self.code = code
        self.reason = reason


class NotLeaderError(RejectedError):
    """The server is a member of a group that does not lead it now (ERROR NOT_LEADER).

    ``leader`` is the leader's ``host:port`` for the listener asked, or None when the
    member knows no leader (an election is under way). Sending the same request to the
    leader is safe: message ids make a resent message a DUPLICATE."""

    def __init__(self, code: int, reason: str, leader: str | None) -> None:
        super().__init__(code, reason)
        self.leader = leader


class BusyError(DelaydError):
    """The server is overloaded or shutting down; the same request may succeed later."""


class ConnectionClosedError(DelaydError):
    """The connection was closed; requests still waiting for an answer are lost."""


class UnreachableError(DelaydError):
    """No connection to the server could be made: refused (nothing listens on that
    port), no route, an unknown host. Raised at once only by a client told not to retry
    its first connection (a command-line call, where a wrong address is likelier than a
    server still starting); otherwise connections are retried until the time-out."""


class DelaydTimeout(DelaydError, TimeoutError):
    """A deadline passed before the operation finished."""


class EtcdError(DelaydError):
    """etcd refused or failed a request (delayd.cluster.etcd).

    ``code`` is the gRPC status code etcd answered with (5 NOT_FOUND for a lease that
    expired or was revoked, 11 OUT_OF_RANGE for a watch on a compacted revision), or
    ``None`` when there is none; ``endpoint`` the URL that answered.
    """

    def __init__(self, message: str, *, code: int | None = None, endpoint: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.endpoint = endpoint


class EtcdUnavailable(EtcdError):
    """No endpoint could be reached, or the one asked did not answer in time.

    The message names every endpoint tried and why each failed. When ``outcome_unknown``
    is true the request reached etcd but its answer was lost (a read timeout or a
    dropped connection): a write may or may not have been applied, and the caller must
    read before it decides.
    """

    def __init__(self, message: str, *, endpoint: str = "", outcome_unknown: bool = False) -> None:
        super().__init__(message, endpoint=endpoint)
        self.outcome_unknown = outcome_unknown
