"""Prometheus ``/metrics`` and ``/healthz`` for the broker, served by a tiny trio HTTP/1.0
handler (one request per connection) on the broker's event loop.

Values are read from the Broker at scrape time by a custom collector (prometheus-client's
exposition format and escaping), so nothing is updated on the hot path and nothing is
shared with another thread.
"""

from __future__ import annotations

import logging

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from delayd.broker.broker import Broker

log = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0


class BrokerCollector(Collector):
    """The broker's metrics, computed from its state on each scrape."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def collect(self):  # an iterator of metric families
        broker = self.broker
        store = broker.store
        yield CounterMetricFamily(
            "delayd_broker_messages_stored",
            "Messages stored (OK results) since the broker started.",
            value=store.messages_stored,
        )
        yield CounterMetricFamily(
            "delayd_broker_duplicates",
            "Messages acknowledged DUPLICATE (id already stored) since the broker started.",
            value=broker.duplicates,
        )
        yield CounterMetricFamily(
            "delayd_broker_refused",
            "Messages refused (invalid subject, size, delayed...) since the broker started.",
            value=broker.refused,
        )
        yield GaugeMetricFamily(
            "delayd_broker_commitlog_end_offset_bytes",
            "Logical end offset of the commitlog.",
            value=store.commitlog.end_offset,
        )
        yield GaugeMetricFamily(
            "delayd_broker_dedupe_ids", "Message ids in the idempotency window.", len(broker.window)
        )
        ends = GaugeMetricFamily(
            "delayd_broker_queue_end_offset",
            "One past the newest offset of each queue.",
            labels=["subject", "queue"],
        )
        for subject, queue in sorted(store.queues):
            ends.add_metric([subject, str(queue)], store.queue_end(subject, queue))
        yield ends
        lag = GaugeMetricFamily(
            "delayd_broker_consumer_lag",
            "Messages of a queue not yet committed by a consumer group.",
            labels=["group", "subject", "queue"],
        )
        for group, subject, queue, behind in broker.lags():
            lag.add_metric([group, subject, str(queue)], behind)
        yield lag


async def serve_metrics(
    broker: Broker,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve /metrics and /healthz on host:port until cancelled; reports bound addresses."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(broker))
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
