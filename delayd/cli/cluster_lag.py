"""Each follower's lag as its group's leader measures it, for ``delayd cluster status``.

etcd says who leads; only the leader knows how far each follower is behind (its durable
end of every stream, reported after each group commit). The leader exports that on its
/metrics (``delayd_replication_follower_lag_records``, ``…_lag_seconds``,
``…_lag_bytes``, ``…_deleted_lag_bytes``, by member: docs/operations.md), so this
reads the page at the leader's advertised metrics address.
"""

from __future__ import annotations

from dataclasses import dataclass

from delayd.top.scrape import Snapshot, fetch

LAG_TIMEOUT_S = 3.0


@dataclass(frozen=True, slots=True)
class FollowerLag:
    records: int | None  # None: it lacks records the leader no longer holds
    ms: int | None
    bytes: int | None
    lacks_deleted: bool = False  # it cannot catch up by copying


@dataclass(frozen=True, slots=True)
class GroupLag:
    """The lag of each follower the leader knows (``by_member``), or why there is none
    (``error``)."""

    by_member: dict[str, FollowerLag]
    error: str | None = None


def leader_lag(metrics_address: str, timeout_s: float = LAG_TIMEOUT_S) -> GroupLag:
    """The followers' lag, read from the leader's metrics at ``metrics_address``
    (``host:port``, "" when it serves none)."""
    if not metrics_address:
        return GroupLag({}, "the leader serves no /metrics (metrics_listen = off)")
    url = f"http://{metrics_address}/metrics"
    try:
        snapshot = Snapshot.parse(fetch(url, timeout_s))
    except (OSError, ValueError) as exc:
        return GroupLag({}, f"{url}: {exc}")
    return GroupLag(lags_in(snapshot))


def lags_in(snapshot: Snapshot) -> dict[str, FollowerLag]:
    """Each follower's lag in a scrape of the leader's metrics."""
    lag_bytes = snapshot.by_label("delayd_replication_follower_lag_bytes", "member")
    seconds = snapshot.by_label("delayd_replication_follower_lag_seconds", "member")
    records = snapshot.by_label("delayd_replication_follower_lag_records", "member")
    lacking = snapshot.by_label("delayd_replication_follower_deleted_lag_bytes", "member")
    return {
        member: FollowerLag(
            None if member not in records else int(records[member]),
            None if member not in seconds else round(seconds[member] * 1000),
            None if member not in lag_bytes else int(lag_bytes[member]),
            bool(lacking.get(member)),
        )
        for member in lag_bytes.keys() | lacking.keys()
    }
