"""Groups of members on etcd: membership, leader election, step-down (docs/replication.md;
DESIGN.md, "Groups, replication and failover"). Log replication is not built yet."""

from delayd.cluster.election import GroupMember
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.lease_guard import DEFAULT_LEASE_TTL_MS, LeaseGuard
from delayd.cluster.members import DEFAULT_PREFIX, GroupKeys, MemberInfo, Role, View

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
