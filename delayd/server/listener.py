"""The delay server's TCP listener: accepts producer connections until stopped.

Stopping is two-phase so that a graceful shutdown acknowledges what it appended: first
the listening sockets close and every connection stops taking requests (its in-flight
batches still get their answers), then, after ``grace_s``, whatever is left is cancelled.

Accepting goes through the listener's ConnectionGate: the connection cap (a connection
beyond it gets ERROR TOO_MANY_CONNECTIONS) and an accept loop that outlives EMFILE.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import trio

from delayd.connection_gate import ConnectionGate
from delayd.server.connection import DelayConnection

Address = tuple[str, int]


class IntakeListener:
    """Serves ``make_connection(stream)`` for every accepted socket."""

    def __init__(
        self,
        make_connection: Callable[[trio.SocketStream], DelayConnection],
        gate: ConnectionGate,
    ) -> None:
        self.make_connection = make_connection
        self.gate = gate
        self._connections: set[DelayConnection] = set()
        self._accept_scope = trio.CancelScope()
        self._connections_scope = trio.CancelScope()
        self._stopping = False
        self._done = trio.Event()

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[list[Address]]
    ) -> None:
        """Listen on host:port (0: a free port) until ``stop``; reports bound addresses."""
        try:
            listeners = await trio.open_tcp_listeners(port, host=host)
            addresses = [listener.socket.getsockname()[:2] for listener in listeners]
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
        connection = self.make_connection(stream)
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
        most ``grace_s`` seconds, then cancel them. Returns once ``serve`` returned."""
        self._stopping = True
        self._accept_scope.cancel()
        for connection in list(self._connections):
            connection.stop_reading()
        with trio.move_on_after(grace_s):
            await self._done.wait()
        self._connections_scope.cancel()
        await self._done.wait()
