"""The trio side of a replication connection: events in from a stream, one at a time."""

from __future__ import annotations

import trio

from delayd.replication.wire import Event, WireDecoder

RECEIVE_BYTES = 256 * 1024


async def receive_event(stream: trio.abc.ReceiveStream, decoder: WireDecoder) -> Event | None:
    """The next event from ``stream``, or None at EOF. Raises WireError for a bad
    frame, trio.BrokenResourceError when the connection breaks."""
    while True:
        event = decoder.next_event()
        if event is not None:
            return event
        data = await stream.receive_some(RECEIVE_BYTES)
        if not data:
            return None
        decoder.feed(data)
