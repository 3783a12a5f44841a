"""The read side of a server connection: bytes from a trio stream into protocol events.

Shared by the broker's and the delay server's connections (trio wiring over the sans-I/O
``delayd.protocol.Connection``, as h11's examples wire it to a socket).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from delayd.errors import RemoteProtocolError
from delayd.protocol import NEED_DATA, Connection, ConnectionClosed, Error, Event

log = logging.getLogger(__name__)

RECEIVE_BYTES = 256 * 1024


async def read_and_dispatch(
    stream: trio.abc.ReceiveStream,
    conn: Connection,
    peer: object,
    dispatch: Callable[[Event], Awaitable[object]],
) -> bytes | None:
    """Feed ``conn`` from ``stream`` and await ``dispatch(event)`` for each event, in order.

    Returns None at EOF (or when the stream breaks), or the closing ERROR frame to send
    when the peer broke the protocol; the caller sends it and closes the connection.
    """
    while True:
        try:
            data = await stream.receive_some(RECEIVE_BYTES)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return None
        conn.receive_data(data)
        while True:
            try:
                event = conn.next_event()
            except RemoteProtocolError as exc:
                log.info("closing %s: %s", peer, exc)
                return conn.send(Error.for_exception(exc))
            if event is NEED_DATA:
                break
            if isinstance(event, ConnectionClosed):
                return None
            await dispatch(event)
