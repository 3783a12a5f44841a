"""What ``delayd top --etcd`` shows: every group of a cluster, from what etcd says of it
and the latest scrapes of its members.

Pure: the groups as etcd lists them (GroupSeen) and a ServerView per member scraped come
in, a row per group comes out. A group's figures are its leader's (the member that takes
messages, delivers them and sends its followers their copies): pending, intake,
delivery, lateness, and each follower's replication lag as the leader measures it. A
group without a known leader, or whose leader cannot be scraped, shows them as unknown.

**Uneven load.** Among the groups of one kind that take new work (status ``active``, or
not in the registry), each group's share of the cluster's pending messages and of its
intake rate is set against an even share (1/n of n such groups with a known figure). A
share above UNEVEN_FACTOR times the even share is flagged — more than 75 % of two
groups, 50 % of three — once the cluster total is large enough to mean something
(UNEVEN_MIN_PENDING messages, UNEVEN_MIN_PER_S messages/s): a few messages here or there
is not a hot group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from delayd.top.model import ServerView

UNEVEN_FACTOR = 1.5
UNEVEN_MIN_PENDING = 100.0
UNEVEN_MIN_PER_S = 10.0
TAKES_WORK = frozenset({"active", None})  # registry statuses in the even share


@dataclass(frozen=True, slots=True)
class MemberSeen:
    """A member as etcd lists it: its role, where its /metrics is ("" when it serves
    none)."""

    member_id: str
    role: str  # leader, follower, candidate
    metrics: str


@dataclass(frozen=True, slots=True)
class GroupSeen:
    """A group as etcd holds it: in the registry (kind, status) and/or with live
    members. ``status`` None: not in the registry."""

    name: str
    kind: str  # delay, broker
    status: str | None
    members: tuple[MemberSeen, ...] = ()


@dataclass(frozen=True, slots=True)
class MemberRow:
    """One member: its role, whether it is watched (it published a metrics address),
    why it could not be scraped, and for a follower how far behind its leader it is.
    None: unknown."""

    member_id: str
    role: str
    watched: bool = True
    error: str | None = None
    lag_bytes: float | None = None
    lag_s: float | None = None


@dataclass(frozen=True, slots=True)
class Share:
    """A group's part of a cluster total, against the even part (both 0..1)."""

    of_total: float
    even: float
    uneven: bool


@dataclass(frozen=True, slots=True)
class GroupRow:
    """Everything top shows about one group; None means unknown."""

    name: str
    kind: str
    status: str | None
    leader: str | None
    members: list[MemberRow] = field(default_factory=list)
    pending: float | None = None
    in_per_s: float | None = None  # delay group: messages accepted; broker group: stored
    out_per_s: float | None = None  # messages delivered to brokers
    lateness_p50_s: float | None = None
    lateness_p99_s: float | None = None
    pending_share: Share | None = None
    in_share: Share | None = None

    @property
    def uneven(self) -> bool:
        return any(s is not None and s.uneven for s in (self.pending_share, self.in_share))


@dataclass(frozen=True, slots=True)
class ClusterModel:
    """A frame of the cluster view: which cluster, when (epoch ms, UTC), its groups;
    ``etcd_error`` when etcd could not be read (the groups are then the last read)."""

    cluster: str
    groups: list[GroupRow]
    now_ms: int = 0
    interval_s: float = 1.0
    etcd_error: str | None = None


def _member_row(
    member: MemberSeen, view: ServerView | None, leader: ServerView | None
) -> MemberRow:
    error = None
    if member.metrics:
        error = view.error if view is not None else "not scraped yet"
    lag_bytes = lag_s = None
    if member.role == "follower" and leader is not None:
        lag_bytes = leader.follower_lag_bytes.get(member.member_id)
        lag_s = leader.follower_lag_s.get(member.member_id)
    return MemberRow(member.member_id, member.role, bool(member.metrics), error, lag_bytes, lag_s)


def group_row(group: GroupSeen, views: Mapping[str, ServerView]) -> GroupRow:
    """The row of ``group`` from the views of its members scraped, by member id."""
    leader = next((m for m in group.members if m.role == "leader"), None)
    lead_view = views.get(leader.member_id) if leader is not None else None
    if lead_view is not None and lead_view.error is not None:
        lead_view = None
    members = [
        _member_row(m, views.get(m.member_id), lead_view)
        for m in sorted(group.members, key=lambda m: (m.role != "leader", m.member_id))
    ]
    row = GroupRow(
        group.name,
        group.kind,
        group.status,
        leader.member_id if leader is not None else None,
        members,
    )
    if lead_view is None:
        return row
    return replace(
        row,
        pending=lead_view.pending_total,
        in_per_s=lead_view.stored_per_s if group.kind == "broker" else lead_view.in_per_s,
        out_per_s=lead_view.out_per_s,
        lateness_p50_s=lead_view.lateness_p50_s,
        lateness_p99_s=lead_view.lateness_p99_s,
    )


def _shares(
    rows: list[GroupRow], figure: Callable[[GroupRow], float | None], minimum: float
) -> dict[str, Share]:
    """Each group's share of ``figure`` among ``rows`` (one kind, taking work)."""
    known = {row.name: value for row in rows if (value := figure(row)) is not None}
    total = sum(known.values())
    if len(known) < 2 or total <= 0:
        return {}
    even = 1 / len(known)
    return {
        name: Share(value / total, even, total >= minimum and value / total > UNEVEN_FACTOR * even)
        for name, value in known.items()
    }


def cluster_rows(
    groups: list[GroupSeen], views: Mapping[tuple[str, str], ServerView]
) -> list[GroupRow]:
    """A row per group, by name, with its shares of the load; ``views`` by (group,
    member id)."""
    rows = [
        group_row(g, {member: v for (name, member), v in views.items() if name == g.name})
        for g in sorted(groups, key=lambda g: g.name)
    ]
    pending: dict[str, Share] = {}
    intake: dict[str, Share] = {}
    for kind in {row.kind for row in rows}:
        working = [r for r in rows if r.kind == kind and r.status in TAKES_WORK]
        pending.update(_shares(working, lambda r: r.pending, UNEVEN_MIN_PENDING))
        intake.update(_shares(working, lambda r: r.in_per_s, UNEVEN_MIN_PER_S))
    return [
        replace(r, pending_share=pending.get(r.name), in_share=intake.get(r.name)) for r in rows
    ]
