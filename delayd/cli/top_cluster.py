"""``delayd top --etcd``: the Screen of a whole cluster.

Each refresh reads the cluster from etcd again — the registry (which groups, their kind
and status) and every group's live members and leader — so groups and members that
appear or vanish while top runs are picked up, then scrapes every member's /metrics at
the address it published. When etcd cannot be read, the groups last read are scraped
and the frame says why.
"""

from __future__ import annotations

import ssl

from rich.console import RenderableType

from delayd.cli.top_watch import Watcher
from delayd.cluster import cluster_state
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.group_state import GroupState
from delayd.cluster.registry import Registration
from delayd.errors import EtcdError
from delayd.timestamps import wall_ms
from delayd.top.cluster import ClusterModel, GroupRow, GroupSeen, MemberSeen, cluster_rows
from delayd.top.cluster_render import render_cluster
from delayd.top.model import ServerView
from delayd.top.scrape import Target, parse_target


def group_seen(name: str, entry: Registration | None, state: GroupState | None) -> GroupSeen:
    """A group from its registry entry and/or its keys (either may be missing: a group
    whose members never registered it, a registered group with no key left)."""
    members = state.members if state is not None else ()
    if entry is not None:
        kind, status = entry.kind.value, entry.status.value
    else:
        kind = "delay" if state is not None and state.is_delay_group else "broker"
        status = None
    seen = tuple(
        MemberSeen(m.member_id, state.role_of(m.member_id) if state else "candidate", m.metrics)
        for m in members
    )
    return GroupSeen(name, kind, status, seen)


async def read_cluster(etcd: EtcdClient, prefix: str) -> list[GroupSeen]:
    """Every group of the cluster at ``prefix``: registered, or with keys. Raises
    EtcdError as EtcdClient does, ValueError for a damaged registry entry."""
    return [
        group_seen(group.name, group.registration, group.state)
        for group in await cluster_state.read_cluster(etcd, prefix)
    ]


class ClusterWatcher:
    """The cluster at ``prefix`` of ``etcd``, shown as ``cluster``."""

    prints_all_once = True  # a script reading --once wants every group
    choices = 1

    def __init__(
        self,
        etcd: EtcdClient,
        prefix: str,
        cluster: str,
        timeout_s: float,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``tls``: scrape the members over https, verified with this context."""
        self.etcd = etcd
        self.prefix = prefix
        self.cluster = cluster
        self.groups: list[GroupSeen] = []
        self.rows: list[GroupRow] = []
        self.etcd_error: str | None = None
        self._servers = Watcher([], timeout_s, tls)

    async def refresh(self) -> list[GroupRow]:
        try:
            self.groups = await read_cluster(self.etcd, self.prefix)
            self.etcd_error = None
        except (EtcdError, ValueError) as exc:
            self.etcd_error = str(exc) or type(exc).__name__
        views: dict[tuple[str, str], ServerView] = {}
        scraped: list[tuple[str, str]] = []
        targets: list[Target] = []
        for group in self.groups:
            for member in (m for m in group.members if m.metrics):
                key = (group.name, member.member_id)
                try:
                    https = self._servers.tls is not None
                    targets.append(parse_target(member.metrics, https=https))
                except ValueError as exc:
                    views[key] = ServerView(member.metrics, error=f"metrics address: {exc}")
                else:
                    scraped.append(key)
        self._servers.targets = targets
        views.update(zip(scraped, await self._servers.refresh(), strict=True))
        self.rows = cluster_rows(self.groups, views)
        return self.rows

    def frame(
        self, selected: int, interval_s: float, width: int, height: int | None
    ) -> RenderableType:
        model = ClusterModel(self.cluster, self.rows, wall_ms(), interval_s, self.etcd_error)
        return render_cluster(model, width, height)
