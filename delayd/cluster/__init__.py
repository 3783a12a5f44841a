"""Groups of members on etcd: membership, leader election, step-down, the in-sync set
(docs/replication.md; DESIGN.md, "Groups, replication and failover").

The names are imported on first use (PEP 562): the servers read ``[cluster]``
(delayd.cluster.config) whether or not they join a group, and only a member needs the
etcd client and its HTTP stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from delayd.cluster.election import GroupMember
    from delayd.cluster.etcd import EtcdClient
    from delayd.cluster.lease_guard import DEFAULT_LEASE_TTL_MS, LeaseGuard
    from delayd.cluster.members import DEFAULT_PREFIX, GroupKeys, MemberInfo, Role, View

_WHERE = {
    "DEFAULT_LEASE_TTL_MS": "lease_guard",
    "DEFAULT_PREFIX": "members",
    "EtcdClient": "etcd",
    "GroupKeys": "members",
    "GroupMember": "election",
    "LeaseGuard": "lease_guard",
    "MemberInfo": "members",
    "Role": "members",
    "View": "members",
}

__all__ = [
    "DEFAULT_LEASE_TTL_MS",
    "DEFAULT_PREFIX",
    "EtcdClient",
    "GroupKeys",
    "GroupMember",
    "LeaseGuard",
    "MemberInfo",
    "Role",
    "View",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'delayd.cluster' has no attribute {name!r}")
    return getattr(importlib.import_module(f"delayd.cluster.{_WHERE[name]}"), name)
