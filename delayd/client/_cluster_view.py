"""The registry of a cluster as a producer last read it (``etcd://H:P/[CLUSTER/]*``),
shared by the async and the blocking cluster producer; the clock is the caller's.

Read again when older than REFRESH_S, and at once after a group failed a call (a group
added or drained is then picked up). When etcd cannot be read the last registry read
stays in use: the registry changes only by an operator's hand, and a producer must not
stop sending because etcd is briefly away.

``resend_check`` is where a send's window of possible previous owners starts: the
producer's ``resend_window_s`` (plus CHANGE_MARGIN_MS) before now, on this host's clock.
"""

from __future__ import annotations

import math
from dataclasses import replace

from delayd.client._routing import (
    CHANGE_MARGIN_MS,
    REFRESH_S,
    RESEND_WINDOW_S,
    DelayGroups,
    ResendCheck,
)
from delayd.errors import UnreachableError
from delayd.group_address import GroupAddress
from delayd.timestamps import wall_ms


class ClusterView:
    """See the module docstring. ``target`` is a whole-cluster address; ValueError for a
    negative ``resend_window_s``."""

    def __init__(self, target: GroupAddress, resend_window_s: float = RESEND_WINDOW_S) -> None:
        assert target.whole_cluster
        if not resend_window_s >= 0:
            raise ValueError(
                f"resend_window_s must be 0 or more seconds, got {resend_window_s!r} "
                "(0: ask no group before a send)"
            )
        self.target = target
        self.resend_window_ms = round(resend_window_s * 1000)
        self.groups: DelayGroups | None = None
        self.reads = 0  # registry reads so far (statistics, tests)
        self._read_s = -math.inf

    def due(self, now_s: float) -> bool:
        """Whether the registry is to be read (again) now."""
        return self.groups is None or now_s - self._read_s >= REFRESH_S

    def read(self, groups: DelayGroups, now_s: float) -> DelayGroups:
        self.groups, self._read_s = groups, now_s
        self.reads += 1
        return groups

    def read_failed(self, exc: BaseException) -> DelayGroups:
        """The registry read before, when etcd could not be read now; raises
        UnreachableError (naming the cluster and why) when there is none."""
        if self.groups is None:
            raise UnreachableError(
                f"cannot read the groups of {self.target} from etcd: {exc}. Is etcd running "
                "there, and has a delay group joined the cluster?"
            ) from None
        return self.groups

    def stale(self) -> None:
        """A group failed a call: read the registry again before the next one."""
        self._read_s = -math.inf

    def resend_check(self, message_ids: list[str], groups: DelayGroups) -> ResendCheck:
        """The groups to ask about ``message_ids`` before they are sent (none when
        ``resend_window_s`` is 0)."""
        if not self.resend_window_ms:
            return ResendCheck(message_ids, groups, since_ms=None)
        since_ms = wall_ms() - self.resend_window_ms - CHANGE_MARGIN_MS
        return ResendCheck(message_ids, groups, since_ms)

    def group_address(self, group: str) -> str:
        """The ``etcd://`` address of one group of the cluster."""
        return str(replace(self.target, group=group))


async def read_delay_groups(target: GroupAddress) -> DelayGroups:
    """The delay groups of the cluster ``target`` names, read over an etcd client of its
    own (under trio or asyncio). Raises EtcdError as EtcdClient does, ValueError for a
    damaged registry entry."""
    from delayd.cluster.etcd import EtcdClient
    from delayd.cluster.members import cluster_prefix
    from delayd.cluster.registry import read_registry

    async with EtcdClient(target.etcd) as etcd:
        return DelayGroups.from_registry(await read_registry(etcd, cluster_prefix(target.cluster)))
