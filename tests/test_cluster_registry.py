"""The cluster's registry against a real etcd: a member registers its group when it
joins, once (an operator's status stands), with its kind; the status changes by
compare-and-swap; entries that are not a registration are refused by name."""

from __future__ import annotations

import pytest
import trio

from delayd.cluster.config import ClusterConfig
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.members import MemberInfo
from delayd.cluster.registry import (
    GroupKind,
    GroupStatus,
    Registration,
    read_registry,
    register,
    registry_key,
    set_status,
)
from delayd.serving.membership import Membership


async def registered(url: str, prefix: str, group: str) -> Registration:
    with trio.fail_after(10):
        while True:
            async with EtcdClient([url]) as etcd:
                entries = await read_registry(etcd, prefix)
            if group in entries:
                return entries[group]
            await trio.sleep(0.01)


@pytest.mark.parametrize(
    ("info", "kind"),
    [
        (MemberInfo("m1", intake="h:1", broker="h:2"), GroupKind.DELAY),
        (MemberInfo("m1", broker="h:2"), GroupKind.BROKER),
    ],
)
async def test_a_joining_member_registers_its_group_with_its_kind(
    etcd_server, etcd_prefix, nursery, info, kind
):
    config = ClusterConfig(
        etcd=(etcd_server.url,), group="g1", lease_ttl_ms=1000, prefix=etcd_prefix
    )
    membership = Membership(config)
    await nursery.start(membership.run, info)
    entry = await registered(etcd_server.url, etcd_prefix, "g1")
    assert (entry.group, entry.kind, entry.status) == ("g1", kind, GroupStatus.ACTIVE)
    membership.resign()


async def test_registering_again_keeps_the_operators_status(etcd_server, etcd_prefix):
    async with EtcdClient([etcd_server.url]) as etcd:
        first = await register(etcd, etcd_prefix, "g1", GroupKind.DELAY, 1000)
        assert first.status is GroupStatus.ACTIVE and first.registered_ms == 1000
        drained = await set_status(etcd, etcd_prefix, "g1", GroupStatus.DRAINING, 2000)
        assert drained.changed_ms == 2000 and drained.registered_ms == 1000
        again = await register(etcd, etcd_prefix, "g1", GroupKind.DELAY, 3000)
        assert again == drained
        await register(etcd, etcd_prefix, "g2", GroupKind.BROKER, 3000)
        entries = await read_registry(etcd, etcd_prefix)
        assert sorted(entries) == ["g1", "g2"] and entries["g1"].status is GroupStatus.DRAINING
        assert entries["g2"].kind is GroupKind.BROKER


async def test_setting_the_status_of_an_unknown_group_says_so(etcd_server, etcd_prefix):
    async with EtcdClient([etcd_server.url]) as etcd:
        with pytest.raises(LookupError, match="no group 'nope'"):
            await set_status(etcd, etcd_prefix, "nope", GroupStatus.RETIRED, 1)


async def test_a_damaged_entry_is_refused_naming_it(etcd_server, etcd_prefix):
    async with EtcdClient([etcd_server.url]) as etcd:
        await etcd.put(registry_key(etcd_prefix, "g1"), b'{"group": "g1", "kind": "queue"}')
        with pytest.raises(ValueError, match="registry entry"):
            await read_registry(etcd, etcd_prefix)
