"""BlockingLink: one connection to a delayd server on a plain socket, with HELLO done.

For synchronous code (Django, Flask, scripts): no event loop, no threads of its own. The
owner serialises use with a lock. A request waits for its own answer; ``pipeline`` keeps
up to ``window`` requests in flight on the one connection, so that a big ``send_batch``
pays one round trip (and shares fsyncs) instead of one per frame. The protocol state is
the same sans-I/O ``delayd.protocol.Connection`` the async client uses.

Deadlines are ``time.monotonic()`` values; a link whose request timed out is closed,
since an answer may still arrive for it and the connection state is then unknown.
"""

from __future__ import annotations

import math
import socket
import ssl
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial

from delayd.address import Address
from delayd.errors import ConnectionClosedError, DelaydError, DelaydTimeout
from delayd.protocol import CLIENT, Connection, Error, Request, Response
from delayd.protocol.answers import error_to_exception, route_answers
from delayd.protocol.handshake import say_hello_blocking
from delayd.tls import ClientTls, handshake_failure

RECEIVE_SIZE = 256 * 1024  # bytes per recv()


def _secure(sock: socket.socket, host: str, addr: str, tls: ClientTls) -> ssl.SSLSocket:
    """``sock`` with the TLS handshake done (within the socket's time-out); closed on
    failure. Raises DelaydTimeout, TlsError, ConnectionClosedError or OSError."""
    try:
        return tls.ssl_context.wrap_socket(sock, server_hostname=tls.server_name or host)
    except TimeoutError:
        sock.close()
        raise DelaydTimeout(f"TLS handshake with {addr} timed out") from None
    except ssl.SSLError as exc:
        sock.close()
        raise handshake_failure(exc, addr) from None
    except BaseException:
        sock.close()
        raise


class BlockingLink:
    """A socket with HELLO done. Not thread-safe: the owner holds a lock around calls."""

    def __init__(self, sock: socket.socket, conn: Connection, addr: str) -> None:
        self.addr = addr
        self._sock = sock
        self._conn = conn
        self._answers: deque[Response | Error] = deque()  # read, not yet handed out
        self._ended: DelaydError | None = None  # why no answer follows those
        # Requests whose answers a pipeline did not wait for (``detach``): request id ->
        # what takes the answer when a later read on this link meets it.
        self._detached: dict[int, Callable[[Response | Error], None]] = {}
        self.closed = False

    @property
    def protocol_version(self) -> int:
        """The version HELLO negotiated."""
        return self._conn.protocol_version or 0

    @classmethod
    def open(
        cls,
        address: Address,
        *,
        token: str | None,
        client_name: str,
        deadline: float,
        tls: ClientTls | None = None,
    ) -> BlockingLink:
        """Connect (over TLS when ``tls`` is given) and do HELLO
        (delayd.protocol.handshake) before ``deadline`` (monotonic seconds). A
        certificate refused in the handshake is a TlsError.

        Raises OSError when the connection cannot be made, DelaydTimeout at the
        deadline, and what say_hello_blocking raises: ConnectionClosedError when the
        server closes during HELLO, RejectedError (UNAUTHORIZED) for a wrong token,
        BusyError when the server is shutting down, ProtocolError when the peer does
        not speak the protocol.
        """
        addr = str(address)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DelaydTimeout(f"no time left to connect to {addr}")
        try:
            sock = socket.create_connection(address, timeout=remaining)
        except TimeoutError:
            raise DelaydTimeout(f"connecting to {addr} timed out") from None
        if tls is not None:
            sock = _secure(sock, address.host, addr, tls)
        link = cls(sock, Connection(CLIENT), addr)
        try:
            # Requests are small and answered at once; Nagle would add up to 40 ms each.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            say_hello_blocking(
                link._conn,
                partial(link._write, deadline=deadline),
                partial(link._receive, deadline),
                token=token,
                client_name=client_name,
                peer=addr,
            )
        except BaseException:
            link.close()
            raise
        return link

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()

    # --- requests ---------------------------------------------------------------------

    def request(self, build: Callable[[int], Request], deadline: float) -> Response:
        """Send ``build(request_id)`` and return its answer (ERRORs raised as exceptions).

        Raises ConnectionClosedError when the connection is lost (the request may or may
        not have been carried out), DelaydTimeout at ``deadline`` (monotonic seconds;
        the link is closed then), the mapped exception for an ERROR answer.
        """
        results: list[Response | DelaydError] = []
        self.pipeline([build], deadline, on_answer=lambda _i, answer: results.append(answer))
        (answer,) = results
        if isinstance(answer, DelaydError):
            raise answer
        return answer

    def pipeline(
        self,
        builds: Sequence[Callable[[int], Request]],
        deadline: float,
        *,
        on_answer: Callable[[int, Response | DelaydError], None],
        window: int = 8,
        detach: int = 0,
    ) -> None:
        """Send each request, keeping at most ``window`` unanswered, until all are answered.

        ``on_answer(index, answer)`` gets each answer as it arrives: the response, or the
        exception an ERROR answer maps to. The window bounds what waits in the socket
        buffers: a client that only wrote and never read would, with enough requests,
        deadlock against a server blocked writing answers nobody reads. Raises as
        ``request`` does for the connection as a whole; answers already passed to
        ``on_answer`` stand.

        The answers of the first ``detach`` requests are not waited for: this returns
        once the others are answered, and theirs go to ``on_answer`` when a read on this
        link meets them (this call, a later one, or ``settle_detached``); lost with the
        link if it closes first.
        """
        if self.closed:
            raise ConnectionClosedError(f"connection to {self.addr} is closed")
        waiting: dict[int, tuple[int, Request]] = {}  # request id -> (index, request)
        next_index = 0
        try:
            while next_index < len(builds) or any(i >= detach for i, _ in waiting.values()):
                # Write as many as the window allows in one sendall: fewer system calls,
                # and the server can read them in one go.
                chunks = []
                while next_index < len(builds) and len(waiting) < window:
                    request = builds[next_index](self._conn.next_request_id())
                    chunks.append(self._conn.send(request))
                    waiting[request.request_id] = (next_index, request)
                    next_index += 1
                if chunks:
                    self._write(b"".join(chunks), deadline)
                answer = self._read_answer(deadline)
                if answer.request_id in waiting:
                    index, request = waiting.pop(answer.request_id)
                    self._hand(answer, index, request, on_answer)
            for request_id, (index, request) in waiting.items():
                self._detached[request_id] = partial(
                    self._hand, index=index, request=request, on_answer=on_answer
                )
        except BaseException:
            self.close()
            raise

    def settle_detached(self, deadline: float) -> None:
        """Read until every detached request (``pipeline``) is answered. Raises as
        ``pipeline`` does."""
        try:
            while self._detached:
                self._read_answer(deadline)
        except BaseException:
            self.close()
            raise

    def _hand(
        self,
        answer: Response | Error,
        index: int,
        request: Request,
        on_answer: Callable[[int, Response | DelaydError], None],
    ) -> None:
        if isinstance(answer, Error):
            what = f"{request.command.name} to {self.addr}"
            exc = error_to_exception(answer, what)
            if answer.close:
                raise exc  # the server closes: the other requests are lost too
            on_answer(index, exc)
        else:
            on_answer(index, answer)

    # --- bytes ------------------------------------------------------------------------

    def _write(self, data: bytes, deadline: float) -> None:
        self._settimeout(deadline)
        try:
            self._sock.sendall(data)
        except TimeoutError:
            raise DelaydTimeout(f"writing to {self.addr} timed out") from None
        except OSError as exc:
            raise ConnectionClosedError(f"connection to {self.addr} lost: {exc!r}") from None

    def _read_answer(self, deadline: float) -> Response | Error:
        """The next answer to a request; raises, once the answers that came before it
        are handed out, what ended the connection (route_answers). The answer of a
        detached request goes to its taker on the way (and is returned too)."""
        while not self._answers:
            if self._ended is not None:
                raise self._ended
            self._conn.receive_data(self._receive(deadline))
            try:
                route_answers(self._conn, self._keep_answer, self.addr)
            except DelaydError as exc:
                self._ended = exc
        answer = self._answers.popleft()
        taker = self._detached.pop(answer.request_id, None)
        if taker is not None:
            taker(answer)
        return answer

    def _keep_answer(self, answer: Response | Error) -> None:
        if answer.request_id:  # an ERROR about the whole connection is raised instead
            self._answers.append(answer)

    def _receive(self, deadline: float) -> bytes:
        """The next bytes from the server; b"" once it closed."""
        self._settimeout(deadline)
        try:
            return self._sock.recv(RECEIVE_SIZE)
        except TimeoutError:
            raise DelaydTimeout(f"no answer from {self.addr} in time") from None
        except ssl.SSLError as exc:  # the server refused this client's certificate
            raise handshake_failure(exc, self.addr) from None
        except OSError as exc:
            raise ConnectionClosedError(f"connection to {self.addr} lost: {exc!r}") from None

    def _settimeout(self, deadline: float) -> None:
        if math.isinf(deadline):
            self._sock.settimeout(None)
            return
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DelaydTimeout(f"the deadline passed before {self.addr} answered")
        self._sock.settimeout(remaining)
