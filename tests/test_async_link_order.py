"""AsyncLink applies ``on_answer`` in the order answers come on the connection, as the
reader reads them — not when the task waiting for each answer runs. The async consumer
depends on it: a HEARTBEAT's assignment and a PULL's messages must reach its
ConsumerState in the broker's order (delayd.client._consumer_state, the invariants), or
a queue given back and taken away again could hand out messages another member read.

A loopback server in a thread answers a PULL and a HEARTBEAT sent together in the
reverse order, in one write."""

from __future__ import annotations

import socket
import threading
from functools import partial

import trio

from delayd.address import parse_address
from delayd.client._async_link import AsyncLink
from delayd.protocol import (
    NEED_DATA,
    SERVER,
    Connection,
    Heartbeat,
    HeartbeatResult,
    Hello,
    HelloOk,
    Pull,
    PullResult,
    Request,
)
from tests.client_support import LoopbackListener


class AnswersInReverse(LoopbackListener):
    """HELLO, then the next two requests answered last first, in one write."""

    def accepted(self, sock: socket.socket) -> None:
        threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = Connection(SERVER)
        requests: list[Request] = []
        while len(requests) < 2:
            event = conn.next_event()
            if event is NEED_DATA:
                conn.receive_data(sock.recv(65536))
            elif isinstance(event, Hello):
                sock.sendall(conn.send(HelloOk(conn.protocol_version, request_id=event.request_id)))
            else:
                requests.append(event)
        answers = [self.answer(request) for request in reversed(requests)]
        sock.sendall(b"".join(conn.send(answer) for answer in answers))

    @staticmethod
    def answer(request: Request):
        if isinstance(request, Pull):
            return PullResult(request_id=request.request_id)
        assert isinstance(request, Heartbeat), request
        return HeartbeatResult((0, 1), request_id=request.request_id)


async def test_answers_are_applied_in_the_order_they_come_not_as_tasks_run() -> None:
    applied: list[tuple[str, list[str]]] = []  # (whose answer, the requests returned by then)
    returned: list[str] = []
    pull = partial(Pull, "s", "g", "c", 10, 0)
    heartbeat = partial(Heartbeat, "g", "s", "c")
    with AnswersInReverse() as server:
        link = await AsyncLink.open(parse_address(server.addr), token=None, client_name="t")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.run)

            async def ask(name: str, build) -> None:
                applying = lambda answer: applied.append((name, list(returned)))  # noqa: E731
                await link.request(lambda rid: build(request_id=rid), on_answer=applying)
                returned.append(name)

            with trio.fail_after(10):
                async with trio.open_nursery() as asking:
                    asking.start_soon(ask, "pull", pull)
                    await trio.sleep(0.05)  # the PULL goes out first
                    asking.start_soon(ask, "heartbeat", heartbeat)
            link.abort()
    # The server answered the HEARTBEAT first, both in one write: both applied in that
    # order as the reader read them, before either waiting task ran again.
    assert applied == [("heartbeat", []), ("pull", [])]
    assert sorted(returned) == ["heartbeat", "pull"]
