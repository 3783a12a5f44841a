"""The connection skeleton both servers build on (delayd.serving.connection), over a real
socket pair with a toy server: HELLO, errors as answers, the acker, request tasks, and
how the connection ends (at EOF, at a graceful stop)."""

from __future__ import annotations

import pytest
import trio

from delayd.protocol import (
    CLIENT,
    NEED_DATA,
    Connection,
    ConnectionClosed,
    Error,
    ErrorCode,
    Event,
    Hello,
    HelloOk,
    Pull,
    PullResult,
    Query,
    Stats,
    StatsResult,
)
from delayd.serving.connection import ServerConnection
from delayd.serving.connection_gate import ConnectionGate
from delayd.serving.connection_limits import ConnectionLimits

MAX_FRAME_SIZE = 1024 * 1024


class ToyConnection(ServerConnection[int]):
    """STATS is appended and answered once ``durable`` is set; a PULL is held in a
    request task until ``released``; a QUERY fails; ``stats`` is what STATS answers."""

    server_name = "toy-server"

    def __init__(self, stream: trio.SocketStream, *, finish_on_stop: bool = True) -> None:
        gate = ConnectionGate("toy", ConnectionLimits())
        super().__init__(stream, token=None, max_frame_size=MAX_FRAME_SIZE, gate=gate)
        self.finish_requests_on_stop = finish_on_stop  # type: ignore[misc]
        self.durable = trio.Event()
        self.released = trio.Event()
        self.stats: dict[str, str | int | float] = {"answered": 1}
        self.acknowledged: list[list[int]] = []
        self.acks_cancelled = False
        self.pulls_cancelled = 0

    async def _serve(self, event: Event, requests: trio.Nursery) -> None:
        if isinstance(event, Stats):
            await self._slots.acquire()
            self._unacked.append(event.request_id)
        elif isinstance(event, Pull):
            requests.start_soon(self._held_pull, event.request_id)
        else:
            raise ValueError(f"no {type(event).__name__} here")

    async def _acknowledge(self, ready: list[int]) -> None:
        try:
            await self.durable.wait()
        except trio.Cancelled:
            self.acks_cancelled = True
            raise
        self.acknowledged.append(ready)
        for request_id in ready:
            await self._answer(StatsResult(self.stats, request_id=request_id))
            self._slots.release()

    async def _held_pull(self, request_id: int) -> None:
        try:
            await self.released.wait()
        except trio.Cancelled:
            self.pulls_cancelled += 1
            raise
        await self._answer(PullResult(request_id=request_id))


class Client:
    """The client end: requests out, events in (None at EOF)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = Connection(CLIENT)

    async def send(self, event: Event) -> None:
        await self.stream.send_all(self.conn.send(event))

    async def receive(self) -> Event | None:
        while (event := self.conn.next_event()) is NEED_DATA:
            self.conn.receive_data(await self.stream.receive_some(65536))
        return None if isinstance(event, ConnectionClosed) else event

    async def hello(self) -> HelloOk:
        await self.send(Hello(client_name="toy-client", request_id=self.conn.next_request_id()))
        answer = await self.receive()
        assert isinstance(answer, HelloOk)
        return answer

    def rid(self) -> int:
        return self.conn.next_request_id()


async def started(nursery: trio.Nursery, **kwargs: bool) -> tuple[ToyConnection, Client]:
    a, b = trio.socket.socketpair()
    server = ToyConnection(trio.SocketStream(a), **kwargs)
    nursery.start_soon(server.run)
    return server, Client(trio.SocketStream(b))


async def test_hello_is_answered_with_the_server_name_and_frame_limit():
    async with trio.open_nursery() as nursery:
        _, client = await started(nursery)
        hello_ok = await client.hello()
        assert (hello_ok.server_name, hello_ok.max_frame_size) == ("toy-server", MAX_FRAME_SIZE)
        await client.stream.aclose()


async def test_a_failing_request_is_answered_internal_and_the_connection_serves_on():
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery)
        await client.hello()
        await client.send(Query(subject="s", message_id="m", request_id=(failed := client.rid())))
        error = await client.receive()
        assert isinstance(error, Error) and error.request_id == failed
        assert error.code is ErrorCode.INTERNAL and not error.close
        assert error.reason == "internal error: ValueError: no Query here"
        server.durable.set()
        await client.send(Stats(request_id=(rid := client.rid())))
        assert await client.receive() == StatsResult({"answered": 1}, request_id=rid)
        await client.stream.aclose()


async def test_an_answer_too_large_for_a_frame_is_answered_internal():
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery)
        await client.hello()
        server.stats = {f"stat{i}": "x" * 60_000 for i in range(MAX_FRAME_SIZE // 60_000 + 1)}
        server.durable.set()
        await client.send(Stats(request_id=(rid := client.rid())))
        error = await client.receive()
        assert isinstance(error, Error) and error.request_id == rid
        assert error.code is ErrorCode.INTERNAL
        assert error.reason.startswith("answer not encodable: StatsResult is a frame of ")
        await client.stream.aclose()


async def test_what_is_appended_while_the_acker_waits_is_acknowledged_at_once_in_order():
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery)
        await client.hello()
        rids = [client.rid() for _ in range(3)]
        await client.send(Stats(request_id=rids[0]))
        await trio.testing.wait_all_tasks_blocked()  # the acker holds it, waiting
        for rid in rids[1:]:
            await client.send(Stats(request_id=rid))
        await trio.testing.wait_all_tasks_blocked()
        server.durable.set()
        assert [(await client.receive()).request_id for _ in rids] == rids
        assert server.acknowledged == [rids[:1], rids[1:]]
        await client.stream.aclose()


async def test_at_eof_the_acker_and_the_request_tasks_are_cancelled():
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery)
        await client.hello()
        await client.send(Stats(request_id=client.rid()))
        await client.send(Pull(subject="s", group="g", consumer_id="c", request_id=client.rid()))
        await trio.testing.wait_all_tasks_blocked()
        await client.stream.aclose()
    assert server.acks_cancelled and server.pulls_cancelled == 1


@pytest.mark.parametrize("finish_on_stop", [True, False])
async def test_a_graceful_stop_answers_what_was_appended_then_sends_fin(finish_on_stop):
    async with trio.open_nursery() as nursery:
        server, client = await started(nursery, finish_on_stop=finish_on_stop)
        await client.hello()
        await client.send(Stats(request_id=(appended := client.rid())))
        await client.send(
            Pull(subject="s", group="g", consumer_id="c", request_id=(held := client.rid()))
        )
        await trio.testing.wait_all_tasks_blocked()
        server.stop_reading()
        await client.send(Stats(request_id=client.rid()))  # after the stop: never served
        await trio.testing.wait_all_tasks_blocked()
        server.durable.set()
        server.released.set()
        answers = [await client.receive(), await client.receive()]
        if finish_on_stop:
            assert {a.request_id for a in answers} == {appended, held}
            assert await client.receive() is None  # FIN after the last answer
        else:
            assert answers == [StatsResult({"answered": 1}, request_id=appended), None]
        await client.stream.aclose()
    assert not server.acks_cancelled
    assert server.pulls_cancelled == (0 if finish_on_stop else 1)
