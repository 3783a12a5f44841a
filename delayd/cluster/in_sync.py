"""The group's in-sync set in etcd: who may become leader (docs/replication.md,
"Eligibility").

``<prefix>/groups/G/in_sync`` holds a JSON list of member ids: the members that hold
everything the group acknowledged. Only they may campaign. A group whose key does not
exist yet is new: any member may lead it, and the first leader writes the key with
itself alone in the txn that makes it leader (``campaign_puts``), which cannot
overwrite a key written meanwhile. After that only
the leader changes it (``write_in_sync``), in a txn that holds only while the leader
key is still the one it created (its create_revision is the leader's epoch): a leader
that lost its key can no longer change who may succeed it.

``InSyncSet`` keeps the key's current value in memory (a watch), so that the election's
``eligible()`` hook needs no I/O; the campaign txn also compares the key's revision with
the one this decision was made on (``campaign_compares``), so a member removed from the
set an instant before it campaigns cannot win on a stale copy.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

import trio

from delayd.cluster.etcd import Compare, EtcdClient, EventKind, KeyValue, Put
from delayd.cluster.members import GroupKeys, check_name
from delayd.errors import EtcdError, EtcdUnavailable

log = logging.getLogger(__name__)

RETRY_S = 0.2  # after a lost watch that etcd cannot take back at once


def encode_members(members: Iterable[str]) -> bytes:
    """The key's value: the sorted, distinct member ids as a JSON list. Raises
    ValueError for an id that is not a valid member id."""
    return json.dumps(sorted({check_name("member id", m) for m in members})).encode()


def decode_members(value: bytes) -> frozenset[str]:
    """The member ids a key's value lists. Raises ValueError for anything but a JSON
    list of strings."""
    try:
        members = json.loads(value)
    except ValueError:
        raise ValueError(f"in_sync is not JSON: {value[:100]!r}") from None
    if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
        raise ValueError(f"in_sync is not a JSON list of member ids: {value[:100]!r}")
    return frozenset(members)


async def write_in_sync(
    etcd: EtcdClient, keys: GroupKeys, epoch: int, members: Iterable[str]
) -> bool:
    """Set the in-sync set to ``members``, only while the leader key's create_revision
    is ``epoch`` (fencing). Returns whether it was written. Raises ValueError for a bad
    member id, EtcdUnavailable / EtcdError as EtcdClient does."""
    value = encode_members(members)
    result = await etcd.txn(
        [Compare.create_revision(keys.leader, epoch)], [Put(keys.in_sync, value)]
    )
    return result.succeeded


class InSyncSet:
    """The in-sync set as last read from etcd, for the election's hooks (see the module
    docstring). Run ``run()`` in a nursery; until its first read nobody is eligible."""

    def __init__(self, etcd: EtcdClient, keys: GroupKeys, member_id: str) -> None:
        self.etcd = etcd
        self.keys = keys
        self.member_id = member_id
        self.members: frozenset[str] | None = None  # None: the key does not exist
        self.mod_revision = 0  # of the value held (0: no key)
        self.loaded = False
        self.changed = trio.Event()

    def eligible(self) -> bool:
        """Whether this member may campaign: it is in the set, or the group is new."""
        if not self.loaded:
            return False
        return self.members is None or self.member_id in self.members

    def campaign_compares(self) -> list[Compare]:
        """The campaign holds only if the key is still the one ``eligible`` judged."""
        return [Compare.mod_revision(self.keys.in_sync, self.mod_revision)]

    def campaign_puts(self) -> list[Put]:
        """A new group's first leader writes the set, with itself alone, in the txn that
        makes it leader: were it written after, a leader that died in between would
        leave a group whose every member may lead, though it may have acknowledged
        records (under ``ack = "leader"``) that no other member holds."""
        if self.members is not None:
            return []
        return [Put(self.keys.in_sync, encode_members([self.member_id]))]

    def _take(self, kv: KeyValue | None) -> None:
        if kv is None:
            self.members, self.mod_revision = None, 0
        else:
            try:
                self.members = decode_members(kv.value)
            except ValueError as exc:
                # Nobody is eligible on a value nobody can read: safe, and said loudly.
                log.error("group %s: %s; no member may campaign", self.keys.group, exc)
                self.members = frozenset()
            self.mod_revision = kv.mod_revision
        self.loaded = True
        self.changed.set()
        self.changed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Read the key and follow it until cancelled. Reports started at once."""
        task_status.started()
        while True:
            try:
                found = await self.etcd.range(self.keys.in_sync)
                self._take(found.kvs[0] if found.kvs else None)
                async with self.etcd.watch(
                    self.keys.in_sync, start_revision=found.revision + 1
                ) as events:
                    async for event in events:
                        self._take(None if event.kind is EventKind.DELETE else event.kv)
            except EtcdUnavailable as exc:
                log.debug("group %s: in_sync unreadable, retrying: %s", self.keys.group, exc)
            except EtcdError as exc:  # a compacted watch: read again
                log.info("group %s: in_sync watch ended (%s), reading again", self.keys.group, exc)
            await trio.sleep(RETRY_S)
