"""HELLO, the first exchange on every connection a client opens (docs/protocol.md).

One copy for every opener: the sender's links to broker processes (trio), the async
client (anyio) and the blocking client (a socket). The I/O stays the caller's: it
passes in how to write bytes and how to read the next ones (b"" once the peer closed),
and gets back a Connection ready for requests, or the exception that says why not.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from delayd.errors import ConnectionClosedError, RemoteProtocolError
from delayd.protocol.answers import error_to_exception
from delayd.protocol.connection import NEED_DATA, Connection, NeedData
from delayd.protocol.events import ConnectionClosed, Error, Event, Hello, HelloOk


def hello_bytes(conn: Connection, *, token: str | None, client_name: str) -> bytes:
    """The HELLO that opens ``conn`` (a CLIENT Connection), encoded."""
    hello = Hello(token=token, client_name=client_name, request_id=conn.next_request_id())
    return conn.send(hello)


def check_hello_answer(event: Event | NeedData, peer: str) -> None:
    """Return when ``event``, the server's answer to HELLO, is HELLO_OK.

    Raises the exception of an ERROR answer (error_to_exception: RejectedError for
    UNAUTHORIZED, a wrong or missing token; BusyError when the server is shutting down;
    RemoteProtocolError for a version in common missing), ConnectionClosedError when
    ``peer`` closed the connection instead, RemoteProtocolError for any other answer.
    """
    if isinstance(event, HelloOk):
        return
    if isinstance(event, Error):
        raise error_to_exception(event, f"HELLO to {peer}")
    if isinstance(event, ConnectionClosed):
        raise ConnectionClosedError(f"{peer} closed the connection during HELLO")
    raise RemoteProtocolError(f"{peer} answered HELLO with {type(event).__name__}")


async def say_hello(
    conn: Connection,
    send: Callable[[bytes], Awaitable[object]],
    receive: Callable[[], Awaitable[bytes]],
    *,
    token: str | None,
    client_name: str,
    peer: str,
) -> None:
    """Send HELLO on ``conn`` and wait for its answer; raises as check_hello_answer,
    and what ``send`` and ``receive`` raise. No time-out: the caller bounds it."""
    await send(hello_bytes(conn, token=token, client_name=client_name))
    while (event := conn.next_event()) is NEED_DATA:
        conn.receive_data(await receive())
    check_hello_answer(event, peer)


def say_hello_blocking(
    conn: Connection,
    send: Callable[[bytes], object],
    receive: Callable[[], bytes],
    *,
    token: str | None,
    client_name: str,
    peer: str,
) -> None:
    """say_hello for blocking I/O (deadlines are ``send``'s and ``receive``'s)."""
    send(hello_bytes(conn, token=token, client_name=client_name))
    while (event := conn.next_event()) is NEED_DATA:
        conn.receive_data(receive())
    check_hello_answer(event, peer)
