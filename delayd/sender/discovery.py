"""The broker groups a delay server delivers to, found in etcd rather than listed
(``[delivery] broker_groups_from = "etcd"``; docs/cluster.md, "Broker groups").

Every ``refresh_s`` the cluster's registry and its groups' members are read
(delayd.cluster.broker_groups) and the sender is brought in step:

- an active broker group not yet a target becomes one (a RemoteTarget over its
  members' broker addresses, the leader's first; it follows NOT_LEADER answers between
  two reads), weight 1, and takes its share of the keys from then on;
- a known group's member list is updated, so a new leader or a replaced member is
  reached without waiting for a NOT_LEADER answer;
- a group that is draining, retired or no longer registered gets no new batch (what it
  was sent finishes; a draining group, still running, also takes the resends of what it
  may already hold); one that comes back to active takes deliveries again;
- a group whose members are all down stays a target: its circuit opens, as for a
  listed group, and its keys go to their second choice meanwhile.

Only standalone broker groups take deliveries, not the embedded brokers of delay
groups (this server's own included): an embedded broker is replicated with its delay
group, sized and placed for it, and goes away with it when that group is drained;
broker groups are added and drained for the consumers' sake, on their own.

A read that fails (etcd away) changes nothing: the groups known go on being used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import trio

from delayd.cluster.broker_groups import BrokerGroup, read_broker_groups
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.registry import GroupKind, GroupStatus
from delayd.errors import EtcdError
from delayd.logs.dispatch_log import check_group_name
from delayd.sender.sender import Sender
from delayd.sender.targets import RemoteTarget

log = logging.getLogger(__name__)

DEFAULT_REFRESH_S = 1.0

TargetFactory = Callable[[str, Sequence[str]], RemoteTarget]


class BrokerDiscovery:
    """Keeps ``sender``'s broker groups those of the cluster at ``prefix`` in the etcd at
    the ``etcd`` URLs; ``make_target(name, addresses)`` builds the target of a group
    found (the token and TLS settings are the caller's)."""

    def __init__(
        self,
        sender: Sender,
        etcd: Sequence[str],
        prefix: str,
        make_target: TargetFactory,
        *,
        refresh_s: float = DEFAULT_REFRESH_S,
    ) -> None:
        self.sender = sender
        self.endpoints = tuple(etcd)
        self.prefix = prefix
        self.make_target = make_target
        self.refresh_s = refresh_s
        self.targets: dict[str, RemoteTarget] = {}
        self.refused: set[str] = set()  # groups whose name dispatch_log cannot record
        self.refreshes = 0  # registry reads that succeeded (statistics, tests)
        self.failing = False  # the last read failed

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Refresh until cancelled; started once the first read was tried, so that a
        sender starting after it routes over every group the registry has (a message
        resent after a restart then goes where it went before, to be dropped as a
        duplicate there)."""
        async with EtcdClient(self.endpoints) as etcd:
            try:
                await self.refresh(etcd)
                task_status.started()
                while True:
                    await trio.sleep(self.refresh_s)
                    await self.refresh(etcd)
            finally:
                with trio.CancelScope(shield=True):
                    await self.aclose()

    async def refresh(self, etcd: EtcdClient) -> None:
        """Read the cluster once and apply it (see the module docstring)."""
        try:
            groups = await read_broker_groups(etcd, self.prefix)
        except (EtcdError, ValueError) as exc:  # etcd away, or an entry malformed
            if not self.failing:  # once per outage, not every refresh_s
                log.warning("broker groups: cannot read the cluster at %s: %s", self.prefix, exc)
            self.failing = True
            return
        if self.failing:
            log.info("broker groups: the cluster at %s is read again", self.prefix)
        self.failing = False
        self.refreshes += 1
        self.apply(groups)

    def apply(self, groups: list[BrokerGroup]) -> None:
        """Bring the sender in step with ``groups`` (read_broker_groups's answer)."""
        seen = set()
        for group in groups:
            if group.kind is not GroupKind.BROKER:
                continue
            seen.add(group.name)
            target = self.targets.get(group.name)
            if target is None:
                if not (group.takes_deliveries and group.addresses):
                    continue  # nothing to connect to yet, or no new work for it
                try:
                    check_group_name(group.name)  # dispatch_log records it
                    target = self.make_target(group.name, group.addresses)
                except ValueError as exc:
                    if group.name not in self.refused:
                        self.refused.add(group.name)
                        log.error("broker group %s cannot take deliveries: %s", group.name, exc)
                    continue
                self.targets[group.name] = target
                self.sender.add_group(target)
                log.info(
                    "broker group %s found in etcd: %s", group.name, ", ".join(group.addresses)
                )
            elif group.addresses:
                try:
                    target.update_members(group.addresses)
                except ValueError as exc:
                    log.warning("broker group %s: %s; keeping its members", group.name, exc)
            # A draining broker group still runs: it takes the resends of what it may
            # hold (delayd.sender.sender, doubt_hold_ms), never a new message.
            draining = group.kind is GroupKind.BROKER and group.status is GroupStatus.DRAINING
            self.sender.set_accepting(
                group.name, group.takes_deliveries, takes_resends=group.takes_deliveries or draining
            )
        for name in self.targets.keys() - seen:
            self.sender.set_accepting(name, False)  # retired or unregistered

    async def aclose(self) -> None:
        """Close the targets' connections (the sender no longer runs)."""
        for target in self.targets.values():
            await target.aclose()
