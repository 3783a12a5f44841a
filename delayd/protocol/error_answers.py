"""ERROR answers from a server turned into the exceptions of delayd.errors.

One mapping for every side that sends requests: the clients, the sender's broker links
and the HELLO handshake (delayd.protocol.handshake).
"""

from __future__ import annotations

from delayd.errors import BusyError, DelaydError, RejectedError, RemoteProtocolError
from delayd.protocol.codes import ErrorCode
from delayd.protocol.events import Error

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
    INVALID_REQUEST, UNSUPPORTED, INTERNAL) a RejectedError with the server's reason.
    """
    text = f"{what}: {error.reason} ({error.code.name})"
    if error.code.is_retryable:
        return BusyError(text)
    if error.code in _PROTOCOL_CODES:
        return RemoteProtocolError(text, code=error.code, request_id=error.request_id)
    if error.code is ErrorCode.UNAUTHORIZED:
        return RejectedError(
            error.code, f"{what}: {error.reason} — check the token given to the client"
        )
    return RejectedError(error.code, f"{what}: {error.reason}")
