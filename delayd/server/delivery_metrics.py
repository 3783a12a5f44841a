"""Prometheus metrics of the delivery path: the wheel, its cursors, and the sender.

Read at scrape time from the plain counters of the ticker, the wheel manager and the
sender (nothing on the hot path is done for metrics). Names and meanings are listed in
docs/operations.md.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from delayd.sender.histogram import Histogram
from delayd.server.delivery import Delivery
from delayd.serving.metric_families import labelled


def _histogram(name: str, documentation: str, histogram: Histogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(
        name, documentation, buckets=histogram.cumulative(), sum_value=histogram.sum
    )


class DeliveryCollector(Collector):
    """Wheel and delivery metrics of one delay server."""

    def __init__(self, delivery: Delivery) -> None:
        self.delivery = delivery

    def collect(self) -> Iterator[Metric]:
        delivery = self.delivery
        manager, sender, ticker = delivery.manager, delivery.sender, delivery.ticker
        stats = manager.statistics()
        yield GaugeMetricFamily(
            "delayd_wheel_entries",
            "Entries in the timing wheel (loaded, not yet due).",
            value=len(ticker.wheel),
        )
        yield GaugeMetricFamily(
            "delayd_wheel_loading_bucket_start_timestamp_seconds",
            "Start (Unix time, seconds) of the schedule_log bucket being loaded or last loaded.",
            value=max(stats.loading_bucket_ms, 0) / 1000,
        )
        yield GaugeMetricFamily(
            "delayd_wheel_loading_offset_bytes",
            "Offset the loading bucket is being loaded up to (its length when loading began).",
            value=stats.loading_offset,
        )
        yield GaugeMetricFamily(
            "delayd_wheel_loaded_offset_bytes",
            "Offset below which the loading bucket's records are in the wheel.",
            value=stats.loaded_offset,
        )
        yield GaugeMetricFamily(
            "delayd_wheel_loaded_ahead_seconds",
            "How far past now schedule_log is loaded into the wheel.",
            value=(stats.loaded_until_ms - ticker.now_ms()) / 1000 if delivery.running else 0,
        )
        yield GaugeMetricFamily(
            "delayd_wheel_outstanding_messages",
            "Messages loaded into the wheel and not yet recorded in dispatch_log.",
            value=stats.outstanding,
        )
        yield CounterMetricFamily(
            "delayd_wheel_completed_buckets_total",
            "schedule_log buckets marked COMPLETE in dispatch_log by this process.",
            value=stats.buckets_completed,
        )
        yield GaugeMetricFamily(
            "delayd_delivery_in_flight_messages",
            "Messages read back from schedule_log and not yet acknowledged by a broker.",
            value=sender.in_flight,
        )
        yield GaugeMetricFamily(
            "delayd_delivery_parked_messages",
            "Messages waiting because no broker group is usable.",
            value=sender.parked,
        )
        yield _histogram(
            "delayd_delivery_lateness_seconds",
            "dispatched_ms - due_ms of every delivered message.",
            sender.lateness_s,
        )
        yield _histogram(
            "delayd_delivery_batch_size_messages",
            "Messages per SEND_BATCH acknowledged by a broker group.",
            sender.batch_sizes,
        )
        groups = sender.group_statistics()
        families = {
            "sent": "Messages a broker group acknowledged (OK or DUPLICATE).",
            "failed": "Messages whose send to a broker group failed or was refused.",
            "retried": "Messages put back for another attempt after a failure.",
            "dead_lettered": "Messages sent to their dead-letter subject after max_attempts.",
        }
        for field, documentation in families.items():
            yield labelled(
                CounterMetricFamily,
                f"delayd_delivery_{field}_messages_total",
                documentation,
                "group",
                ((group.name, getattr(group, field)) for group in groups),
            )
        yield labelled(
            GaugeMetricFamily,
            "delayd_delivery_circuit_state",
            "Circuit breaker of each broker group: 0 closed, 1 half-open, 2 open.",
            "group",
            ((group.name, int(group.circuit)) for group in groups),
        )
        yield labelled(
            GaugeMetricFamily,
            "delayd_delivery_queued_messages",
            "Messages routed to a broker group and waiting to be sent.",
            "group",
            ((group.name, group.queued) for group in groups),
        )
