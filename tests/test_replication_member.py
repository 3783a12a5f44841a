"""The member runner (delayd.replication.member) against a real etcd, in this process:
a promoted member records where its epoch begins before it takes any write as leader —
an old leader that returns is cut back to those offsets, so a write of the new epoch
below them would be cut in the middle, or kept on one disk only."""

from __future__ import annotations

from pathlib import Path

import trio

from delayd.cluster.config import ClusterConfig
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.in_sync import decode_members, encode_members
from delayd.cluster.members import GroupKeys, MemberInfo
from delayd.replication import MESSAGE_LOG
from delayd.replication.member import MemberReplication
from delayd.serving.listeners import open_listeners
from delayd.serving.membership import Membership
from tests.test_replication import Member


class WritesOnPromotion(MemberReplication):
    """Takes writes as soon as it is promoted, as intake does once let in."""

    def __init__(self, member: Member, *args, **kwargs) -> None:
        super().__init__(member.streams, member.history, *args, **kwargs)
        self.member = member
        self.promoted = trio.Event()
        self.end_before_writes = -1

    async def _promoted(self, epoch: int) -> None:
        self.end_before_writes = self.member.streams.message_log.end_offset
        self.member.append_messages(5, b"new-epoch")
        self.promoted.set()


async def promoted_member(
    runner_class, member: Member, config: ClusterConfig, nursery, event: str = "promoted"
):
    """``runner_class`` (whose ``promoted`` event its promotion sets) running ``member``
    as member "a" of ``config``'s group, once promoted (once its ``event`` is set)."""
    membership = Membership(config)
    listeners = await open_listeners("replication", "127.0.0.1", 0)
    runner = runner_class(member, membership, config, listeners)
    await nursery.start(runner.run)
    await nursery.start(membership.run, MemberInfo("a", intake="127.0.0.1:1"))
    with trio.fail_after(10):
        await getattr(runner, event).wait()
    return runner


async def test_the_epoch_begins_before_the_promoted_member_takes_a_write(
    tmp_path: Path, etcd_server, etcd_prefix, nursery
) -> None:
    member = Member(tmp_path / "a")
    try:
        member.append_messages(3, b"before")  # copied as a follower, say
        config = ClusterConfig(
            etcd=(etcd_server.url,),
            group="g1",
            lease_ttl_ms=1000,
            min_in_sync=0,
            prefix=etcd_prefix,
        )
        runner = await promoted_member(WritesOnPromotion, member, config, nursery)
        membership = runner.membership
        (entry,) = member.history.entries
        assert entry.epoch == membership.view.epoch
        assert entry.starts[MESSAGE_LOG] == runner.end_before_writes > 0
        assert member.streams.message_log.end_offset > entry.starts[MESSAGE_LOG]
        membership.resign()
    finally:
        member.close()


class Promoted(MemberReplication):
    def __init__(self, member: Member, *args, **kwargs) -> None:
        super().__init__(member.streams, member.history, *args, **kwargs)
        self.promoted = trio.Event()

    async def _promoted(self, epoch: int) -> None:
        self.promoted.set()


async def test_a_member_no_longer_registered_leaves_the_in_sync_set_at_promotion(
    tmp_path: Path, etcd_server, etcd_prefix, nursery
) -> None:
    """The old leader, killed: its lease expired with its member key. Acks of the new
    leader must not wait replica_lag_ms for it (they did: 1 s at every failover)."""
    member = Member(tmp_path / "a")
    try:
        config = ClusterConfig(
            etcd=(etcd_server.url,), group="g1", lease_ttl_ms=1000, prefix=etcd_prefix
        )
        async with EtcdClient([etcd_server.url]) as etcd:
            keys = GroupKeys(etcd_prefix, "g1")
            await etcd.put(keys.in_sync, encode_members(["a", "ghost"]))
        runner = await promoted_member(Promoted, member, config, nursery)
        membership = runner.membership
        with trio.fail_after(10):
            while runner.leader is None:
                await trio.sleep(0.01)
        assert runner.leader.in_sync == frozenset()  # ghost is not waited for
        async with EtcdClient([etcd_server.url]) as etcd:
            found = await etcd.get(keys.in_sync)
        assert found is not None and decode_members(found.value) == {"a"}
        membership.resign()
    finally:
        member.close()


class SlowFirstPromotion(MemberReplication):
    """Its first promotion's hook runs until the member leads at a newer epoch (its lease
    revoked meanwhile, a new one won): the hooks must act for the epoch of their own
    Leader, not the role's epoch of the moment."""

    def __init__(self, member: Member, *args, **kwargs) -> None:
        super().__init__(member.streams, member.history, *args, **kwargs)
        self.promoted = trio.Event()
        self.first_hook_runs = trio.Event()
        self.calls: list[tuple[str, int, int | None]] = []  # hook, its epoch, role's epoch

    async def _promoted(self, epoch: int) -> None:
        self.calls.append(("promoted", epoch, self.membership.view.epoch))
        if len(self.calls) == 1:
            self.first_hook_runs.set()
            while self.membership.view.epoch in (None, epoch):
                await self.membership.wait_change()
        else:
            self.promoted.set()

    def _demoted(self, epoch: int) -> None:
        self.calls.append(("demoted", epoch, self.membership.view.epoch))


async def test_hooks_act_for_their_own_leaders_epoch_when_the_role_moved_on(
    tmp_path: Path, etcd_server, etcd_prefix, nursery
) -> None:
    """A stale promotion (its hook still running when the member stepped down and won a
    newer epoch) told its hooks the role's epoch: the delay server then took the newer
    epoch's promotion stages for it, and the stale Leader's demotion undid them."""
    member = Member(tmp_path / "a")
    try:
        config = ClusterConfig(
            etcd=(etcd_server.url,), group="g1", lease_ttl_ms=6000, prefix=etcd_prefix
        )
        runner = await promoted_member(
            SlowFirstPromotion, member, config, nursery, event="first_hook_runs"
        )
        membership = runner.membership
        async with EtcdClient([etcd_server.url]) as etcd:
            leader_key = await etcd.get(GroupKeys(etcd_prefix, "g1").leader)
            assert leader_key is not None
            await etcd.lease_revoke(leader_key.lease)  # the member wins again, later
        with trio.fail_after(20):
            await runner.promoted.wait()
        (hook, first_epoch, _), demoted, promoted = runner.calls[:3]
        assert hook == "promoted"
        second_epoch = promoted[1]
        assert promoted == ("promoted", second_epoch, second_epoch)
        assert second_epoch > first_epoch
        # The stale Leader's demotion is told its own epoch, before the newer promotion.
        assert demoted == ("demoted", first_epoch, second_epoch)
        membership.resign()
    finally:
        member.close()
