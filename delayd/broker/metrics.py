"""Prometheus metrics of the broker: the collectors ``delayd broker`` adds to the registry
it serves (delayd.serving.metrics_http, from before recovery: delayd.cli.broker) on the
broker's event loop.

Values are read from the Broker at scrape time by a custom collector (prometheus-client's
exposition format and escaping), so nothing is updated on the hot path and nothing is
shared with another thread.
"""

from __future__ import annotations

import logging

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from delayd.broker.broker import Broker
from delayd.broker.config import StartFrom
from delayd.serving.connection_gate import ConnectionGate
from delayd.serving.connection_metrics import register_connection_metrics
from delayd.serving.metrics_http import Readiness
from delayd.serving.store_metrics import StoreMetrics, broker_directories

log = logging.getLogger(__name__)


def subject_lags(broker: Broker) -> dict[tuple[str, str], int]:
    """Per (group, subject) — every group with a committed offset or a live member —
    the messages of all the subject's queues it has not committed. A queue without a
    committed offset counts from where the group would start reading it, as the
    broker's start_from says (earliest: the queue's oldest entry; latest: its end)."""
    store = broker.store
    committed: dict[tuple[str, str, int], int] = {
        key: offset for key, offset in broker.offsets.items()
    }
    keys = {(group, subject) for group, subject, _ in committed} | set(broker.groups.keys())
    queues_of: dict[str, list[int]] = {}
    for subject, queue in store.queues:
        queues_of.setdefault(subject, []).append(queue)
    latest = broker.config.start_from is StartFrom.LATEST
    out = {}
    for group, subject in keys:
        behind = 0
        for queue in queues_of.get(subject, ()):
            end = store.queue_end(subject, queue)
            start = committed.get((group, subject, queue))
            if start is None:
                start = end if latest else store.queue_min(subject, queue)
            behind += max(0, end - start)
        out[group, subject] = behind
    return out


class BrokerCollector(Collector):
    """The broker's metrics, computed from its state on each scrape."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker

    def collect(self):  # an iterator of metric families
        broker = self.broker
        store = broker.store
        yield CounterMetricFamily(
            "delayd_broker_stored_messages",
            "Messages stored (OK results) since the broker started.",
            value=store.messages_stored,
        )
        yield CounterMetricFamily(
            "delayd_broker_duplicate_messages",
            "Messages acknowledged DUPLICATE (id already stored) since the broker started.",
            value=broker.duplicates,
        )
        yield CounterMetricFamily(
            "delayd_broker_refused_messages",
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
            "delayd_broker_queue_end_offset_messages",
            "One past the newest offset of each queue.",
            labels=["subject", "queue"],
        )
        for subject, queue in sorted(store.queues):
            ends.add_metric([subject, str(queue)], store.queue_end(subject, queue))
        yield ends
        lag = GaugeMetricFamily(
            "delayd_broker_consumer_lag_messages",
            "Messages of a queue not yet committed by a consumer group.",
            labels=["group", "subject", "queue"],
        )
        for group, subject, queue, behind in broker.lags():
            lag.add_metric([group, subject, str(queue)], behind)
        yield lag
        by_subject = GaugeMetricFamily(
            "delayd_broker_subject_consumer_lag_messages",
            "Messages of a subject a consumer group has not committed, over all its queues "
            "(a queue the group never committed counts from where it would start).",
            labels=["group", "subject"],
        )
        for (group, subject), behind in sorted(subject_lags(broker).items()):
            by_subject.add_metric([group, subject], behind)
        yield by_subject
        groups = broker.groups
        yield SummaryMetricFamily(
            "delayd_broker_rebalance_handover_seconds",
            "How long queues that moved between consumers waited for their old owner to "
            "let go (confirm, leave, crash or time out).",
            count_value=groups.handovers,
            sum_value=groups.handover_wait_ms_total / 1000,
        )
        yield SummaryMetricFamily(
            "delayd_broker_promotion_hold_seconds",
            "How long the queues of consumer groups were held after this broker began to "
            "lead its group, until their holder claimed them or nobody did in time.",
            count_value=groups.claim_holds,
            sum_value=groups.claim_hold_ms_total / 1000,
        )


async def collect_broker_metrics(
    broker: Broker,
    registry: CollectorRegistry,
    *,
    gate: ConnectionGate | None = None,
    readiness: Readiness | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Add the broker's collectors to ``registry`` (one already served, as from before
    recovery), then walk the sizes of its files and ask the free space of their file
    system until cancelled. ``gate``: the broker listener's, for the connection metrics
    (process_* always). ``readiness``: made not ready while the commitlog refuses
    writes (a full disk)."""
    directory = broker.store.directory
    store = StoreMetrics(broker_directories(directory), directory, broker.refusals)
    registry.register(BrokerCollector(broker))
    store.register(registry)
    register_connection_metrics(registry, {"broker": gate} if gate is not None else {})
    if readiness is not None:
        readiness.watch(broker.refusals.reason)
    await store.run(task_status=task_status)
