"""The groups of a cluster that hold a broker, as etcd has them: where a delay server
delivers (``[delivery] broker_groups_from = "etcd"``) and where a consumer of
``etcd://H:P/*`` reads (docs/cluster.md, "Broker groups").

Two reads: the registry (which groups the cluster has, of which kind, in which status:
delayd.cluster.registry) and the groups' live members (delayd.cluster.group_state), for
the addresses. A registered group whose members are all down is still listed, without
addresses: it is the cluster's, only unreachable now.
"""

from __future__ import annotations

from dataclasses import dataclass

from delayd.cluster.cluster_state import read_cluster
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.group_state import GroupState
from delayd.cluster.registry import GroupKind, GroupStatus


@dataclass(frozen=True, slots=True)
class BrokerGroup:
    """A registered group that holds a broker. ``addresses``: its live members' broker
    addresses, the leader's first; empty when no member is up."""

    name: str
    kind: GroupKind
    status: GroupStatus
    addresses: tuple[str, ...]

    @property
    def takes_deliveries(self) -> bool:
        """A standalone broker group that the operator has not drained: delay servers
        deliver to it."""
        return self.kind is GroupKind.BROKER and self.status is GroupStatus.ACTIVE


def broker_addresses(state: GroupState) -> tuple[str, ...]:
    """The broker addresses of ``state``'s members, the leader's first."""
    leader = state.leader.broker if state.leader is not None else ""
    members = [member.broker for member in state.members]
    return tuple(address for address in dict.fromkeys([leader, *members]) if address)


async def read_broker_groups(etcd: EtcdClient, prefix: str) -> list[BrokerGroup]:
    """Every group of the cluster at ``prefix`` that holds a broker, by name: the
    registered broker groups (also when no member is up), and the delay groups whose
    live members serve an embedded broker. Retired groups are left out: they hold
    nothing the cluster still needs. Raises EtcdError as EtcdClient does."""
    found = []
    for group in await read_cluster(etcd, prefix):
        entry, state = group.registration, group.state
        if entry is None or entry.status is GroupStatus.RETIRED:
            continue
        addresses = broker_addresses(state) if state is not None else ()
        if entry.kind is GroupKind.DELAY and not addresses:
            continue
        found.append(BrokerGroup(group.name, entry.kind, entry.status, addresses))
    return found
