"""The HTTP side of Prometheus metrics: /metrics, /healthz and /readyz for any registry.

Shared by the broker and the delay server, each of which builds its own registry of
collectors. A deliberately small HTTP/1.0 responder on trio: one request per connection,
bounded in size and time, so a slow or hostile scraper cannot hold the server.

``/healthz`` answers 200 whenever the process answers at all (liveness). ``/readyz``
answers 200 ``ready`` once the process serves, and 503 ``starting: <why>`` before
(readiness: recovery still running, listeners not up); the process says which through a
``Readiness`` it updates as it starts. Once serving, a problem the process reports
through ``Readiness.watch`` (a full disk) makes it 503 ``not ready: <why>`` while it
lasts: the process keeps serving what it can (delivery, consumers, /metrics).
"""

from __future__ import annotations

from collections.abc import Callable

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from delayd.serving.listeners import bound_addresses, open_listeners
from delayd.serving.tls import ServerTls

MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0
USAGE = b"GET /metrics, /healthz or /readyz\n"


class Readiness:
    """Whether the process is ready to serve, and if not, why: what /readyz reports.

    Starts not ready (``reason`` "starting", or the one given); the process calls
    ``starting("recovering message_log")`` as it moves through its start-up and
    ``set_ready()`` once it serves. A start-up step running in a worker thread may set
    it too: /readyz reads the one attribute once per request.
    """

    __slots__ = ("_problems", "reason")

    def __init__(self, reason: str | None = "starting") -> None:
        self.reason = reason  # None once ready
        self._problems: list[Callable[[], str | None]] = []

    @property
    def ready(self) -> bool:
        return self.reason is None and self.problem() is None

    def watch(self, problem: Callable[[], str | None]) -> None:
        """Also not ready while ``problem()`` returns a reason (called per /readyz)."""
        self._problems.append(problem)

    def problem(self) -> str | None:
        """The first reason a watched problem gives now, or None."""
        for check in self._problems:
            reason = check()
            if reason is not None:
                return reason
        return None

    def starting(self, reason: str) -> None:
        """Not ready (again), because of ``reason`` (shown in the 503 body)."""
        self.reason = reason

    def set_ready(self) -> None:
        self.reason = None


async def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    *,
    readiness: Readiness | None = None,
    listeners: list[trio.SocketListener] | None = None,
    tls: ServerTls | None = None,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve /metrics, /healthz and /readyz on host:port (or on ``listeners`` already
    bound there) until cancelled, over TLS when ``tls`` is given; reports the bound
    addresses. /readyz follows ``readiness``; None means always ready, for a caller that
    starts serving metrics only once it serves. Raises ListenError when host:port cannot
    be bound."""
    if listeners is None:
        listeners = await open_listeners("metrics", host, port)
    addresses = bound_addresses(listeners)

    async def handle(socket_stream: trio.SocketStream) -> None:
        stream: trio.abc.Stream | None = socket_stream
        try:
            with trio.move_on_after(REQUEST_TIMEOUT_S):
                if tls is not None:
                    stream = await tls.accept(socket_stream, REQUEST_TIMEOUT_S)
                    if stream is None:
                        return
                request = await _read_head(stream)
                status, content_type, body = _respond(request, registry, readiness)
                head = (
                    f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                )
                await stream.send_all(head.encode() + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await (stream or socket_stream).aclose()

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(addresses)


async def _read_head(stream: trio.abc.ReceiveStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data and b"\n\n" not in data and len(data) < MAX_REQUEST_BYTES:
        chunk = await stream.receive_some(MAX_REQUEST_BYTES)
        if not chunk:
            break
        data += chunk
    return data


def _respond(
    request: bytes, registry: CollectorRegistry, readiness: Readiness | None
) -> tuple[str, str, bytes]:
    parts = request.split(b"\r\n", 1)[0].split()
    if len(parts) < 2 or parts[0] not in (b"GET", b"HEAD"):
        return "400 Bad Request", "text/plain", USAGE
    path = parts[1].split(b"?", 1)[0]
    if path == b"/metrics":
        return "200 OK", CONTENT_TYPE_LATEST, generate_latest(registry)
    if path == b"/healthz":
        return "200 OK", "text/plain", b"ok\n"
    if path == b"/readyz":
        if readiness is None:
            return "200 OK", "text/plain", b"ready\n"
        if readiness.reason is not None:
            body = f"starting: {readiness.reason}\n"
        elif (problem := readiness.problem()) is not None:
            body = f"not ready: {problem}\n"
        else:
            return "200 OK", "text/plain", b"ready\n"
        return "503 Service Unavailable", "text/plain", body.encode()
    return "404 Not Found", "text/plain", b"not found: " + USAGE
