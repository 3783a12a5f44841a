"""The client side every opener shares (delayd.protocol.handshake, .answers), against a
server Connection in memory: HELLO and its answer, and answers routed to their requests.
"""

from __future__ import annotations

import pytest

from delayd.errors import BusyError, ConnectionClosedError, RejectedError, RemoteProtocolError
from delayd.protocol import (
    CLIENT,
    PROTOCOL_VERSION,
    SERVER,
    Connection,
    Error,
    ErrorCode,
    Hello,
    HelloOk,
    State,
    Stats,
    StatsResult,
)
from delayd.protocol.answers import route_answers
from delayd.protocol.handshake import check_hello_answer, say_hello, say_hello_blocking


class InMemoryServer:
    """A server Connection that answers what the client sends it: HELLO_OK, or the
    closing ERROR its Connection makes of a HELLO it refuses."""

    def __init__(self, token: str | None = None) -> None:
        self.conn = Connection(SERVER, token=token)
        self.outbox: list[bytes] = []

    def receive(self, data: bytes) -> None:
        self.conn.receive_data(data)
        try:
            hello = self.conn.next_event()
        except RemoteProtocolError as exc:
            self.outbox.append(self.conn.send(Error.for_exception(exc)))
            return
        assert isinstance(hello, Hello)
        self.outbox.append(self.conn.send(HelloOk(PROTOCOL_VERSION, request_id=hello.request_id)))

    def next_bytes(self) -> bytes:
        return self.outbox.pop(0) if self.outbox else b""


def test_blocking_hello_accepted() -> None:
    server, client = InMemoryServer(), Connection(CLIENT)
    say_hello_blocking(
        client, server.receive, server.next_bytes, token=None, client_name="t", peer="s:1"
    )
    assert client.state is State.READY and server.conn.state is State.READY


def test_blocking_hello_with_a_wrong_token_is_refused_naming_the_peer() -> None:
    server = InMemoryServer(token="s3cret")
    with pytest.raises(RejectedError, match=r"HELLO to s:1: .*token") as caught:
        say_hello_blocking(
            Connection(CLIENT),
            server.receive,
            server.next_bytes,
            token="wrong",
            client_name="t",
            peer="s:1",
        )
    assert caught.value.code == ErrorCode.UNAUTHORIZED


async def test_async_hello_when_the_server_closes_instead() -> None:
    async def send(data: bytes) -> None:
        pass

    async def receive() -> bytes:
        return b""  # closed before answering

    with pytest.raises(ConnectionClosedError, match="s:1 closed the connection during HELLO"):
        await say_hello(Connection(CLIENT), send, receive, token=None, client_name="t", peer="s:1")


@pytest.mark.parametrize(
    ("answer", "raised", "words"),
    [
        (Error(ErrorCode.SHUTTING_DOWN, "bye", request_id=1), BusyError, "HELLO to s:1: bye"),
        (Error(ErrorCode.UNAUTHORIZED, "no", request_id=1), RejectedError, "check the token"),
        (Error(ErrorCode.MALFORMED, "bad", request_id=1), RemoteProtocolError, "bad"),
        (StatsResult({}, request_id=1), RemoteProtocolError, "answered HELLO with StatsResult"),
    ],
)
def test_hello_answers_that_are_not_hello_ok(answer, raised, words) -> None:
    with pytest.raises(raised, match=words):
        check_hello_answer(answer, "s:1")
    check_hello_answer(HelloOk(1, request_id=1), "s:1")  # returns


def connected() -> tuple[Connection, Connection]:
    client, server = Connection(CLIENT), Connection(SERVER)
    server.receive_data(client.send(Hello(client_name="t", request_id=client.next_request_id())))
    hello = server.next_event()
    client.receive_data(server.send(HelloOk(PROTOCOL_VERSION, request_id=hello.request_id)))
    client.next_event()
    return client, server


def test_answers_go_to_their_requests_in_order() -> None:
    client, server = connected()
    ids = [client.next_request_id() for _ in range(3)]
    for request_id in ids:
        server.receive_data(client.send(Stats(request_id=request_id)))
        assert server.next_event().request_id == request_id
    for request_id in reversed(ids):  # answered in any order
        client.receive_data(server.send(StatsResult({"n": request_id}, request_id=request_id)))
    delivered: list[int] = []
    route_answers(client, lambda answer: delivered.append(answer.request_id), "s:1")
    assert delivered == list(reversed(ids))


def test_an_error_about_the_connection_is_delivered_then_raised() -> None:
    client, server = connected()
    first, second = client.next_request_id(), client.next_request_id()
    for request_id in (first, second):
        server.receive_data(client.send(Stats(request_id=request_id)))
        server.next_event()
    answer = StatsResult({}, request_id=first)
    closing = Error(ErrorCode.SHUTTING_DOWN, "stopping", request_id=second, close=True)
    client.receive_data(server.send(answer) + server.send(closing))
    delivered: list[object] = []
    with pytest.raises(BusyError, match="connection to s:1: stopping"):
        route_answers(client, delivered.append, "s:1")
    assert delivered == [answer, closing]


def test_the_end_of_the_stream_ends_the_routing() -> None:
    client, _ = connected()
    client.receive_data(b"")
    with pytest.raises(ConnectionClosedError, match="s:1 closed the connection"):
        route_answers(client, lambda answer: None, "s:1")
