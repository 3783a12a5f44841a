"""What a client makes of a server's answers, sans-I/O: each handed to the request
waiting for it, and ERROR frames turned into the exceptions of delayd.errors.

One copy for every side that sends requests: the clients, the sender's links to broker
processes and the HELLO handshake (delayd.protocol.handshake).
"""

from __future__ import annotations

from collections.abc import Callable

from delayd.errors import (
    BusyError,
    ConnectionClosedError,
    DelaydError,
    NotLeaderError,
    RejectedError,
    RemoteProtocolError,
)
from delayd.protocol.codes import ErrorCode
from delayd.protocol.connection import NEED_DATA, Connection
from delayd.protocol.events import ConnectionClosed, Error, Response
from delayd.protocol.redirect import leader_in

# The server says *our* bytes broke the protocol: a bug on this side or a peer that
# speaks another protocol. Retrying the same bytes cannot help.
_PROTOCOL_CODES = frozenset(
    {
        ErrorCode.MALFORMED,
        ErrorCode.UNSUPPORTED_VERSION,
        ErrorCode.HELLO_REQUIRED,
        ErrorCode.FRAME_TOO_LARGE,
        ErrorCode.UNKNOWN_COMMAND,
    }
)


def error_to_exception(error: Error, what: str) -> DelaydError:
    """The exception for ``error``, the server's answer to ``what`` ("SEND_BATCH to x:1").

    BUSY and SHUTTING_DOWN give BusyError (retryable), the protocol codes a
    RemoteProtocolError carrying the code, everything else (UNAUTHORIZED,
    INVALID_REQUEST, UNSUPPORTED, INTERNAL) a RejectedError with the server's reason,
    NOT_LEADER a NotLeaderError naming the leader (delayd.protocol.redirect).
    """
    text = f"{what}: {error.reason} ({error.code.name})"
    if error.code.is_retryable:
        return BusyError(text)
    if error.code in _PROTOCOL_CODES:
        return RemoteProtocolError(text, code=error.code, request_id=error.request_id)
    if error.code is ErrorCode.NOT_LEADER:
        return NotLeaderError(error.code, f"{what}: {error.reason}", leader_in(error.reason))
    if error.code is ErrorCode.UNAUTHORIZED:
        return RejectedError(
            error.code, f"{what}: {error.reason} — check the token given to the client"
        )
    return RejectedError(error.code, f"{what}: {error.reason}")


def route_answers(conn: Connection, deliver: Callable[[Response | Error], None], peer: str) -> None:
    """Hand every answer complete in ``conn``'s buffer to ``deliver``, in order.

    Raises, once no answer can follow: ConnectionClosedError when ``peer`` closed the
    connection; after delivering it, the exception of an ERROR about the whole
    connection (its close flag set, or request id 0); RemoteProtocolError when the
    bytes break the protocol. The requests still waiting are then lost.
    """
    while (event := conn.next_event()) is not NEED_DATA:
        if isinstance(event, ConnectionClosed):
            raise ConnectionClosedError(f"{peer} closed the connection")
        deliver(event)  # type: ignore[arg-type]
        if isinstance(event, Error) and (event.close or event.request_id == 0):
            raise error_to_exception(event, f"connection to {peer}")
