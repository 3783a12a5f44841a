"""The HTTP side of Prometheus metrics: /metrics and /healthz for any registry.

Shared by the broker and the delay server, each of which builds its own registry of
collectors. A deliberately small HTTP/1.0 responder on trio: one request per connection,
bounded in size and time, so a slow or hostile scraper cannot hold the server.
"""

from __future__ import annotations

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0


async def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve /metrics and /healthz on host:port until cancelled; reports bound addresses."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    addresses = [listener.socket.getsockname()[:2] for listener in listeners]

    async def handle(stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(REQUEST_TIMEOUT_S):
                request = await _read_head(stream)
                status, content_type, body = _respond(request, registry)
                head = (
                    f"HTTP/1.0 {status}\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                )
                await stream.send_all(head.encode() + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(addresses)


async def _read_head(stream: trio.SocketStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data and b"\n\n" not in data and len(data) < MAX_REQUEST_BYTES:
        chunk = await stream.receive_some(MAX_REQUEST_BYTES)
        if not chunk:
            break
        data += chunk
    return data


def _respond(request: bytes, registry: CollectorRegistry) -> tuple[str, str, bytes]:
    parts = request.split(b"\r\n", 1)[0].split()
    if len(parts) < 2 or parts[0] not in (b"GET", b"HEAD"):
        return "400 Bad Request", "text/plain", b"GET /metrics or /healthz\n"
    path = parts[1].split(b"?", 1)[0]
    if path == b"/metrics":
        return "200 OK", CONTENT_TYPE_LATEST, generate_latest(registry)
    if path == b"/healthz":
        return "200 OK", "text/plain", b"ok\n"
    return "404 Not Found", "text/plain", b"not found: try /metrics or /healthz\n"
