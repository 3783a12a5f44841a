"""Prometheus ``/metrics`` and ``/healthz`` for the broker, served by a tiny trio HTTP/1.0
handler (one request per connection) on the broker's event loop.

Values are read from the Broker at scrape time by a custom collector (prometheus-client's
exposition format and escaping), so nothing is updated on the hot path and nothing is
shared with another thread.
"""

from __future__ import annotations

import logging

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from delayd.broker.broker import Broker
from delayd.metrics_http import serve_metrics as serve_registry

log = logging.getLogger(__name__)


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
    """Serve the broker's /metrics and /healthz on host:port until cancelled; reports the
    bound addresses."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(BrokerCollector(broker))
    await serve_registry(registry, host, port, task_status=task_status)
