"""Test helpers for the broker: a broker process on a loopback port, and a raw blocking
client built on delayd.protocol.Connection over a plain socket (the client library is
tested separately; these tests must not depend on it)."""

from __future__ import annotations

import dataclasses
import re
import select
import socket
import subprocess
import time
from pathlib import Path

from delayd.protocol import (
    CLIENT,
    NEED_DATA,
    CommitOffset,
    Connection,
    ConnectionClosed,
    Error,
    Event,
    Heartbeat,
    Hello,
    JoinGroup,
    Message,
    Pull,
    Query,
    Request,
    SendBatch,
    SendResult,
    Stats,
)
from tests.process_support import DELAYD, ROOT, ChildProcess, child_env

READY = re.compile(r"delayd broker listening on (\S+):(\d+)")
METRICS = re.compile(r"metrics on https?://(\S+):(\d+)/metrics")
START_TIMEOUT_S = 20.0


class BrokerProcess(ChildProcess):
    """``delayd broker`` in a child process on a free port of 127.0.0.1; ``start()``
    returns once the process printed its ready line."""

    def __init__(
        self,
        data_dir: Path,
        *extra: str,
        log_path: Path | None = None,
        command_prefix: tuple[str, ...] = (),
    ) -> None:
        """``command_prefix``: put before the command (``ip netns exec NS``: on a host of
        tests/netns_support; its ``--listen`` in ``extra`` then)."""
        self.command_prefix = list(command_prefix)
        self.data_dir = data_dir
        self.extra = list(extra)
        self.log_path = log_path or data_dir.parent / f"{data_dir.name}-broker.log"
        self.proc: subprocess.Popen | None = None
        self.address: tuple[str, int] | None = None
        self.metrics_address: tuple[str, int] | None = None

    def start(self) -> BrokerProcess:
        assert self.proc is None or self.proc.poll() is not None
        args = [
            *self.command_prefix,
            *DELAYD,
            "broker",
            "--data",
            str(self.data_dir),
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            *self.extra,
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115  # handed to the child
        try:
            self.proc = subprocess.Popen(
                args, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, env=child_env()
            )
        finally:
            log.close()
        line = self._read_line(START_TIMEOUT_S)
        match = READY.search(line)
        assert match, f"broker did not start: {line!r}\n{self.log_tail()}"
        self.address = (match.group(1), int(match.group(2)))
        metrics = METRICS.search(self.log_path.read_text(errors="replace"))
        if metrics:
            self.metrics_address = (metrics.group(1), int(metrics.group(2)))
        return self

    def _read_line(self, timeout_s: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            return ""
        return self.proc.stdout.readline().decode(errors="replace")

    def client(self, token: str | None = None, **kwargs) -> RawClient:
        assert self.address is not None
        return RawClient(self.address, token=token, **kwargs)


class ServerClosed(Exception):
    """The broker closed the connection."""


class RawClient:
    """A blocking client: one Connection(CLIENT) over one socket. Requests may be
    pipelined: :meth:`send` returns the request id, :meth:`wait` the answer to one id
    (answers to other ids that arrive meanwhile are kept)."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        token: str | None = None,
        hello: bool = True,
        timeout_s: float = 15.0,
    ) -> None:
        self.sock = socket.create_connection(address, timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = Connection(CLIENT)
        self._answers: dict[int, Event] = {}
        self.closed_with: Error | None = None
        if hello:
            answer = self.request(Hello(token=token, client_name="tests"))
            if isinstance(answer, Error):
                raise AssertionError(f"HELLO refused: {answer}")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, request: Request) -> int:
        request_id = self.conn.next_request_id()
        self.sock.sendall(self.conn.send(dataclasses.replace(request, request_id=request_id)))
        return request_id

    def wait(self, request_id: int) -> Event:
        while request_id not in self._answers:
            event = self._next()
            if isinstance(event, Error) and event.request_id == 0:
                self.closed_with = event
                raise ServerClosed(str(event))
            self._answers[event.request_id] = event
        return self._answers.pop(request_id)

    def next_event(self) -> Event:
        """The next answer to arrive, whatever its request (one reader at a time)."""
        return self._next()

    def request(self, request: Request) -> Event:
        return self.wait(self.send(request))

    def _next(self) -> Event:
        while True:
            event = self.conn.next_event()
            if event is NEED_DATA:
                data = self.sock.recv(1 << 20)
                self.conn.receive_data(data)
                continue
            if isinstance(event, ConnectionClosed):
                raise ServerClosed("the broker closed the connection")
            return event

    # --- typed helpers: each asserts the answer is not an ERROR -------------------------

    def _ok(self, request: Request) -> Event:
        answer = self.request(request)
        assert not isinstance(answer, Error), answer
        return answer

    def send_batch(self, messages: list[Message]) -> list[SendResult]:
        return list(self._ok(SendBatch(messages)).results)

    def join(self, group: str, subject: str, consumer_id: str) -> tuple[int, ...]:
        return self._ok(JoinGroup(group, subject, consumer_id)).queues

    def heartbeat(self, group: str, subject: str, consumer_id: str) -> tuple[int, ...]:
        return self._ok(Heartbeat(group, subject, consumer_id)).queues

    def pull(
        self, subject: str, group: str, consumer_id: str, max_messages: int = 100, wait_ms: int = 0
    ) -> list[Message]:
        return list(self._ok(Pull(subject, group, consumer_id, max_messages, wait_ms)).messages)

    def commit(self, group: str, subject: str, queue: int, offset: int) -> None:
        self._ok(CommitOffset(group, subject, queue, offset))

    def commit_all(self, group: str, messages: list[Message]) -> None:
        """Commit queue_offset + 1 of the last message of each queue."""
        last: dict[tuple[str, int], int] = {}
        for m in messages:
            key = (m.subject, m.queue)
            last[key] = max(last.get(key, -1), m.queue_offset)
        for (subject, queue), offset in last.items():
            self.commit(group, subject, queue, offset + 1)

    def query(self, subject: str, *, message_id: str | None = None, key: str | None = None):
        return list(self._ok(Query(subject, message_id=message_id, key=key)).messages)

    def stats(self) -> dict[str, str | int | float]:
        return dict(self._ok(Stats()).stats)

    def drain(self, subject: str, group: str, consumer_id: str) -> list[Message]:
        """Join and pull until a PULL with wait_ms=0 comes back empty."""
        self.join(group, subject, consumer_id)
        out: list[Message] = []
        while True:
            got = self.pull(subject, group, consumer_id, 4096, 0)
            if not got:
                return out
            out += got


def messages(prefix: str, count: int, subject: str = "orders", **fields) -> list[Message]:
    return [
        Message(f"{prefix}-{i}", subject, body=b"%s body %d" % (prefix.encode(), i), **fields)
        for i in range(count)
    ]


def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Re-evaluate ``predicate`` (each call a request to the broker) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
