"""What etcd says of a group, read in one consistent range: its members, its leader and
epoch, its in-sync set. For the clients that find a leader through ``etcd://`` and for
``delayd cluster status``."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from delayd.cluster.etcd import EtcdClient, KeyValue
from delayd.cluster.in_sync import decode_members
from delayd.cluster.members import DEFAULT_PREFIX, GroupKeys, MemberInfo, cluster_prefix
from delayd.group_address import GroupAddress

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GroupState:
    """One group as etcd holds it. ``epoch`` is the leader key's create_revision;
    ``in_sync`` None when the key does not exist (a group that never had a leader)."""

    group: str
    members: tuple[MemberInfo, ...]
    leader: MemberInfo | None
    epoch: int | None
    in_sync: frozenset[str] | None

    @property
    def is_delay_group(self) -> bool:
        """Its members take messages to schedule (delay servers, with an intake)."""
        return any(member.intake for member in self.members)

    @property
    def holds_broker(self) -> bool:
        """Its members serve a broker: a standalone broker group, or a delay group's
        embedded brokers."""
        return any(member.broker for member in self.members)

    def role_of(self, member_id: str) -> str:
        """``leader`` or ``follower`` (``candidate`` while nobody leads)."""
        if self.leader is None:
            return "candidate"
        return "leader" if self.leader.member_id == member_id else "follower"


def _info(kv: KeyValue) -> MemberInfo | None:
    try:
        return MemberInfo.from_json(kv.value)
    except ValueError as exc:
        log.warning("ignoring %s: %s", kv.key.decode(errors="replace"), exc)
        return None


def _state(group: str, keys: GroupKeys, kvs: list[KeyValue]) -> GroupState:
    members: list[MemberInfo] = []
    leader: MemberInfo | None = None
    epoch = in_sync = None
    for kv in kvs:
        key = kv.key.decode(errors="replace")
        if key == keys.leader:
            leader, epoch = _info(kv), kv.create_revision
        elif key == keys.in_sync:
            try:
                in_sync = decode_members(kv.value)
            except ValueError as exc:
                log.warning("group %s: %s", group, exc)
        elif key.startswith(keys.members) and (info := _info(kv)) is not None:
            members.append(info)
    return GroupState(group, tuple(members), leader, epoch, in_sync)


async def read_group(etcd: EtcdClient, group: str, prefix: str = DEFAULT_PREFIX) -> GroupState:
    """The group ``group`` now. Raises EtcdUnavailable / EtcdError as EtcdClient does,
    ValueError for a bad group name."""
    keys = GroupKeys(prefix, group)
    found = await etcd.range(keys.base + "/", prefix=True)
    return _state(group, keys, list(found.kvs))


async def read_groups(etcd: EtcdClient, prefix: str = DEFAULT_PREFIX) -> list[GroupState]:
    """Every group under ``prefix``, by name."""
    found = await etcd.range(f"{prefix}/groups/", prefix=True)
    by_group: dict[str, list[KeyValue]] = {}
    for kv in found.kvs:
        rest = kv.key.decode(errors="replace").removeprefix(f"{prefix}/groups/")
        by_group.setdefault(rest.split("/", 1)[0], []).append(kv)
    return [_state(group, GroupKeys(prefix, group), kvs) for group, kvs in sorted(by_group.items())]


async def lookup_group(address: GroupAddress) -> GroupState:
    """The group an ``etcd://`` address names, read over a client of its own at its
    endpoints (works under trio and asyncio: only the watch needs trio)."""
    async with EtcdClient(address.etcd) as etcd:
        return await read_group(etcd, address.group, cluster_prefix(address.cluster))
