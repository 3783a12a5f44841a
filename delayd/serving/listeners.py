"""Opening a server's listening sockets, named, before anything slow.

Both servers bind every listener (intake, broker, metrics) first, before they recover
their logs: a port in use is then reported in a second, not after minutes of recovery,
and with the listener's name and address, not a bare ``[Errno 98]``. While recovery
runs, the bound sockets queue connections in their backlog; serving starts once it is
done.
"""

from __future__ import annotations

import trio

from delayd.address import format_address
from delayd.errors import DelaydError


class ListenError(DelaydError):
    """A listener could not be opened (address in use, not an address of this host…)."""

    def __init__(self, name: str, host: str, port: int, cause: OSError) -> None:
        self.name = name
        self.address = (host, port)
        reason = cause.strerror or str(cause)
        super().__init__(
            f"cannot listen for {name} on {format_address(host, port)}: {reason}. Another process "
            f"(a running delayd?) may hold the port: stop it, or choose another address "
            f"for {name}."
        )


async def open_listeners(name: str, host: str, port: int) -> list[trio.SocketListener]:
    """``trio.open_tcp_listeners`` on host:port (port 0: a free one) for the listener
    called ``name`` (for the error). Raises ListenError."""
    try:
        return await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise ListenError(name, host, port, exc) from None


def bound_addresses(listeners: list[trio.SocketListener]) -> list[tuple[str, int]]:
    """The (host, port) each listener is bound to (the real port when 0 was asked)."""
    return [listener.socket.getsockname()[:2] for listener in listeners]
