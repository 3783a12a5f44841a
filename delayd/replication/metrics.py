"""Prometheus metrics of replication (docs/operations.md, "Replication"): read at each
scrape from the member's Leader or Follower, whichever it runs now.

Streams are summed by kind (``log``: ``message_log``, ``dispatch_log``, ``commitlog``,
``offsets``), never one series per dispatch_log bucket: that label stays bounded. The
``member`` label is bounded by the group's size. A new Leader or Follower starts its
counters at 0, as a restart does (``rate()`` takes it as a counter reset).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from delayd.replication.follower import FAILURE_REASONS, Follower
from delayd.replication.leader import Leader, LeaderFenced
from delayd.replication.streams import EMBEDDED_BROKER_PREFIX
from delayd.serving.metric_families import labelled

# delayd_replication_leader_state: what each value means.
SERVING, STOPPED, FENCED = 0, 1, 2


def stream_kind(stream: str) -> str:
    """``dispatch_log/202611221530`` -> ``dispatch_log``; ``message_log`` as it is; an
    embedded broker's ``broker/offsets/<generation>`` -> ``offsets``."""
    return stream.removeprefix(EMBEDDED_BROKER_PREFIX).split("/", 1)[0]


def by_kind(offsets: dict[str, int]) -> dict[str, int]:
    """Offsets summed by stream kind (sorted, so the page reads the same each time)."""
    summed: dict[str, int] = {}
    for stream, offset in offsets.items():
        kind = stream_kind(stream)
        summed[kind] = summed.get(kind, 0) + offset
    return dict(sorted(summed.items()))


def leader_state(leader: Leader) -> int:
    stopped = leader.stopped
    if stopped is None:
        return SERVING
    return FENCED if isinstance(stopped, LeaderFenced) else STOPPED


class ReplicationCollector(Collector):
    """``current()`` is the member's Leader or Follower now, or None (neither: the
    collector then exports nothing). A server registers it once, at start."""

    def __init__(self, current: Callable[[], Leader | Follower | None]) -> None:
        self.current = current

    def collect(self) -> Iterator[Metric]:
        role = self.current()
        if isinstance(role, Leader):
            yield from leader_metrics(role)
        elif isinstance(role, Follower):
            yield from follower_metrics(role)


def leader_metrics(leader: Leader) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "delayd_replication_leader_state",
        "This member's replication leader: 0 serving followers, 1 stopped, 2 fenced "
        "(a member has seen a newer term: it stops acknowledging).",
        value=leader_state(leader),
    )
    yield GaugeMetricFamily(
        "delayd_replication_term_revision",
        "The term (etcd revision of the leader key) this member replicates under: its "
        "own while it leads, the leader's it last followed while it follows.",
        value=leader.epoch,
    )
    yield GaugeMetricFamily(
        "delayd_replication_in_sync_members",
        "Followers in the set the ack rule counts (durable everything the leader had "
        "replica_lag_ms ago).",
        value=len(leader.in_sync),
    )
    yield GaugeMetricFamily(
        "delayd_replication_connected_members",
        "Followers connected to this leader now.",
        value=len(leader.connected),
    )
    yield labelled(
        GaugeMetricFamily,
        "delayd_replication_follower_lag_bytes",
        "Bytes of the leader's streams each follower lacks durable: what a failover to "
        "it could lose under ack = leader.",
        "member",
        sorted(leader.lag().items()),
    )
    yield labelled(
        GaugeMetricFamily,
        "delayd_replication_follower_lag_records",
        "Records of the leader's streams each follower lacks durable (no sample for a "
        "follower that lacks records retention deleted: it must resync).",
        "member",
        sorted((m, n) for m, n in leader.lag_records().items() if n is not None),
    )
    yield labelled(
        GaugeMetricFamily,
        "delayd_replication_follower_deleted_lag_bytes",
        "Bytes a follower lacks that retention deleted on the leader: it cannot catch up "
        "by copying and is sent a snapshot (docs/replication.md, Resync from a snapshot); "
        "no sample for the others.",
        "member",
        sorted(leader.deleted_lag().items()),
    )
    yield labelled(
        GaugeMetricFamily,
        "delayd_replication_follower_lag_seconds",
        "How long ago the leader had what each follower has durable: the age of the "
        "oldest record it lacks; 0 while it lacks none.",
        "member",
        ((member, ms / 1000) for member, ms in sorted(leader.lag_ms().items())),
    )
    yield labelled(
        GaugeMetricFamily,
        "delayd_replication_acknowledged_offset_bytes",
        "Offset up to which the group acknowledged each kind of stream (summed over its "
        "files: dispatch_log buckets, offsets generations).",
        "log",
        by_kind(leader.acknowledged_offsets()).items(),
    )
    yield CounterMetricFamily(
        "delayd_replication_sent_bytes_total",
        "Record bytes sent to followers.",
        value=leader.sent_bytes,
    )
    yield snapshots_metric("sent", leader.snapshots_sent)
    yield CounterMetricFamily(
        "delayd_replication_handshake_failures_total",
        "TLS handshakes on the replication listener that failed (no, or an unknown, "
        "client certificate under mutual TLS; no handshake in time).",
        value=leader.refused_handshakes,
    )


def follower_metrics(follower: Follower) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "delayd_replication_term_revision",
        "The term (etcd revision of the leader key) this member replicates under: its "
        "own while it leads, the leader's it last followed while it follows.",
        value=follower.leader_epoch or 0,
    )
    yield labelled(
        GaugeMetricFamily,
        "delayd_replication_durable_offset_bytes",
        "Where this follower's copy of each kind of stream ends durable (summed over its "
        "files), as it reports it to the leader.",
        "log",
        by_kind(follower.streams.durable_ends()).items(),
    )
    yield CounterMetricFamily(
        "delayd_replication_received_bytes_total",
        "Record bytes copied from the leader.",
        value=follower.received_bytes,
    )
    yield snapshots_metric("installed", follower.snapshots_installed)
    yield CounterMetricFamily(
        "delayd_replication_leader_connections_total",
        "Connections this follower opened to the leader (the first, then every reconnect).",
        value=follower.connections,
    )
    yield labelled(
        CounterMetricFamily,
        "delayd_replication_session_failures_total",
        "Sessions with the leader that ended in an error, by reason: tls (a certificate "
        "refused by either side), refused (a stale term, a frame out of place), network, "
        "protocol (a bad frame).",
        "reason",
        ((reason, follower.failures[reason]) for reason in FAILURE_REASONS),
    )


def snapshots_metric(outcome: str, count: int) -> Metric:
    return labelled(
        CounterMetricFamily,
        "delayd_replication_snapshots_total",
        "Snapshots of a delay member's derived state, for a follower that lacked records "
        "retention deleted: sent (leader) or installed at this server's start (follower).",
        "outcome",
        [(outcome, count)],
    )
