"""A TCP listener whose connections stop gracefully: the delay server's intake and the
broker both serve through one.

Stopping is two-phase so that a graceful shutdown acknowledges what it appended: first
the listening sockets close and every connection stops taking requests (its in-flight
batches still get their answers, then it closes with FIN: ``linger`` below), then,
after ``grace_s``, whatever is left is cancelled. Cancelling ``serve`` instead cuts
every connection at once.

Accepting goes through the listener's ConnectionGate (delayd.serving.connection_gate):
the connection cap (a connection beyond it gets ERROR TOO_MANY_CONNECTIONS) and an
accept loop that outlives EMFILE; the gate also counts what /metrics shows.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from functools import partial
from typing import Generic, Protocol, TypeVar

import trio

from delayd.serving.connection_gate import ConnectionGate
from delayd.serving.listeners import bound_addresses, open_listeners
from delayd.serving.tls import ServerTls
from delayd.tls import transport_of

Address = tuple[str, int]


class StoppableConnection(Protocol):
    async def run(self) -> None:
        """Serve the connection until it closes."""

    def stop_reading(self) -> None:
        """Take no more requests; answer the ones in flight, then close."""


C = TypeVar("C", bound=StoppableConnection)


class StoppableListener(Generic[C]):
    """Serves ``make_connection(stream)`` for every socket ``gate`` admits, over TLS
    when ``tls`` is given; ``name`` names the listener in errors ("intake", "the
    broker")."""

    def __init__(
        self,
        name: str,
        make_connection: Callable[[trio.abc.Stream], C],
        gate: ConnectionGate,
        tls: ServerTls | None = None,
    ) -> None:
        self.name = name
        self.make_connection = make_connection
        self.gate = gate
        self.tls = tls  # None: plain TCP
        self._connections: set[C] = set()
        self._accept_scope = trio.CancelScope()
        self._connections_scope = trio.CancelScope()
        self._stopping = False
        self._serving = False
        self._done = trio.Event()

    async def serve(
        self,
        host: str,
        port: int,
        *,
        listeners: list[trio.SocketListener] | None = None,
        task_status: trio.TaskStatus[list[Address]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on host:port (0: a free port), or on ``listeners`` already bound there,
        until ``stop``; reports bound addresses. Raises ListenError."""
        self._serving = True
        try:
            if listeners is None:
                listeners = await open_listeners(self.name, host, port)
            addresses = bound_addresses(listeners)
            with self._connections_scope:
                async with trio.open_nursery() as connections:
                    with self._accept_scope:
                        async with trio.open_nursery() as accept:
                            await accept.start(
                                partial(
                                    self.gate.serve,
                                    self._handle,
                                    listeners,
                                    handler_nursery=connections,
                                )
                            )
                            task_status.started(addresses)
                    # Accepting stopped (the listeners closed); connections finish here.
        finally:
            self._done.set()

    async def _handle(self, stream: trio.SocketStream) -> None:
        served: trio.abc.Stream | None = stream
        if self.tls is not None:  # the handshake counts against the HELLO deadline
            served = await self.tls.accept(stream, self.gate.limits.hello_timeout_s)
            if served is None:
                return
        connection = self.make_connection(served)
        if self._stopping:
            connection.stop_reading()
        self._connections.add(connection)
        try:
            await connection.run()
        finally:
            self._connections.discard(connection)

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    async def stop(self, grace_s: float = math.inf) -> None:
        """Close the listening sockets, let connections answer what is in flight for at
        most ``grace_s`` seconds, then cancel them. Returns once ``serve`` returned (at
        once if it never ran)."""
        self._stopping = True
        if not self._serving:
            return
        self._accept_scope.cancel()
        for connection in list(self._connections):
            connection.stop_reading()
        with trio.move_on_after(grace_s):
            await self._done.wait()
        self._connections_scope.cancel()
        await self._done.wait()


# After a stop: how long a client gets to read its last answers and close (linger).
LINGER_S = 2.0
LINGER_READ_BYTES = 64 * 1024


async def linger(stream: trio.abc.Stream) -> None:
    """Close a stopped connection without losing the answers just written to it: send
    FIN behind them, then read and drop what the client still sends until it closes
    too (at most LINGER_S). Closing a socket whose receive buffer holds unread requests
    sends RST instead of FIN, and the kernel then drops the answers it has not sent yet
    (RFC 2525, 2.17): batches appended, answers lost, the client resends, and
    the messages are stored twice. HTTP servers' "lingering close" is the same cure. The
    caller closes the stream afterwards."""
    stream = transport_of(stream)  # under TLS: its FIN after the records written
    if not isinstance(stream, trio.abc.HalfCloseableStream):
        return  # an in-memory stream (tests): no kernel to drop anything
    with (
        trio.move_on_after(LINGER_S),
        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
    ):
        await stream.send_eof()
        while await stream.receive_some(LINGER_READ_BYTES):
            pass
