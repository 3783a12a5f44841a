"""Prometheus metrics of retention (delayd.server.retention), read at scrape time from
its counters. Names and meanings are listed in docs/operations.md."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from delayd.server.retention import LOGS, Retention
from delayd.serving.metric_families import labelled


class RetentionCollector(Collector):
    """Files and bytes retention deleted, by log, and when it last made a pass."""

    def __init__(self, retention: Retention) -> None:
        self.retention = retention

    def collect(self) -> Iterator[Metric]:
        retention = self.retention
        deleted = {
            "files": "Files retention deleted, by log (message_log segments, schedule_log "
            "and dispatch_log bucket files, id_index files).",
            "bytes": "Bytes of the files retention deleted, by log.",
        }
        for unit, documentation in deleted.items():
            counts = getattr(retention, f"deleted_{unit}")
            yield labelled(
                CounterMetricFamily,
                f"delayd_retention_deleted_{unit}",
                documentation,
                "log",
                ((name, counts[name]) for name in LOGS),
            )
        yield CounterMetricFamily(
            "delayd_retention_passes",
            "Retention passes made.",
            value=retention.passes,
        )
        yield CounterMetricFamily(
            "delayd_retention_skipped_passes",
            "Retention passes skipped because the replayer was behind.",
            value=retention.skipped_passes,
        )
        last = GaugeMetricFamily(
            "delayd_retention_last_pass_timestamp_seconds",
            "When (Unix time, seconds) retention last finished a pass; no sample before the first.",
        )
        if retention.last_pass_ms is not None:
            last.add_metric([], retention.last_pass_ms / 1000)
        yield last
