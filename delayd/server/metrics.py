"""Prometheus ``/metrics`` and ``/healthz`` for ``delayd serve``.

Values are read at scrape time by a custom collector from the plain counters of the
Receiver, the Replayer and the intake path (nothing is updated for metrics on the hot
path), together with the embedded broker's collector. A tiny trio HTTP/1.0 handler serves
them on the server's event loop, one request per connection.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from enum import Enum
from typing import TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from delayd.protocol import CancelOutcome, RescheduleOutcome, ResultCode
from delayd.replay import Replayer
from delayd.server.intake import IntakePath
from delayd.server.receiver import Receiver
from delayd.serving.metric_families import labelled

Member = TypeVar("Member", bound=Enum)

# Every refusal reason is exported from the start (at 0), so alerts see the series.
REFUSAL_CODES = [c for c in ResultCode if not c.is_success]


def _by_name(counts: Mapping[Member, int], members: Iterable[Member]) -> Iterator[tuple[str, int]]:
    """``(member name in lower case, its count)`` for every member of an enum, so a
    family lists every outcome from the start (at 0)."""
    return ((member.name.lower(), counts[member]) for member in members)


class IntakeCollector(Collector):
    """Intake and replay metrics of one delay server."""

    def __init__(self, receiver: Receiver, intake: IntakePath, replayer: Replayer) -> None:
        self.receiver = receiver
        self.intake = intake
        self.replayer = replayer

    def collect(self) -> Iterator[Metric]:
        receiver, replayer = self.receiver, self.replayer
        yield CounterMetricFamily(
            "delayd_intake_accepted_messages_total",
            "Messages accepted and acknowledged durable since the server started.",
            value=receiver.accepted_total,
        )
        yield labelled(
            CounterMetricFamily,
            "delayd_intake_refused_messages_total",
            "Messages refused since the server started, by reason (result code).",
            "reason",
            _by_name(receiver.refused_total, REFUSAL_CODES),
        )
        yield CounterMetricFamily(
            "delayd_intake_duplicate_messages_total",
            "Messages answered DUPLICATE: their id was already held (scheduled, delivered "
            "or cancelled), so they were not scheduled again.",
            value=receiver.duplicate_total,
        )
        known = receiver.known
        if known is not None:
            yield CounterMetricFamily(
                "delayd_intake_id_lookups_total",
                "Id index lookups intake made to tell a resend from a new id (the filter "
                "in front of the index could not rule the id out).",
                value=known.lookups,
            )
            yield GaugeMetricFamily(
                "delayd_intake_id_filter_warm",
                "1 once the id filter holds every indexed id (after start-up), 0 while "
                "every id sent is looked up in the index.",
                value=int(known.warm),
            )
        yield CounterMetricFamily(
            "delayd_intake_past_due_messages_total",
            "Accepted messages whose due time had passed on receipt (delivered at once).",
            value=receiver.past_due_total,
        )
        yield GaugeMetricFamily(
            "delayd_intake_pending_ack_messages",
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
        canceller = self.intake.canceller
        if canceller is not None:
            yield labelled(
                CounterMetricFamily,
                "delayd_cancel_requests_total",
                "CANCEL requests resolved since the server started, by outcome.",
                "outcome",
                _by_name(canceller.cancels, CancelOutcome),
            )
            yield labelled(
                CounterMetricFamily,
                "delayd_reschedule_requests_total",
                "RESCHEDULE requests answered since the server started, by outcome.",
                "outcome",
                _by_name(canceller.reschedules, RescheduleOutcome),
            )
        yield GaugeMetricFamily(
            "delayd_schedule_log_open_files",
            "schedule_log bucket files currently open (at most 2 x max_open_files).",
            value=replayer.buckets.open_count,
        )
