"""AsyncLink: one connection to a delayd server on anyio, with HELLO done.

Requests may overlap: a long-polling PULL does not hold up a HEARTBEAT or a COMMIT_OFFSET
behind it (protocol rule 4, answers in any order). A reader task, started by the owner
in its task group, routes each answer to the request waiting for it by request id; the
protocol state is the sans-I/O ``delayd.protocol.Connection`` the blocking client and
the servers use too.

A link is never reused after a failure: the producer or consumer above it opens a new
one (with back-off) and retries, which keeps the state here simple.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable

import anyio
import anyio.abc

from delayd.address import Address
from delayd.errors import ConnectionClosedError, DelaydError
from delayd.protocol import CLIENT, Connection, Error, Request, Response
from delayd.protocol.answers import error_to_exception, route_answers
from delayd.protocol.handshake import say_hello
from delayd.tls import ClientTls, handshake_failure

RECEIVE_SIZE = 256 * 1024  # bytes per read; a full PULL_RESULT in a few reads
# What the socket layer raises when the peer goes away, on either backend.
_LINK_ERRORS = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


async def _connect(address: Address, tls: ClientTls | None) -> anyio.abc.ByteStream:
    """A TCP stream to ``address``, with the TLS handshake done when ``tls`` is given.
    Raises OSError, ConnectionClosedError or TlsError (delayd.tls.handshake_failure)."""
    host, port = address
    if tls is None:
        return await anyio.connect_tcp(host, port)
    try:
        # Not standard_compatible: a server's close without close_notify is EOF (the
        # frames carry their own lengths; delayd.tls).
        return await anyio.connect_tcp(
            host,
            port,
            ssl_context=tls.ssl_context,
            tls_hostname=tls.server_name or host,
            tls_standard_compatible=False,
        )
    except ssl.SSLError as exc:
        raise handshake_failure(exc, str(address)) from None
    except (anyio.EndOfStream, anyio.BrokenResourceError):
        raise ConnectionClosedError(f"{address} closed the connection during TLS") from None


class _Waiter:
    """A request waiting for its answer."""

    __slots__ = ("done", "error", "on_answer", "response")

    def __init__(self, on_answer: Callable[[Response], object] | None) -> None:
        self.done = anyio.Event()
        self.response: Response | None = None
        self.error: DelaydError | None = None
        self.on_answer = on_answer


class AsyncLink:
    """A connection with HELLO done; ``request`` sends and waits for the answer.

    Create with ``await AsyncLink.open(...)``, then start ``link.run`` (the reader) in
    the owner's task group; ``abort()`` ends it.
    """

    def __init__(self, stream: anyio.abc.ByteStream, conn: Connection, addr: str) -> None:
        self.addr = addr
        self._stream = stream
        self._conn = conn
        self._waiters: dict[int, _Waiter] = {}
        self._outbox: list[bytes] = []  # frames waiting for the writer
        self._writing = False  # a task is writing the outbox
        self._scope = anyio.CancelScope()
        self.failure: DelaydError | None = None  # why the link ended; None while it is up

    @property
    def closed(self) -> bool:
        return self.failure is not None

    @property
    def protocol_version(self) -> int:
        """The version HELLO negotiated."""
        return self._conn.protocol_version or 0

    @classmethod
    async def open(
        cls,
        address: Address,
        *,
        token: str | None,
        client_name: str,
        tls: ClientTls | None = None,
    ) -> AsyncLink:
        """Connect to ``address`` (over TLS when ``tls`` is given) and do HELLO
        (delayd.protocol.handshake).

        Raises OSError when the connection cannot be made, TlsError when the TLS
        handshake fails, and what say_hello raises: ConnectionClosedError when it closes
        during HELLO, RejectedError (UNAUTHORIZED) for a wrong or missing token,
        BusyError when the server is shutting down, ProtocolError when the peer does not
        speak the delayd protocol; ssl.SSLError when TLS fails after the handshake (the
        server refused the client's certificate). No time-out here: the caller bounds
        the whole call.
        """
        addr = str(address)
        stream = await _connect(address, tls)
        try:
            # Requests are small and answered at once; Nagle would add up to 40 ms each.
            raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = cls(stream, Connection(CLIENT), addr)
            await say_hello(
                link._conn,
                stream.send,
                link._receive,
                token=token,
                client_name=client_name,
                peer=addr,
            )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stream.aclose()
            raise
        return link

    async def _receive(self) -> bytes:
        """The next bytes from the server; b"" once it closed."""
        try:
            return await self._stream.receive(RECEIVE_SIZE)
        except anyio.EndOfStream:
            return b""

    async def run(self) -> None:
        """The reader: route answers to their requests until the link ends. Never raises."""
        try:
            with self._scope:
                try:
                    while True:
                        self._conn.receive_data(await self._receive())
                        route_answers(self._conn, self._deliver, self.addr)
                except DelaydError as exc:
                    # Closed, or an ERROR about the whole connection, or bytes that break
                    # the protocol: every waiting request fails with it.
                    self._fail(exc)
                except _LINK_ERRORS as exc:
                    self._fail(ConnectionClosedError(f"connection to {self.addr} lost: {exc!r}"))
        finally:
            # Also when the owner's task group is cancelled at the same time as abort():
            # then the Cancelled belongs to the outer scope and passes through ours.
            self._fail(ConnectionClosedError(f"connection to {self.addr} closed"))
            with anyio.CancelScope(shield=True):
                await self._stream.aclose()

    def _deliver(self, answer: Response | Error) -> None:
        waiter = self._waiters.pop(answer.request_id, None)
        if waiter is not None:
            waiter.response = answer
            if waiter.on_answer is not None and not isinstance(answer, Error):
                waiter.on_answer(answer)
            waiter.done.set()

    def _fail(self, exc: DelaydError) -> None:
        if self.failure is None:
            self.failure = exc
        for waiter in self._waiters.values():
            waiter.error = self.failure
            waiter.done.set()
        self._waiters.clear()

    def abort(self, reason: str = "aborted") -> None:
        """End the link now; waiting requests get ConnectionClosedError."""
        self._fail(ConnectionClosedError(f"connection to {self.addr} {reason}"))
        self._scope.cancel()

    async def _write_outbox(self) -> None:
        """Write queued frames until none are left, joined into one write per round.

        Concurrent requests (several send_batch tasks, a heartbeat beside a PULL) queue
        their frames while a write is under way and go out together in the next one:
        fewer system calls here, and the server reads several frames at once, so one
        fsync acknowledges them all.
        """
        self._writing = True
        try:
            while self._outbox:
                data = b"".join(self._outbox) if len(self._outbox) > 1 else self._outbox[0]
                self._outbox.clear()
                await self._stream.send(data)
        except BaseException:
            # Cancelled or failed in the middle of a frame: the stream is out of step
            # with the protocol and cannot carry another frame.
            self.abort("lost in the middle of a write")
            raise
        finally:
            self._writing = False

    async def request(
        self,
        build: Callable[[int], Request],
        on_answer: Callable[[Response], object] | None = None,
    ) -> Response:
        """Send ``build(request_id)`` and return the server's answer.

        ``on_answer`` runs with the answer (not an ERROR) as the link reads it, before
        anything read after it: state that several requests change (a consumer's
        assignment and its prefetch) then follows the server's order, whichever task
        waits for which answer and whenever it runs. It must not block nor raise.

        Raises ConnectionClosedError when the link is or goes down before the answer
        (the request may or may not have been carried out), the mapped exception for an
        ERROR answer (see error_to_exception), LocalProtocolError for a request the
        protocol does not allow (too large a frame). The caller bounds the wait.
        """
        if self.failure is not None:
            raise ConnectionClosedError(f"connection to {self.addr} is down: {self.failure}")
        request = build(self._conn.next_request_id())
        data = self._conn.send(request)
        waiter = _Waiter(on_answer)
        self._waiters[request.request_id] = waiter
        try:
            self._outbox.append(data)
            if not self._writing:
                await self._write_outbox()
            await waiter.done.wait()
        except _LINK_ERRORS as exc:
            raise ConnectionClosedError(f"connection to {self.addr} lost: {exc!r}") from None
        finally:
            self._waiters.pop(request.request_id, None)
        if waiter.error is not None:
            raise waiter.error
        response = waiter.response
        if isinstance(response, Error):
            raise error_to_exception(response, f"{request.command.name} to {self.addr}")
        assert response is not None
        return response
