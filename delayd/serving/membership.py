"""A server's part in its group (docs/replication.md): the GroupMember that holds its
role, the in-sync set that decides whether it may campaign, and what the request path
asks of them.

``Membership`` is built with the server (``None`` without ``[cluster] etcd``: the server
runs alone and nothing here is asked). ``run`` joins the group once the listeners are
bound, since the addresses published in etcd carry the bound ports. The request path
asks ``may_lead()`` before it takes or acknowledges anything only a leader may, and
answers ERROR NOT_LEADER with ``refusal(listener)`` otherwise.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from collections import Counter
from collections.abc import Callable

import trio

from delayd.cluster.config import ClusterConfig
from delayd.cluster.election import GroupMember
from delayd.cluster.etcd import EtcdClient, Put
from delayd.cluster.in_sync import InSyncSet
from delayd.cluster.members import GroupKeys, MemberInfo, Role, View
from delayd.cluster.registry import GroupKind, register
from delayd.errors import EtcdError
from delayd.protocol.redirect import not_leader_reason
from delayd.timestamps import wall_ms

log = logging.getLogger(__name__)

LISTENERS = ("intake", "broker", "http")  # what a NOT_LEADER answer is counted by
REGISTER_RETRY_S = 1.0


def member_id_for(address: str) -> str:
    """A member id from the address clients reach the member at (``10.0.0.1:20801`` ->
    ``10.0.0.1-20801``): the same on every restart, which the in-sync set relies on."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", address).strip("-._")[:128]


def data_location(data_dir: str) -> dict[str, str]:
    """MemberInfo's ``data_dir`` and ``hostname`` for a member whose data directory is
    ``data_dir``: the absolute path and this host's name, for ``delayd audit --etcd``."""
    return {"data_dir": os.path.abspath(data_dir), "hostname": socket.gethostname()}


class Membership:
    """See the module docstring. ``listener`` names: ``intake`` (the delay server's
    producers), ``broker`` (the broker's clients), ``http`` (the HTTP API, whose
    redirect names the intake address's host and the HTTP port it learns elsewhere)."""

    def __init__(
        self,
        config: ClusterConfig,
        *,
        holds_group_data: Callable[[], bool] = lambda: True,
        before_founding: Callable[[], None] = lambda: None,
    ) -> None:
        """``holds_group_data``: whether this member has ever led or followed an epoch
        of the group, or claimed to found it (``EpochHistory.knows_group``); see
        ``_eligible``. ``before_founding``: called, and durable when it returns, before a
        campaign that would make this member a new group's first leader
        (``EpochHistory.claim_founding``)."""
        self.config = config
        self.holds_group_data = holds_group_data
        self.before_founding = before_founding
        self.keys = GroupKeys(config.prefix, config.group)
        self.member: GroupMember | None = None
        self.in_sync: InSyncSet | None = None
        self.not_leader_total: Counter[str] = Counter()
        self.changed = trio.Event()  # set at every change of view, then replaced
        self._scope = trio.CancelScope()
        self._started = False

    def __repr__(self) -> str:
        return f"<Membership {self.keys.group} {self.member}>"

    @property
    def view(self) -> View:
        return self.member.view if self.member is not None else View(Role.CANDIDATE)

    @property
    def elections_total(self) -> int:
        return self.member.elections_won if self.member is not None else 0

    def may_lead(self) -> bool:
        """Whether this member may act as leader now (GroupMember.may_lead)."""
        if self._scope.cancel_called:  # resigned: before the member's task has run again
            return False
        return self.member is not None and self.member.may_lead()

    def leader_address(self, listener: str) -> str | None:
        """The leader's address for ``listener`` (``intake`` or ``broker``), or None when
        no leader is known or it does not serve that."""
        leader = self.view.leader
        if leader is None:
            return None
        if self.member is not None and leader.member_id == self.member.info.member_id:
            # This member, refusing: it stepped down (its lease is no longer trusted)
            # before its view caught up. Naming itself would send the client back here.
            return None
        return getattr(leader, listener if listener in ("broker", "http") else "intake") or None

    def refusal(self, listener: str) -> str:
        """The reason of a NOT_LEADER answer on ``listener`` (counted for /metrics)."""
        self.not_leader_total[listener] += 1
        view = self.view
        role = view.role.name.lower()
        return not_leader_reason(self.keys.group, role, view.epoch, self.leader_address(listener))

    async def wait_change(self) -> None:
        """Wait for the next change of role, epoch or leader."""
        await self.changed.wait()

    def _on_change(self, previous: View, current: View, reason: str) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def resign(self) -> None:
        """Leave the group now (``run`` returns): the leader key goes at once, so a
        follower takes over without waiting for the lease; from here on this member
        answers NOT_LEADER."""
        self._scope.cancel()

    async def run(
        self, info: MemberInfo, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Take part in the group as ``info`` until cancelled or ``resign()``, then
        resign."""
        with self._scope:
            await self._run(info, task_status)
        if not self._started:  # resigned before it joined: nothing to wait for
            task_status.started()

    def _eligible(self) -> bool:
        """In the in-sync set (or the group is new), and, once the group has a set,
        holding the group's data at all: a member whose disk was replaced keeps its id,
        so the set still names it, yet it holds nothing the group acknowledged. Leading,
        it would cut every other member back to its empty logs."""
        in_sync = self.in_sync
        if in_sync is None or not in_sync.eligible():
            return False
        return in_sync.members is None or self.holds_group_data()

    def _campaign_puts(self) -> list[Put]:
        """The in-sync set's writes of a campaign; a new group's first leader claims it
        on its disk first (``before_founding``)."""
        assert self.in_sync is not None
        puts = self.in_sync.campaign_puts()
        if puts:
            self.before_founding()
        return puts

    async def _run(self, info: MemberInfo, task_status: trio.TaskStatus[None]) -> None:
        config = self.config
        async with EtcdClient(config.etcd) as etcd:
            in_sync = InSyncSet(etcd, self.keys, info.member_id)
            self.in_sync = in_sync
            self.member = GroupMember(
                etcd,
                config.group,
                info,
                prefix=config.prefix,
                lease_ttl_ms=config.lease_ttl_ms,
                eligible=self._eligible,
                campaign_compares=in_sync.campaign_compares,
                campaign_puts=self._campaign_puts,
                on_change=self._on_change,
            )
            log.info(
                "joining group %s as member %s (intake %s, broker %s, replication %s) at %s",
                config.group,
                info.member_id,
                info.intake or "-",
                info.broker or "-",
                info.replication or "-",
                ",".join(config.etcd),
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(in_sync.run)
                await nursery.start(self.member.run)
                nursery.start_soon(self._register, etcd, info)
                task_status.started()
                self._started = True

    async def _register(self, etcd: EtcdClient, info: MemberInfo) -> None:
        """Put the group in its cluster's registry (delayd.cluster.registry), trying
        again while etcd cannot be reached: the group serves meanwhile, but clients that
        address the whole cluster do not route to it until it is registered."""
        config = self.config
        kind = GroupKind.DELAY if info.intake else GroupKind.BROKER
        while True:
            try:
                entry = await register(etcd, config.prefix, config.group, kind, wall_ms())
            except EtcdError as exc:
                log.warning("group %s: not registered in the cluster yet: %s", config.group, exc)
                await trio.sleep(REGISTER_RETRY_S)
                continue
            if entry.kind is not kind:
                log.error(
                    "group %s is registered as a %s group; this member is a %s server: "
                    "give it another group name",
                    config.group,
                    entry.kind,
                    kind,
                )
            log.info("group %s is %s in its cluster", config.group, entry.status)
            return
