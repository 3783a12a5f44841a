"""The delay server's TCP listener: accepts producer connections until stopped.

Stopping is two-phase so that a graceful shutdown acknowledges what it appended: first
the listening sockets close and every connection stops taking requests (its in-flight
batches still get their answers), then, after ``grace_s``, whatever is left is cancelled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import trio

from delayd.listen import bound_addresses, open_listeners
from delayd.server.connection import DelayConnection

Address = tuple[str, int]


class IntakeListener:
    """Serves ``make_connection(stream)`` for every accepted socket."""

    def __init__(self, make_connection: Callable[[trio.SocketStream], DelayConnection]) -> None:
        self.make_connection = make_connection
        self._connections: set[DelayConnection] = set()
        self._accept_scope = trio.CancelScope()
        self._connections_scope = trio.CancelScope()
        self._stopping = False
        self._done = trio.Event()

    async def serve(
        self,
        host: str,
        port: int,
        *,
        listeners: list[trio.SocketListener] | None = None,
        task_status: trio.TaskStatus[list[Address]],
    ) -> None:
        """Listen on host:port (0: a free port), or on ``listeners`` already bound there,
        until ``stop``; reports bound addresses. Raises ListenError."""
        try:
            if listeners is None:
                listeners = await open_listeners("intake", host, port)
            addresses = bound_addresses(listeners)
            with self._connections_scope:
                async with trio.open_nursery() as connections:
                    with self._accept_scope:
                        async with trio.open_nursery() as accept:
                            await accept.start(
                                partial(
                                    trio.serve_listeners,
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
