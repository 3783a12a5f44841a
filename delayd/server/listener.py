"""The delay server's TCP listener: accepts producer connections until stopped, with
the two-phase graceful stop of delayd.serving.stoppable_listener (in-flight batches answered,
then FIN), through the intake's ConnectionGate (cap, EMFILE, counts)."""

from __future__ import annotations

from collections.abc import Callable

import trio

from delayd.server.connection import DelayConnection
from delayd.serving.connection_gate import ConnectionGate
from delayd.serving.stoppable_listener import StoppableListener


class IntakeListener(StoppableListener[DelayConnection]):
    """Serves ``make_connection(stream)`` for every producer socket ``gate`` admits."""

    def __init__(
        self,
        make_connection: Callable[[trio.SocketStream], DelayConnection],
        gate: ConnectionGate,
    ) -> None:
        super().__init__("intake", make_connection, gate)
