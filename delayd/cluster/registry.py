"""The cluster's registry of groups (docs/cluster.md): which groups the cluster has, of
which kind, and whether each takes new work.

One key per group, **not on a lease**, so a group whose members are all down is still
part of the cluster (a producer must not move its message ids elsewhere while it
restarts)::

    <prefix>/registry/G   {"group": G, "kind": "delay"|"broker", "status": ..., ...}

A member registers its group when it joins (``register``: created if absent, never
overwritten, so an operator's status stands). The status is the operator's
(``set_status``): ``active`` takes new work; ``draining`` takes none but is still asked
about what it holds; ``retired`` holds nothing the cluster still needs.

``registered_ms`` and ``changed_ms`` (the registration, then each ``set_status``, in the
same compare-and-swap as the status) are all a producer needs of the past to tell which
groups may hold an id sent before a change (delayd.client._routing.possible_owners).
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, replace

from delayd.cluster.etcd import Compare, EtcdClient, Get, KeyValue, Put
from delayd.cluster.members import check_name


class GroupKind(enum.StrEnum):
    DELAY = "delay"  # delay servers: intake, schedule, deliver (an embedded broker too)
    BROKER = "broker"  # standalone brokers


class GroupStatus(enum.StrEnum):
    ACTIVE = "active"  # takes new messages (delay) or deliveries (broker)
    DRAINING = "draining"  # takes no new work; still asked about what it holds
    RETIRED = "retired"  # drained: nothing in it is still needed


@dataclass(frozen=True, slots=True)
class Registration:
    """One group's registry entry; times are epoch ms."""

    group: str
    kind: GroupKind
    status: GroupStatus
    registered_ms: int
    changed_ms: int

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Registration:
        """Raises ValueError naming what is wrong with ``data``."""
        try:
            fields = json.loads(data)
            return cls(
                group=check_name("group", fields["group"]),
                kind=GroupKind(fields["kind"]),
                status=GroupStatus(fields["status"]),
                registered_ms=int(fields["registered_ms"]),
                changed_ms=int(fields["changed_ms"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"registry entry {data[:200]!r}: {exc!r}") from None


def registry_key(prefix: str, group: str) -> str:
    return f"{prefix}/registry/{check_name('group', group)}"


async def register(
    etcd: EtcdClient, prefix: str, group: str, kind: GroupKind, now_ms: int
) -> Registration:
    """The group's entry, created ``active`` if the registry has none (one txn: two
    members joining at once create one entry). Raises EtcdError as EtcdClient does."""
    key = registry_key(prefix, group)
    entry = Registration(group, kind, GroupStatus.ACTIVE, now_ms, now_ms)
    result = await etcd.txn(
        [Compare.create_revision(key, 0)], [Put(key, entry.to_json())], [Get(key)]
    )
    if result.succeeded:
        return entry
    found = result.responses[0]
    assert not isinstance(found, int) and found is not None
    return Registration.from_json(found.kvs[0].value)


async def set_status(
    etcd: EtcdClient, prefix: str, group: str, status: GroupStatus, now_ms: int
) -> Registration:
    """Set a registered group's status (compare-and-swap on the entry read). Raises
    LookupError for a group the registry does not hold, EtcdError as EtcdClient does."""
    key = registry_key(prefix, group)
    while True:
        found = await etcd.get(key)
        if found is None:
            raise LookupError(f"the cluster has no group {group!r} (delayd cluster status)")
        entry = replace(Registration.from_json(found.value), status=status, changed_ms=now_ms)
        written = await etcd.txn(
            [Compare.mod_revision(key, found.mod_revision)], [Put(key, entry.to_json())]
        )
        if written.succeeded:
            return entry


def _entries(kvs: tuple[KeyValue, ...]) -> dict[str, Registration]:
    entries = {}
    for kv in kvs:
        entry = Registration.from_json(kv.value)
        entries[entry.group] = entry
    return entries


async def read_registry(etcd: EtcdClient, prefix: str) -> dict[str, Registration]:
    """Every registered group of the cluster at ``prefix``, by name."""
    found = await etcd.range(f"{prefix}/registry/", prefix=True)
    return _entries(found.kvs)
