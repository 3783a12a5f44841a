"""Eligibility against a real etcd: only a member of the group's in-sync set campaigns;
a new group's first leader writes the set with itself, never over one that exists; the
leader's writes of it are fenced by its epoch. Members run in this process
(delayd.serving.membership, as the servers run them)."""

from __future__ import annotations

import json

import pytest
import trio

from delayd.cluster.config import ClusterConfig
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.in_sync import (
    decode_members,
    encode_members,
    write_in_sync,
)
from delayd.cluster.members import GroupKeys, MemberInfo, Role
from delayd.replication.epochs import EpochHistory
from delayd.serving.membership import Membership

GROUP = "g1"
TTL_MS = 1000


def test_the_value_is_a_sorted_json_list_of_ids():
    assert encode_members(["b", "a", "b"]) == b'["a", "b"]'
    assert decode_members(b'["a", "b"]') == {"a", "b"}
    for junk in (b"nope", b'{"a": 1}', b"[1]"):
        with pytest.raises(ValueError, match="in_sync"):
            decode_members(junk)
    with pytest.raises(ValueError, match="member id"):
        encode_members(["a b"])


class Member:
    """A Membership running in the test's nursery that can be stopped on its own."""

    def __init__(
        self, url: str, prefix: str, member_id: str, history: EpochHistory | None = None
    ) -> None:
        config = ClusterConfig(etcd=(url,), group=GROUP, lease_ttl_ms=TTL_MS, prefix=prefix)
        if history is None:
            self.membership = Membership(config)
        else:  # eligibility as a server's: by its epoch history
            self.membership = Membership(
                config,
                holds_group_data=history.knows_group,
                before_founding=history.claim_founding,
            )
        self.info = MemberInfo(member_id, intake=f"{member_id}:7000")

    async def start(self, nursery: trio.Nursery) -> Member:
        await nursery.start(self.membership.run, self.info)
        return self

    @property
    def role(self) -> Role:
        return self.membership.view.role


async def until(condition, timeout_s: float, what: str) -> None:
    with trio.fail_after(timeout_s):
        while not condition():
            await trio.sleep(0.005)


async def read_in_sync(url: str, prefix: str) -> frozenset[str] | None:
    async with EtcdClient([url]) as etcd:
        kv = await etcd.get(GroupKeys(prefix, GROUP).in_sync)
    return None if kv is None else decode_members(kv.value)


async def test_only_an_in_sync_member_takes_over(etcd_server, etcd_prefix, nursery):
    url = etcd_server.url
    a = await Member(url, etcd_prefix, "a").start(nursery)
    await until(lambda: a.role is Role.LEADER, 3, "a leads a new group")
    await until(lambda: a.membership.in_sync.members == {"a"}, 3, "a writes the set")
    assert await read_in_sync(url, etcd_prefix) == {"a"}
    b = await Member(url, etcd_prefix, "b").start(nursery)
    await until(lambda: b.role is Role.FOLLOWER, 3, "b follows")

    a.membership.resign()  # the leader key goes at once
    with trio.move_on_after(3 * TTL_MS / 1000):  # b asks again every ttl/3 meanwhile
        await until(lambda: b.role is Role.LEADER, 10, "never")
    assert b.role is Role.CANDIDATE and not b.membership.may_lead()
    assert b.membership.refusal("intake").endswith("leader unknown")

    async with EtcdClient([url]) as etcd:  # what the data path will write once b caught up
        await etcd.put(GroupKeys(etcd_prefix, GROUP).in_sync, json.dumps(["a", "b"]))
    await until(lambda: b.role is Role.LEADER, 3, "b, now in sync, leads")
    assert b.membership.may_lead() and b.membership.elections_total == 1


async def test_the_leaders_writes_are_fenced_by_its_epoch(etcd_server, etcd_prefix, nursery):
    url = etcd_server.url
    a = await Member(url, etcd_prefix, "a").start(nursery)
    await until(lambda: a.membership.in_sync.members == {"a"}, 3, "a writes the set")
    b = await Member(url, etcd_prefix, "b").start(nursery)
    await until(lambda: b.role is Role.FOLLOWER, 3, "b follows")
    member = a.membership.member
    assert await member.set_in_sync(["a", "b"])
    await until(lambda: b.membership.in_sync.members == {"a", "b"}, 3, "b sees the new set")
    assert not await b.membership.member.set_in_sync(["b"])  # a follower cannot
    old_epoch = member.epoch
    a.membership.resign()
    await until(lambda: b.role is Role.LEADER, 3, "b leads")
    keys = GroupKeys(etcd_prefix, GROUP)
    async with EtcdClient([url]) as etcd:
        # The old leader's epoch no longer holds the key: its write is refused.
        assert not await write_in_sync(etcd, keys, old_epoch, ["a"])
        # A set that exists is never written again by a campaign ("a new group").
        assert b.membership.in_sync.campaign_puts() == []
    assert await read_in_sync(url, etcd_prefix) == {"a", "b"}


async def test_a_first_leader_that_died_before_its_epoch_began_leads_again(
    etcd_server, etcd_prefix, nursery, tmp_path
):
    """The campaign that makes a new group's first leader writes the set with it alone;
    dying before it begins its epoch, it has no history, and a member without one may
    not campaign once the group has a set: nobody would ever lead. Its founding claim,
    durable before the campaign, lets it lead again; a wiped disk (no claim) may not."""
    url = etcd_server.url
    history = EpochHistory.open(str(tmp_path / "a-epochs"))
    a = await Member(url, etcd_prefix, "a", history).start(nursery)
    await until(lambda: a.role is Role.LEADER, 3, "a leads a new group")
    assert await read_in_sync(url, etcd_prefix) == {"a"}
    assert history.last_epoch() == 0 and history.knows_group()
    a.membership.resign()  # it dies before it begins its epoch
    await until(lambda: a.role is not Role.LEADER, 3, "a is gone")
    history.close()

    wiped = EpochHistory.open(str(tmp_path / "wiped-epochs"))
    w = await Member(url, etcd_prefix, "a", wiped).start(nursery)
    with trio.move_on_after(3 * TTL_MS / 1000):
        await until(lambda: w.role is Role.LEADER, 10, "never")
    assert w.role is Role.CANDIDATE  # the same id on a wiped disk: no claim, no lead
    w.membership.resign()

    history = EpochHistory.open(str(tmp_path / "a-epochs"))
    again = await Member(url, etcd_prefix, "a", history).start(nursery)
    await until(lambda: again.role is Role.LEADER, 3, "a, restarted, leads again")
    history.close()
