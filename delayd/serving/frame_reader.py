"""The read side of a server connection: bytes from a trio stream into protocol events.

Shared by the broker's and the delay server's connections (trio wiring over the sans-I/O
``delayd.protocol.Connection``, as h11's examples wire it to a socket), with the limits
of their listener's ConnectionGate:

- HELLO must succeed within ``hello_timeout_ms`` of the connection's start, and a frame
  must be complete within ``frame_timeout_ms`` of its first byte (of its reservation,
  for a large frame, see below): a silent or trickling peer (slowloris) is closed with
  ERROR TIMEOUT instead of holding a descriptor for ever. The frame clock restarts
  whenever a frame completes and after the reader was held up by its own requests, so a
  peer that keeps sending frames back to back never meets it. A connection idle between
  frames after HELLO is not timed out: pooled producers and consumers idle legitimately.
- A frame larger than UNBUDGETED_FRAME_BYTES reserves its announced size in the
  listener's FrameBudget before its body is read (delayd.serving.frame_budget says why).
- Events are dispatched one at a time, and ``dispatch`` may wait (for a slot, for room
  in the writer): reading stops meanwhile, so a peer that sends requests faster than it
  reads answers is pushed back by TCP and costs bounded memory.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import trio

from delayd.errors import RemoteProtocolError
from delayd.protocol import NEED_DATA, Connection, ConnectionClosed, Error, ErrorCode, Event
from delayd.serving.connection_gate import ConnectionGate
from delayd.serving.frame_budget import UNBUDGETED_FRAME_BYTES

RECEIVE_BYTES = 256 * 1024


async def read_and_dispatch(
    stream: trio.abc.ReceiveStream,
    conn: Connection,
    peer: object,
    dispatch: Callable[[Event], Awaitable[object]],
    gate: ConnectionGate,
) -> bytes | None:
    """Feed ``conn`` from ``stream`` and await ``dispatch(event)`` for each event, in order.

    Returns None at EOF (or when the stream breaks), or the closing ERROR frame to send
    when the peer broke the protocol or a deadline; the caller sends it and closes the
    connection.
    """
    limits, budget = gate.limits, gate.budget
    hello_deadline = trio.current_time() + limits.hello_timeout_s
    frame_deadline = math.inf  # of the frame arriving now; inf between frames
    reserved = 0  # of the budget, for the frame arriving now
    try:
        while True:
            if not reserved and (size := conn.incomplete_frame_size) > UNBUDGETED_FRAME_BYTES:
                reserved = await budget.reserve(size)
                frame_deadline = trio.current_time() + limits.frame_timeout_s
            after_hello = conn.protocol_version is not None
            deadline = frame_deadline if after_hello else min(hello_deadline, frame_deadline)
            try:
                data = await _receive(stream, deadline)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            if data is None:
                hello_missed = not after_hello and hello_deadline <= frame_deadline
                return _timed_out(conn, peer, gate, after_hello, hello_missed)
            conn.receive_data(data)
            completed = False
            while True:
                try:
                    event = conn.next_event()
                except RemoteProtocolError as exc:
                    closing = Error.for_exception(exc)
                    after_hello = conn.protocol_version is not None
                    gate.closed_by_protocol_error(
                        closing.code, closing.reason, after_hello=after_hello, peer=peer
                    )
                    return conn.send(closing)
                if event is NEED_DATA:
                    break
                if reserved:  # the frame it was reserved for is complete
                    budget.release(reserved)
                    reserved = 0
                completed = True
                if isinstance(event, ConnectionClosed):
                    return None
                await dispatch(event)
            if not conn.buffered:
                frame_deadline = math.inf
            elif completed or frame_deadline == math.inf:
                frame_deadline = trio.current_time() + limits.frame_timeout_s
    finally:
        if reserved:
            budget.release(reserved)


async def _receive(stream: trio.abc.ReceiveStream, deadline: float) -> bytes | None:
    """Bytes from ``stream`` (b"" at EOF), or None once ``deadline`` passed. Between
    frames after HELLO (no deadline, the common case) no cancel scope is entered: one
    costs about 4 µs here, a read per small batch on the intake path."""
    if deadline == math.inf:
        return await stream.receive_some(RECEIVE_BYTES)
    with trio.move_on_at(deadline):
        return await stream.receive_some(RECEIVE_BYTES)
    return None


def _timed_out(
    conn: Connection, peer: object, gate: ConnectionGate, after_hello: bool, hello_missed: bool
) -> bytes:
    """The closing ERROR TIMEOUT for a peer that missed a deadline."""
    limits = gate.limits
    if hello_missed:
        reason = f"no successful HELLO within {limits.hello_timeout_ms} ms of connecting"
    else:
        reason = (
            f"a frame was not complete {limits.frame_timeout_ms} ms after its first byte "
            f"({conn.buffered} bytes of it received)"
        )
    gate.closed_by_protocol_error(ErrorCode.TIMEOUT, reason, after_hello=after_hello, peer=peer)
    return conn.send(Error(ErrorCode.TIMEOUT, reason, close=True))
