"""The skeleton of one client connection, shared by the delay server's
(delayd.server.connection) and the broker's (delayd.broker.server): a
delayd.protocol.Connection over a trio stream, with the tasks around it. A server
subclasses ServerConnection and writes only its requests (``_serve``), how it answers
what it appended (``_acknowledge``) and the errors it expects (``_error_for``).

Per connection:

- a reader parses frames and dispatches requests one at a time, in arrival order, under
  the listener's deadlines and frame budget (delayd.serving.frame_reader). HELLO is
  answered here; every other request goes to ``_serve``;
- a writer task owns the sending side (delayd.serving.frame_writer: whole frames in
  order, a bounded queue), so a client that stops reading slows only itself;
- an acker answers what ``_serve`` appended (``_unacked``) once durable: one wait covers
  every request appended before it, so a group commit costs one wake-up, not a task per
  request (a task costs scheduling steps, and on a busy event loop those are most of
  the cost of a small batch);
- request tasks (``_serve`` starts them in the nursery it is given) carry what waits
  for something other than the group commit.

Every request that is not answered on the reader holds one of ``max_in_flight`` slots
until its answer is queued to the writer, not merely until it is decided; a request
answered on the reader waits there for room in the writer. So a client that pipelines
requests and never reads the answers holds a bounded number of them, then its reader
stops and TCP pushes back: it stalls only itself.

Bad input never crashes the server: a protocol violation gets the closing ERROR the
Connection names and the socket is closed; a failure in one request is answered with
``_error_for`` (by default ERROR INTERNAL, logged with its traceback).

Closing: at EOF, when the peer is gone or after a protocol error, nobody is left to
answer: the acker and the request tasks are cancelled and their answers dropped.
``stop_reading`` (the listener's graceful stop) instead takes no more requests, answers
everything appended, then closes with FIN after the last answer; what the client sent
after the stop is read and dropped, never served (delayd.serving.stoppable_listener's
``linger``). A request is stored and answered, or not stored.
"""

from __future__ import annotations

import abc
import contextlib
import logging
from typing import ClassVar, Generic, TypeVar

import trio

from delayd.errors import ConnectionClosedError, LocalProtocolError
from delayd.protocol import SERVER, Connection, Error, ErrorCode, Event, Hello, HelloOk
from delayd.serving.answer_queue import AnswerQueue
from delayd.serving.connection_gate import ConnectionGate
from delayd.serving.frame_reader import read_and_dispatch
from delayd.serving.frame_writer import FrameWriter
from delayd.serving.stoppable_listener import linger
from delayd.tls import transport_of

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 64  # requests holding a slot (each server says which) per connection
OUTBOX_FRAMES = 16  # answers queued for the writer task before the one answering waits

T = TypeVar("T")


class ServerConnection(abc.ABC, Generic[T]):
    """One client connection (see the module docstring); ``T`` is what ``_serve`` puts
    in ``_unacked`` for ``_acknowledge`` to answer."""

    server_name: ClassVar[str]  # in HELLO_OK
    # Whether request tasks still running at a graceful stop are let finish and answer
    # (True), or are cancelled with the reader because they hold nothing to answer for.
    finish_requests_on_stop: ClassVar[bool] = True

    def __init__(
        self,
        stream: trio.abc.Stream,
        *,
        token: str | None,
        max_frame_size: int,
        gate: ConnectionGate,
    ) -> None:
        self.stream = stream
        self.gate = gate  # admitted the connection; counts its protocol errors
        self.conn = Connection(SERVER, token=token, max_frame_size=max_frame_size)
        self.peer = _peer_name(stream)
        self._slots = trio.Semaphore(MAX_IN_FLIGHT)
        self._unacked: AnswerQueue[T] = AnswerQueue()  # appended, not answered yet
        self._writer = FrameWriter(stream, OUTBOX_FRAMES)
        self._read_scope = trio.CancelScope()
        self._stopping = False

    async def run(self) -> None:
        """Serve the connection until it closes; the stream is closed on return."""
        try:
            async with trio.open_nursery() as outer:
                outer.start_soon(self._write_loop, outer.cancel_scope)
                async with trio.open_nursery() as acks:
                    await acks.start(self._ack_loop)
                    async with trio.open_nursery() as requests:
                        final = None
                        with self._read_scope:
                            final = await self._read_loop(requests)
                        if not self._stopping:  # EOF, the peer gone, a protocol error
                            acks.cancel_scope.cancel()
                            requests.cancel_scope.cancel()
                        elif not self.finish_requests_on_stop:
                            requests.cancel_scope.cancel()
                    self._unacked.close()  # the acker ends once all are answered
                if final is not None:
                    with contextlib.suppress(trio.BrokenResourceError):
                        await self._writer.send(final)
                self._writer.close()
            if self._stopping and not self._writer.broken:
                await linger(self.stream)  # FIN after the last answer, not RST
        finally:
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    def stop_reading(self) -> None:
        """Take no more requests; answer the ones appended, then close."""
        self._stopping = True
        self._read_scope.cancel()

    @abc.abstractmethod
    async def _serve(self, event: Event, requests: trio.Nursery) -> None:
        """Serve one request (never HELLO), on the reader: answer it, append it to
        ``_unacked``, or start a task in ``requests``. An exception is answered with
        ``_error_for``."""

    @abc.abstractmethod
    async def _acknowledge(self, ready: list[T]) -> None:
        """Answer ``ready`` (appended by ``_serve``, oldest first) once durable, in
        order, releasing a slot as each answer is queued."""

    def _error_for(self, exc: Exception, event: Event) -> Error:
        """The answer to ``event`` whose serving raised ``exc``: ERROR INTERNAL, logged
        with its traceback. A server answers the errors it expects before calling this,
        and re-raises one that must stop it."""
        log.exception("internal error serving %s from %s", type(event).__name__, self.peer)
        return internal_error(exc, event)

    async def _answer(self, event: Event) -> None:
        """Encode and queue one answer; dropped when the connection is already closed.
        An answer the protocol refuses to encode (a PULL_RESULT over the frame limit)
        becomes ERROR INTERNAL, so the request is answered all the same."""
        try:
            data = self.conn.send(event)
        except ConnectionClosedError:
            return
        except LocalProtocolError as exc:
            log.error("cannot send %s to %s: %s", type(event).__name__, self.peer, exc)
            reason = f"answer not encodable: {exc}"[: Error.MAX_REASON_LENGTH]
            try:
                data = self.conn.send(
                    Error(ErrorCode.INTERNAL, reason, request_id=event.request_id)
                )
            except (ConnectionClosedError, LocalProtocolError):
                return
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._writer.send(data)

    async def _write_loop(self, connection_scope: trio.CancelScope) -> None:
        await self._writer.run()
        if self._writer.broken:
            connection_scope.cancel()  # the peer is gone: stop reading, drop answers

    async def _read_loop(self, requests: trio.Nursery) -> bytes | None:
        """Parse and dispatch until EOF (None) or a protocol error (the closing frame)."""

        async def dispatch(event: Event) -> None:
            await self._dispatch(event, requests)

        return await read_and_dispatch(self.stream, self.conn, self.peer, dispatch, self.gate)

    async def _dispatch(self, event: Event, requests: trio.Nursery) -> None:
        try:
            if isinstance(event, Hello):
                version = self.conn.protocol_version or 1
                hello_ok = HelloOk(
                    version, self.server_name, self.conn.max_frame_size, request_id=event.request_id
                )
                await self._answer(hello_ok)
            else:
                await self._serve(event, requests)
        except Exception as exc:  # one bad request must not end the server
            await self._answer(self._error_for(exc, event))

    async def _ack_loop(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while (ready := await self._unacked.take_all()) is not None:
            await self._acknowledge(ready)


def internal_error(exc: Exception, event: Event) -> Error:
    """ERROR INTERNAL for ``event``, its reason naming ``exc``."""
    reason = f"internal error: {type(exc).__name__}: {exc}"
    return Error(ErrorCode.INTERNAL, reason[: Error.MAX_REASON_LENGTH], request_id=event.request_id)


def _peer_name(stream: trio.abc.Stream) -> str:
    """``host:port`` of a TCP stream's peer (under TLS too), for logs; a Unix socket's
    path, or ``?`` when there is none (a socketpair, an in-memory stream)."""
    try:
        name = transport_of(stream).socket.getpeername()  # type: ignore[attr-defined]
    except (AttributeError, OSError):
        return "?"
    return "{}:{}".format(*name[:2]) if isinstance(name, tuple) else name or "?"
