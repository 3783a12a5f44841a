"""Prometheus metrics of a server's group membership (docs/operations.md, "Groups")."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from delayd.serving.membership import LISTENERS, Membership
from delayd.serving.metric_families import labelled


class MembershipCollector:
    """Reads the Membership at each scrape."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership

    def collect(self) -> Iterator[Metric]:
        membership = self.membership
        view = membership.view
        yield GaugeMetricFamily(
            "delayd_cluster_role_state",
            "This member's role in its group: 0 candidate (no leader known), 1 follower, 2 leader.",
            value=int(view.role),
        )
        yield GaugeMetricFamily(
            "delayd_cluster_epoch_revision",
            "The leader's term as the etcd revision that created the leader key (this "
            "member's own while it leads); 0 while no leader is known.",
            value=view.epoch or 0,
        )
        yield CounterMetricFamily(
            "delayd_cluster_elections_total",
            "Elections this member won since it started.",
            value=membership.elections_total,
        )
        in_sync = membership.in_sync
        members = in_sync.members if in_sync is not None else None
        yield GaugeMetricFamily(
            "delayd_cluster_in_sync_members",
            "Members in the group's in-sync set, the ones that may lead (0 while it is "
            "not written yet).",
            value=len(members or ()),
        )
        yield labelled(
            CounterMetricFamily,
            "delayd_cluster_not_leader_requests_total",
            "Requests answered NOT_LEADER because this member does not lead, by listener.",
            "listener",
            ((listener, membership.not_leader_total[listener]) for listener in LISTENERS),
        )
