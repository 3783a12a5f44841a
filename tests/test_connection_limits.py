"""Connection limits in process (delayd.serving.frame_reader, connection_gate, frame_budget):
the HELLO and frame deadlines on virtual time, the frame budget, the connection cap on
a real loopback listener, and the rate-limited log of failed HELLOs."""

from __future__ import annotations

import contextlib
import logging

import pytest
import trio

from delayd.errors import RemoteProtocolError
from delayd.protocol import (
    CLIENT,
    NEED_DATA,
    PROTOCOL_VERSION,
    SERVER,
    Cancel,
    Connection,
    Error,
    ErrorCode,
    Hello,
    HelloOk,
    Stats,
    StatsResult,
)
from delayd.protocol.bodies import encode_event
from delayd.server.config import ConfigError, config_from_mapping
from delayd.serving.connection_gate import ConnectionGate
from delayd.serving.connection_limits import ConnectionLimits, default_max_connections
from delayd.serving.frame_budget import FrameBudget
from delayd.serving.frame_reader import read_and_dispatch

LIMITS = ConnectionLimits(
    max_connections=2,
    hello_timeout_ms=10_000,
    frame_timeout_ms=30_000,
    max_unfinished_frame_bytes=3 * 1024 * 1024,
)


def hello_frame(request_id: int = 1) -> bytes:
    return encode_event(Hello(client_name="limits-test", request_id=request_id))


def stats_frame(request_id: int) -> bytes:
    return encode_event(Stats(request_id=request_id))


class Served:
    """read_and_dispatch over one end of a socket pair, answering HELLO and STATS."""

    def __init__(self, gate: ConnectionGate) -> None:
        self.gate = gate
        self.conn = Connection(SERVER, max_frame_size=16 * 1024 * 1024)
        self.events: list[object] = []
        self.closing: Error | None = None
        self.ended_at: float | None = None

    async def run(self, stream: trio.SocketStream) -> None:
        async def dispatch(event) -> None:
            self.events.append(event)
            if isinstance(event, Hello):
                answer = HelloOk(
                    PROTOCOL_VERSION, "test", self.conn.max_frame_size, request_id=event.request_id
                )
            else:
                answer = StatsResult({}, request_id=event.request_id)
            await stream.send_all(self.conn.send(answer))

        final = await read_and_dispatch(stream, self.conn, "peer", dispatch, self.gate)
        self.ended_at = trio.current_time()
        await stream.aclose()
        if final is not None:
            client = Connection(CLIENT)
            client.receive_data(final)
            self.closing = client.next_event()  # type: ignore[assignment]

    async def run_beside(self, stream: trio.SocketStream, peer, *args) -> None:
        """``run`` while ``peer(*args)`` plays the client; the peer is cancelled once
        the connection ends."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer, *args)
            await self.run(stream)
            nursery.cancel_scope.cancel()


async def trickle(stream: trio.SocketStream, data: bytes, every_s: float) -> None:
    """Send ``data`` one byte every ``every_s`` seconds, until the server hangs up."""
    with contextlib.suppress(trio.BrokenResourceError):  # closed at the deadline
        for byte in data:
            await stream.send_all(bytes([byte]))
            await trio.sleep(every_s)


async def pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


async def test_a_connection_without_hello_is_closed_at_the_hello_deadline(autojump_clock):
    gate = ConnectionGate("test", LIMITS)
    served = Served(gate)
    server, client = await pair()
    start = trio.current_time()
    await served.run(server)
    assert served.ended_at - start == pytest.approx(10.0)
    assert isinstance(served.closing, Error) and served.closing.close
    assert served.closing.code is ErrorCode.TIMEOUT
    assert "HELLO within 10000 ms" in served.closing.reason
    assert gate.hello_failures[ErrorCode.TIMEOUT] == 1
    await client.aclose()


async def test_a_trickled_hello_is_closed_at_the_hello_deadline(autojump_clock):
    gate = ConnectionGate("test", LIMITS)
    served = Served(gate)
    server, client = await pair()
    start = trio.current_time()

    await served.run_beside(server, trickle, client, hello_frame(), 1)
    assert served.ended_at - start == pytest.approx(10.0)
    assert served.closing.code is ErrorCode.TIMEOUT
    assert served.events == []


async def test_a_frame_trickled_after_hello_is_closed_at_the_frame_deadline(autojump_clock):
    gate = ConnectionGate("test", LIMITS)
    served = Served(gate)
    server, client = await pair()
    started = {}

    async def slowloris() -> None:
        await client.send_all(hello_frame())
        await trio.sleep(100)  # idle after HELLO: allowed
        started["at"] = trio.current_time()
        await trickle(client, stats_frame(2), 7)

    await served.run_beside(server, slowloris)
    assert served.ended_at - started["at"] == pytest.approx(30.0)
    assert served.closing.code is ErrorCode.TIMEOUT
    assert "not complete 30000 ms after its first byte" in served.closing.reason
    assert [type(e) for e in served.events] == [Hello]
    assert gate.protocol_errors[ErrorCode.TIMEOUT] == 1


async def test_frames_sent_back_to_back_never_meet_the_frame_deadline(autojump_clock):
    """Each frame is complete in 20 s, and the next one has always begun: the clock
    restarts with every frame, so 20 frames over 400 s are all served."""
    gate = ConnectionGate("test", LIMITS)
    served = Served(gate)
    server, client = await pair()
    frames = [hello_frame()] + [stats_frame(rid) for rid in range(2, 22)]
    data = b"".join(frames)
    # Cut so that every chunk ends inside the next frame.
    cuts = [sum(map(len, frames[: i + 1])) + 5 for i in range(len(frames) - 1)]

    async def sender() -> None:
        start = 0
        for cut in [*cuts, len(data)]:
            await client.send_all(data[start:cut])
            start = cut
            await trio.sleep(20)
        await client.send_eof()

    async def drain() -> None:
        while await client.receive_some(65536):
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        nursery.start_soon(drain)
        await served.run(server)
    assert served.closing is None  # EOF, not a timeout
    assert len(served.events) == 21


async def test_a_large_frame_waits_for_room_in_the_budget_and_then_completes(autojump_clock):
    """Budget 3 MiB: two 2 MiB frames cannot arrive at once. The second is not read
    until the first completes; its own deadline starts when it gets the room."""
    gate = ConnectionGate("test", LIMITS)
    one, two = Served(gate), Served(gate)
    s1, c1 = await pair()
    s2, c2 = await pair()
    big = encode_event(Stats(request_id=2))  # header only; grown below
    body = b"\0" * (2 * 1024 * 1024)
    header = bytearray(big[:24])
    header[16:20] = len(body).to_bytes(4, "little")  # announce 2 MiB (CRC fails later)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(one.run, s1)
        nursery.start_soon(two.run, s2)
        for client in (c1, c2):
            await client.send_all(hello_frame())
            await client.receive_some(65536)
        await c1.send_all(bytes(header) + body[:1000])
        await trio.sleep(1)
        assert gate.budget.reserved == 24 + len(body)
        await c2.send_all(bytes(header) + body[:1000])
        await trio.sleep(1)
        assert gate.budget.waiting == 1  # the second frame waits, unread
        await trio.sleep(29)  # the first frame's deadline passes (30 s): it is closed
        assert one.closing is not None and one.closing.code is ErrorCode.TIMEOUT
        assert gate.budget.waiting == 0  # the second one has the room now
        assert gate.budget.reserved == 24 + len(body)
        await trio.sleep(28)
        assert two.closing is None  # its deadline started with its reservation (30 s)
        await trio.sleep(2)
        assert two.closing is not None and two.closing.code is ErrorCode.TIMEOUT
    assert gate.budget.reserved == 0


async def test_the_budget_serves_waiters_in_order_and_a_huge_frame_alone(autojump_clock):
    budget = FrameBudget(100)
    assert await budget.reserve(60) == 60
    order = []

    async def wait_for(name: str, size: int) -> None:
        got = await budget.reserve(size)
        order.append((name, got))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait_for, "huge", 500)  # more than the budget: waits for all
        await trio.sleep(1)
        nursery.start_soon(wait_for, "small", 10)  # room now, but behind the huge one
        await trio.sleep(1)
        assert order == []
        budget.release(60)
        await trio.sleep(1)
        assert order == [("huge", 100)]
        budget.release(100)
    assert order == [("huge", 100), ("small", 10)]


async def test_connections_beyond_the_cap_are_refused_with_a_reason(autojump_clock):
    gate = ConnectionGate("test", LIMITS)  # max_connections=2
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]

    async def handler(stream: trio.SocketStream) -> None:
        await Served(gate).run(stream)

    async def connect_and_hello() -> tuple[trio.SocketStream, Connection]:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        conn = Connection(CLIENT)
        await stream.send_all(conn.send(Hello(request_id=conn.next_request_id())))
        return stream, conn

    async def answer(stream: trio.SocketStream, conn: Connection):
        while (event := conn.next_event()) is NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        return event

    async with trio.open_nursery() as nursery:
        await nursery.start(gate.serve, handler, listeners)
        first = [await connect_and_hello() for _ in range(2)]
        for stream, conn in first:
            assert isinstance(await answer(stream, conn), HelloOk)
        assert gate.open == 2
        stream, conn = await connect_and_hello()
        refusal = await answer(stream, conn)
        assert isinstance(refusal, Error) and refusal.close
        assert refusal.code is ErrorCode.TOO_MANY_CONNECTIONS and refusal.code.is_retryable
        assert "max_connections (2)" in refusal.reason
        assert await stream.receive_some(100) == b""  # then closed
        assert gate.refused["max_connections"] == 1
        await first[0][0].aclose()
        await trio.sleep(1)
        assert gate.open == 1
        stream, conn = await connect_and_hello()  # room again
        assert isinstance(await answer(stream, conn), HelloOk)
        nursery.cancel_scope.cancel()


async def test_failed_hellos_are_logged_once_per_interval_with_a_count(autojump_clock, caplog):
    gate = ConnectionGate("test", ConnectionLimits())
    caplog.set_level(logging.WARNING, logger="delayd.serving.connection_gate")
    secret = "s3cret-token"
    for _ in range(50):
        server = Connection(SERVER, token="right")
        server.receive_data(encode_event(Hello(token=secret, request_id=1)))
        with pytest.raises(RemoteProtocolError) as failure:
            server.next_event()
        closing = Error.for_exception(failure.value)
        gate.closed_by_protocol_error(closing.code, closing.reason, after_hello=False, peer="p")
        await trio.sleep(0.1)
    assert len(caplog.records) == 1
    assert "UNAUTHORIZED" in caplog.text
    await trio.sleep(10)
    gate.closed_by_protocol_error(closing.code, closing.reason, after_hello=False, peer="p")
    assert len(caplog.records) == 2
    assert "and 49 more like it" in caplog.records[1].getMessage()
    assert secret not in caplog.text
    assert gate.hello_failures[ErrorCode.UNAUTHORIZED] == 51


@pytest.mark.parametrize(
    ("soft", "cap"), [(256, 64), (1024, 256), (4096, 1536), (65536, 10_000), (16, 4)]
)
def test_the_default_cap_leaves_a_reserve_for_the_logs(soft, cap):
    assert default_max_connections(soft) == cap


def test_invalid_limits_name_the_key():
    with pytest.raises(ValueError, match="hello_timeout_ms must be a positive integer"):
        ConnectionLimits(hello_timeout_ms=0)
    with pytest.raises(ValueError, match="max_connections must be an integer >= 0"):
        ConnectionLimits(max_connections=-1)


def test_the_connection_keys_are_checked_in_both_configurations():
    config = config_from_mapping(
        {
            "server": {"max_connections": 100, "hello_timeout_ms": 500},
            "broker": {"max_connections": 7},
        }
    )
    assert config.connection_limits.connection_cap == 100
    assert config.connection_limits.hello_timeout_s == 0.5
    assert config.broker.connection_limits.connection_cap == 7
    with pytest.raises(ConfigError, match=r"server\.max_connections must be an integer >= 0"):
        config_from_mapping({"server": {"max_connections": -1}})
    with pytest.raises(ConfigError, match="frame_timeout_ms must be a positive integer"):
        config_from_mapping({"broker": {"frame_timeout_ms": 0}})


def test_the_incomplete_frame_size_is_known_once_its_header_is_in():
    server = Connection(SERVER)
    hello = hello_frame()
    server.receive_data(hello)
    assert isinstance(server.next_event(), Hello)
    frame = encode_event(Cancel("an-id-long-enough-for-a-body", request_id=2))
    assert len(frame) > 40
    for cut in range(len(frame)):
        conn = Connection(SERVER)
        conn.receive_data(hello + frame[:cut])
        assert isinstance(conn.next_event(), Hello)
        assert conn.next_event() is NEED_DATA
        assert conn.buffered == cut
        assert conn.incomplete_frame_size == (len(frame) if cut >= 24 else 0)
