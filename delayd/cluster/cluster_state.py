"""A whole cluster as etcd holds it: its registry (delayd.cluster.registry) joined with
every group's live keys (delayd.cluster.group_state), by group name. For ``delayd cluster
status``, ``delayd top --etcd`` and the delay servers that find broker groups in etcd."""

from __future__ import annotations

from dataclasses import dataclass

from delayd.cluster.etcd import EtcdClient
from delayd.cluster.group_state import GroupState, read_groups
from delayd.cluster.registry import Registration, read_registry


@dataclass(frozen=True, slots=True)
class GroupInCluster:
    """One group: its registry entry (None: its members never registered it) and its
    keys (None: no member up and no leader key left)."""

    name: str
    registration: Registration | None
    state: GroupState | None


async def read_cluster(etcd: EtcdClient, prefix: str) -> list[GroupInCluster]:
    """Every group of the cluster at ``prefix``, registered or with keys, by name (two
    range reads). Raises EtcdError as EtcdClient does, ValueError for a damaged registry
    entry."""
    registry = await read_registry(etcd, prefix)
    states = {state.group: state for state in await read_groups(etcd, prefix)}
    return [
        GroupInCluster(name, registry.get(name), states.get(name))
        for name in sorted(registry.keys() | states.keys())
    ]
