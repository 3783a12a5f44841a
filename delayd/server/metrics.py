"""Prometheus ``/metrics`` and ``/healthz`` for ``delayd serve``.

Values are read at scrape time by a custom collector from the plain counters of the
Receiver, the Replayer and the intake path (nothing is updated for metrics on the hot
path), together with the embedded broker's collector. A tiny trio HTTP/1.0 handler serves
them on the server's event loop, one request per connection.
"""

from __future__ import annotations

from collections.abc import Iterator

import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from delayd.protocol import ResultCode
from delayd.receiver import Receiver
from delayd.replay import Replayer
from delayd.server.intake import IntakePath

MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0
# Every refusal reason is exported from the start (at 0), so alerts see the series.
REFUSAL_CODES = [c for c in ResultCode if not c.is_success]


class IntakeCollector(Collector):
    """Intake and replay metrics of one delay server."""

    def __init__(self, receiver: Receiver, intake: IntakePath, replayer: Replayer) -> None:
        self.receiver = receiver
        self.intake = intake
        self.replayer = replayer

    def collect(self) -> Iterator[Metric]:
        receiver, replayer = self.receiver, self.replayer
        yield CounterMetricFamily(
            "delayd_intake_accepted_total",
            "Messages accepted and acknowledged durable since the server started.",
            value=receiver.accepted_total,
        )
        refused = CounterMetricFamily(
            "delayd_intake_refused_total",
            "Messages refused since the server started, by reason (result code).",
            labels=["reason"],
        )
        for code in REFUSAL_CODES:
            refused.add_metric([code.name.lower()], receiver.refused_total[code])
        yield refused
        yield CounterMetricFamily(
            "delayd_intake_past_due_total",
            "Accepted messages whose due time had passed on receipt (delivered at once).",
            value=receiver.past_due_total,
        )
        yield GaugeMetricFamily(
            "delayd_intake_pending_acks",
            "Messages appended to message_log and waiting for their fsync.",
            value=self.intake.pending_acks,
        )
        yield GaugeMetricFamily(
            "delayd_replay_lag_records",
            "Accepted messages not yet copied into schedule_log.",
            value=replayer.lag_records,
        )
        yield GaugeMetricFamily(
            "delayd_replay_lag_bytes",
            "Bytes of message_log not yet copied into schedule_log.",
            value=replayer.lag_bytes,
        )
        yield CounterMetricFamily(
            "delayd_replay_records_total",
            "Records appended to schedule_log since the server started.",
            value=replayer.replayed_total,
        )
        yield CounterMetricFamily(
            "delayd_replay_checkpoints_total",
            "Replay checkpoints written since the server started.",
            value=replayer.checkpoints,
        )
        yield GaugeMetricFamily(
            "delayd_message_log_end_offset_bytes",
            "Logical end offset of message_log.",
            value=replayer.log.end_offset,
        )
        yield GaugeMetricFamily(
            "delayd_schedule_log_open_files",
            "schedule_log bucket files currently open (bounded by max_open_files).",
            value=replayer.buckets.open_count,
        )


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
