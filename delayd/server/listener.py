"""The delay server's TCP listener: accepts producer connections until stopped, with
the two-phase graceful stop of delayd.serving.stoppable_listener (in-flight batches answered,
then FIN), through the intake's ConnectionGate (cap, EMFILE, counts)."""

from __future__ import annotations

from collections.abc import Callable

import trio

from delayd.server.connection import DelayConnection
from delayd.serving.connection_gate import ConnectionGate
from delayd.serving.stoppable_listener import StoppableListener
from delayd.serving.tls import ServerTls


class IntakeListener(StoppableListener[DelayConnection]):
    """Serves ``make_connection(stream)`` for every producer socket ``gate`` admits,
    over TLS when ``tls`` is given."""

    def __init__(
        self,
        make_connection: Callable[[trio.abc.Stream], DelayConnection],
        gate: ConnectionGate,
        tls: ServerTls | None = None,
    ) -> None:
        super().__init__("intake", make_connection, gate, tls)
