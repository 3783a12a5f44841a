"""Connection: one end of a delayd connection as a state machine, sans-I/O (as h11).

The caller moves the bytes; the Connection says what they mean and whether they are
allowed now::

    conn.receive_data(data)         # bytes from the socket; b"" when the peer closed
    event = conn.next_event()       # an Event, NEED_DATA, or ConnectionClosed
    data = conn.send(event)         # the bytes to write

Rules it enforces, on both sides:

- The client's first request is HELLO. A server rejects anything else before a good
  HELLO (HELLO_REQUIRED), a HELLO without a version in common (UNSUPPORTED_VERSION),
  and, when it has a token, a HELLO whose token is missing or wrong (UNAUTHORIZED;
  compared with hmac.compare_digest). Until HELLO succeeds a server accepts frames of
  at most PRE_HELLO_MAX_FRAME_SIZE, so an unauthenticated peer cannot make it buffer
  16 MiB.
- Every request carries a fresh non-zero request id and gets exactly one answer: the
  matching response or an ERROR. Either side refuses answers to requests that are not
  outstanding, and answers of the wrong kind.
- A RemoteProtocolError from next_event puts the connection in State.ERROR: the only
  thing left to send is a closing ERROR (``Error.for_exception(exc)``), and next_event
  raises again. After a closing ERROR is sent, or the peer closed, the connection is
  CLOSED and send/next_event raise ConnectionClosedError.
"""

from __future__ import annotations

import enum
import hmac
import types
from collections.abc import Mapping

from delayd.errors import ConnectionClosedError, LocalProtocolError, RemoteProtocolError
from delayd.protocol.bodies import decode_event, encode_event
from delayd.protocol.codes import RESPONSE_TO, Command, ErrorCode
from delayd.protocol.events import (
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    ConnectionClosed,
    Error,
    Event,
    Hello,
    HelloOk,
    Request,
    Response,
)
from delayd.protocol.frames import (
    DEFAULT_MAX_FRAME_SIZE,
    HEADER_SIZE,
    MAX_REQUEST_ID,
    FrameDecoder,
)

# A HELLO is a few hundred bytes; 64 KiB leaves room for long names and tokens.
PRE_HELLO_MAX_FRAME_SIZE = 64 * 1024


class Role(enum.Enum):
    CLIENT = "client"
    SERVER = "server"


CLIENT = Role.CLIENT
SERVER = Role.SERVER


class State(enum.Enum):
    AWAIT_HELLO = "await_hello"  # client: HELLO not sent yet; server: no good HELLO yet
    READY = "ready"  # any request may flow
    ERROR = "error"  # the peer broke the protocol; send a closing Error, then close
    CLOSED = "closed"  # a closing ERROR went either way, or the peer closed its end


class NeedData(enum.Enum):
    """The type of NEED_DATA, a singleton (an enum so type checkers can narrow it)."""

    NEED_DATA = "NEED_DATA"

    def __repr__(self) -> str:
        return "NEED_DATA"


NEED_DATA = NeedData.NEED_DATA


class Connection:
    """One end of a connection: ``role`` CLIENT or SERVER.

    ``max_frame_size`` (bytes, header included) bounds what this end accepts; a larger
    frame is refused from its header, before its body is buffered. ``token`` is the
    shared secret a SERVER requires in HELLO (None: no check); a client puts its token
    in ``Hello(token=...)`` itself, so passing one here is a ValueError.
    """

    def __init__(
        self,
        role: Role,
        *,
        max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
        token: str | None = None,
    ) -> None:
        if role is CLIENT and token is not None:
            raise ValueError("a client sends its token in Hello(token=...), not to Connection")
        self.role = role
        self.max_frame_size = max_frame_size
        initial_limit = max_frame_size
        if role is SERVER:
            initial_limit = min(max_frame_size, PRE_HELLO_MAX_FRAME_SIZE)
        # FrameDecoder validates max_frame_size (ValueError when out of range).
        self._decoder = FrameDecoder(max_frame_size)
        self._decoder.max_frame_size = initial_limit
        self._token = None if token is None else token.encode()
        self.protocol_version: int | None = None  # negotiated in HELLO
        self.peer_max_frame_size: int | None = None  # from HELLO_OK, on a client
        self._offered_versions = (MIN_PROTOCOL_VERSION, PROTOCOL_VERSION)
        self._pending: dict[int, Command] = {}  # request id -> request command
        self._next_id = 1
        self._hello_done = False  # client: HELLO sent; server: good HELLO received
        self._their_error = False  # the peer broke the protocol
        self._we_closed = False  # we sent a closing ERROR
        self._they_closed = False  # the peer sent a closing ERROR
        self._eof = False  # receive_data(b"") was called
        self._eof_seen = False  # ... and next_event returned ConnectionClosed

    def __repr__(self) -> str:
        return (
            f"<Connection {self.role.value} {self.state.name} "
            f"outstanding={len(self._pending)} buffered={self._decoder.buffered}>"
        )

    # --- introspection ----------------------------------------------------------------

    @property
    def state(self) -> State:
        if self._we_closed:
            return State.CLOSED
        if self._their_error:
            return State.ERROR
        if self._they_closed or self._eof_seen:
            return State.CLOSED
        return State.READY if self._hello_done else State.AWAIT_HELLO

    @property
    def outstanding(self) -> Mapping[int, Command]:
        """Requests sent (client) or received (server) and not answered yet, by id."""
        return types.MappingProxyType(self._pending)

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as events: after NEED_DATA, the start of
        a frame still arriving (0 between frames)."""
        return self._decoder.buffered

    @property
    def incomplete_frame_size(self) -> int:
        """After NEED_DATA: the announced size (header included) of the frame still
        arriving, once its header is in and checked against max_frame_size; else 0."""
        return self._decoder.incomplete_frame_size

    def next_request_id(self) -> int:
        """A request id not in use on this connection (client only): 1, 2, 3, ..."""
        if self.role is not CLIENT:
            raise LocalProtocolError("only a client assigns request ids")
        while self._next_id in self._pending:
            self._next_id += 1
        request_id = self._next_id
        self._next_id += 1
        return request_id

    # --- receiving --------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Bytes read from the peer; ``b""`` means the peer closed its end (EOF).

        Raises LocalProtocolError for data after EOF.
        """
        if self._eof:
            if data:
                raise LocalProtocolError("receive_data called with data after EOF")
            return
        if not data:
            self._eof = True
        elif not (self._their_error or self._we_closed):
            # Once the connection failed nothing more will be parsed; don't hoard it.
            self._decoder.feed(data)

    def next_event(self) -> Event | NeedData:
        """The next event from the peer, NEED_DATA, or ConnectionClosed after EOF.

        Raises RemoteProtocolError when the peer broke the protocol (and again on every
        later call), ConnectionClosedError after this side sent a closing ERROR.
        """
        if self._we_closed:
            raise ConnectionClosedError("this side sent a closing ERROR; the connection is over")
        if self._their_error:
            raise RemoteProtocolError("the peer already broke the protocol on this connection")
        try:
            frame = self._decoder.next_frame()
            if frame is None:
                if not self._eof:
                    return NEED_DATA
                if self._decoder.buffered:
                    raise RemoteProtocolError(
                        f"the peer closed the connection in the middle of a frame "
                        f"({self._decoder.buffered} bytes of it received)",
                        code=ErrorCode.MALFORMED,
                    )
                self._eof_seen = True
                return ConnectionClosed()
            if self._they_closed:
                raise RemoteProtocolError(
                    f"{frame.command.name} frame after the peer's closing ERROR",
                    code=ErrorCode.MALFORMED,
                )
            event = decode_event(frame.command, frame.flags, frame.request_id, frame.body)
            if self.role is SERVER:
                self._server_receive(event)
            else:
                self._client_receive(event)
        except RemoteProtocolError:
            self._their_error = True
            raise
        return event

    def _server_receive(self, event: Event) -> None:
        name = _check_sender(event, Request, "client", "server")
        request_id = event.request_id
        if request_id == 0:
            raise RemoteProtocolError(
                f"{name} with request id 0, which is reserved", code=ErrorCode.MALFORMED
            )
        if request_id in self._pending:
            raise RemoteProtocolError(
                f"{name} reuses request id {request_id}, which is still waiting for an answer",
                code=ErrorCode.MALFORMED,
            )
        if not self._hello_done:
            if not isinstance(event, Hello):
                raise RemoteProtocolError(
                    f"{name} before HELLO: a connection must start with a successful HELLO",
                    code=ErrorCode.HELLO_REQUIRED,
                    request_id=request_id,
                )
            self._accept_hello(event)
        elif isinstance(event, Hello):
            raise RemoteProtocolError(
                "a second HELLO on the same connection",
                code=ErrorCode.MALFORMED,
                request_id=request_id,
            )
        self._pending[request_id] = event.command

    def _accept_hello(self, hello: Hello) -> None:
        low = max(hello.min_version, MIN_PROTOCOL_VERSION)
        version = min(hello.max_version, PROTOCOL_VERSION)
        if version < low:
            raise RemoteProtocolError(
                f"no protocol version in common: the client speaks "
                f"{hello.min_version}..{hello.max_version}, this server "
                f"{MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}",
                code=ErrorCode.UNSUPPORTED_VERSION,
                request_id=hello.request_id,
            )
        if self._token is not None:
            if hello.token is None:
                raise RemoteProtocolError(
                    "this server requires a token and the HELLO carries none",
                    code=ErrorCode.UNAUTHORIZED,
                    request_id=hello.request_id,
                )
            # Constant time, so response timing does not reveal how much of it matched.
            if not hmac.compare_digest(hello.token.encode(), self._token):
                raise RemoteProtocolError(
                    "the HELLO token does not match the server's token",
                    code=ErrorCode.UNAUTHORIZED,
                    request_id=hello.request_id,
                )
        self.protocol_version = version
        self._hello_done = True
        self._decoder.max_frame_size = self.max_frame_size

    def _client_receive(self, event: Event) -> None:
        name = _check_sender(event, Response, "server", "client")
        request_id = event.request_id
        if isinstance(event, Error):
            if request_id != 0 and self._pending.pop(request_id, None) is None:
                raise RemoteProtocolError(
                    f"ERROR for request id {request_id}, which is not waiting for an answer",
                    code=ErrorCode.MALFORMED,
                )
            if event.close:
                self._they_closed = True
            return
        request = self._pending.get(request_id)
        if request is None:
            raise RemoteProtocolError(
                f"{name} for request id {request_id}, which is not waiting for an answer",
                code=ErrorCode.MALFORMED,
            )
        if RESPONSE_TO[request] is not event.command:
            raise RemoteProtocolError(
                f"{name} answers request id {request_id}, which was a {request.name}",
                code=ErrorCode.MALFORMED,
            )
        if isinstance(event, HelloOk):
            low, high = self._offered_versions
            if not low <= event.version <= high:
                raise RemoteProtocolError(
                    f"the server picked protocol version {event.version}, "
                    f"the client offered {low}..{high}",
                    code=ErrorCode.UNSUPPORTED_VERSION,
                )
            if event.max_frame_size < HEADER_SIZE:
                raise RemoteProtocolError(
                    f"the server's max_frame_size of {event.max_frame_size} bytes cannot "
                    f"hold a frame header ({HEADER_SIZE} bytes)",
                    code=ErrorCode.MALFORMED,
                )
            self.protocol_version = event.version
            self.peer_max_frame_size = event.max_frame_size
        del self._pending[request_id]

    # --- sending ----------------------------------------------------------------------

    def send(self, event: Event) -> bytes:
        """The bytes that carry ``event`` to the peer.

        Raises LocalProtocolError when the event is not allowed now (wrong role, request
        before HELLO, unknown or reused request id, too large for the peer, not
        encodable) — the connection is unchanged then and remains usable — and
        ConnectionClosedError once the connection is CLOSED.
        """
        if self._we_closed or self._they_closed or self._eof_seen:
            raise ConnectionClosedError(
                f"cannot send {type(event).__name__}: the connection is closed"
            )
        if self._their_error:
            if not (isinstance(event, Error) and event.close):
                raise LocalProtocolError(
                    "after the peer broke the protocol the only thing left to send is a "
                    "closing Error (Error.for_exception(exc))"
                )
        elif self.role is CLIENT:
            self._check_client_send(event)
        else:
            self._check_server_send(event)
        data = encode_event(event)
        limit = self.peer_max_frame_size or self.max_frame_size
        if len(data) > limit:
            raise LocalProtocolError(
                f"{type(event).__name__} is a frame of {len(data)} bytes; the peer accepts "
                f"at most {limit} (split the batch)"
            )
        # The event is valid and encoded: only now change the state.
        if self.role is CLIENT:
            self._pending[event.request_id] = event.command  # type: ignore[attr-defined]
            if isinstance(event, Hello):
                self._hello_done = True
                self._offered_versions = (event.min_version, event.max_version)
        else:
            self._pending.pop(event.request_id, None)
        if isinstance(event, Error) and event.close:
            self._we_closed = True
        return data

    def _check_client_send(self, event: Event) -> None:
        name = type(event).__name__
        if not isinstance(event, Request):
            raise LocalProtocolError(f"a client cannot send {name}, which only a server sends")
        request_id = event.request_id
        if not 0 < request_id <= MAX_REQUEST_ID:
            raise LocalProtocolError(
                f"{name} has request id {request_id}; use conn.next_request_id()"
            )
        if request_id in self._pending:
            raise LocalProtocolError(
                f"{name} reuses request id {request_id}, still waiting for an answer"
            )
        if isinstance(event, Hello):
            if self._hello_done:
                raise LocalProtocolError("HELLO was already sent on this connection")
        elif not self._hello_done:
            raise LocalProtocolError(f"{name} before HELLO: send Hello(...) first")

    def _check_server_send(self, event: Event) -> None:
        name = type(event).__name__
        if not isinstance(event, Response):
            raise LocalProtocolError(f"a server cannot send {name}, which only a client sends")
        request_id = event.request_id
        request = self._pending.get(request_id)
        if isinstance(event, Error):
            if request_id != 0 and request is None:
                raise LocalProtocolError(
                    f"ERROR for request id {request_id}, which is not waiting for an answer"
                )
            return
        if request is None:
            raise LocalProtocolError(
                f"{name} for request id {request_id}, which is not waiting for an answer"
            )
        if RESPONSE_TO[request] is not event.command:
            raise LocalProtocolError(
                f"{name} cannot answer request id {request_id}, a {request.name}"
            )
        if isinstance(event, HelloOk):
            if event.version != self.protocol_version:
                raise LocalProtocolError(
                    f"HelloOk(version={event.version}) but the negotiated version is "
                    f"{self.protocol_version} (use conn.protocol_version)"
                )
            if event.max_frame_size > self.max_frame_size:
                # The client would send frames this connection then refuses.
                raise LocalProtocolError(
                    f"HelloOk advertises max_frame_size={event.max_frame_size} but this "
                    f"connection accepts at most {self.max_frame_size} (use conn.max_frame_size)"
                )


def _check_sender(event: Event, expected: type[Event], peer: str, other: str) -> str:
    """The name of ``event``'s class, once it is one ``peer`` may send (an
    ``expected``). Raises RemoteProtocolError (MALFORMED) when only ``other`` sends it."""
    name = type(event).__name__
    if not isinstance(event, expected):
        raise RemoteProtocolError(
            f"a {peer} sent {name}, which only a {other} sends", code=ErrorCode.MALFORMED
        )
    return name
