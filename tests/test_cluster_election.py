"""Group membership and leader election against a real etcd: members in this process
(each with its own client), and members in child processes killed with kill -9."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from delayd.cluster.election import GroupMember, check_lease_ttl_ms
from delayd.cluster.etcd import EtcdClient, KeyValue
from delayd.cluster.members import NO_LEADER, GroupKeys, MemberInfo, Role, View, view_of
from tests.etcd_support import (
    EtcdServer,
    start_cluster,
)

ROOT = Path(__file__).resolve().parent.parent
TTL_MS = 1000  # etcd's shortest lease: failovers in these tests take about a second
GROUP = "g1"


# Pure parts


def test_keys_of_a_group():
    keys = GroupKeys("/delayd", "delay-a")
    assert keys.leader == "/delayd/groups/delay-a/leader"
    assert keys.member("m1") == "/delayd/groups/delay-a/members/m1"
    assert keys.members == "/delayd/groups/delay-a/members/"
    for prefix in ("delayd", "/delayd/"):
        with pytest.raises(ValueError, match="must start with '/' and not end with it"):
            GroupKeys(prefix, "g")
    for name in ("", "a/b", "-a", "x" * 129):
        with pytest.raises(ValueError, match="1 to 128 letters"):
            GroupKeys("/delayd", name)
    with pytest.raises(ValueError, match="member id 'a b'"):
        MemberInfo("a b")


def test_member_info_json_ignores_fields_it_does_not_know():
    info = MemberInfo("m1", intake="10.0.0.1:7000", broker="10.0.0.1:7001")
    assert MemberInfo.from_json(info.to_json()) == info
    later = json.dumps({"member_id": "m2", "metrics": "h:9", "data_offset": 42}).encode()
    assert MemberInfo.from_json(later) == MemberInfo("m2", metrics="h:9")
    for junk in (b"not json", b"[1]", b'{"intake": "h:1"}'):
        with pytest.raises(ValueError, match="member info"):
            MemberInfo.from_json(junk)


def leader_kv(lease: int, value: bytes = MemberInfo("a").to_json()) -> KeyValue:
    return KeyValue(b"/k", value, create_revision=41, mod_revision=41, version=1, lease=lease)


def test_a_member_leads_when_the_key_is_on_its_own_lease():
    assert view_of(leader_kv(lease=7), own_lease=7) == View(Role.LEADER, 41, MemberInfo("a"))
    # Same member id, another lease: the key an earlier life of this member left.
    assert view_of(leader_kv(lease=6), own_lease=7) == View(Role.FOLLOWER, 41, MemberInfo("a"))
    assert view_of(None, own_lease=7) == NO_LEADER
    # A key left by this member's previous life (same id, another lease): no leader
    # known until it expires — following it would be following itself.
    assert view_of(leader_kv(lease=6), own_lease=7, own_id="a") == NO_LEADER
    assert view_of(leader_kv(lease=7), own_lease=7, own_id="a").role is Role.LEADER
    assert view_of(leader_kv(lease=6), own_lease=7, own_id="b").role is Role.FOLLOWER
    assert view_of(leader_kv(lease=6, value=b"junk"), own_lease=7) == View(Role.FOLLOWER, 41)


def test_lease_ttl_must_be_whole_seconds():
    assert check_lease_ttl_ms(2000) == 2000
    for bad in (0, 500, 1500):
        with pytest.raises(ValueError, match="whole number of seconds, at least 1000"):
            check_lease_ttl_ms(bad)


# Members in this process


class Running:
    """A GroupMember running in the test's nursery, with its own client, that can be
    stopped on its own (a graceful stop: it resigns)."""

    def __init__(self, url: str | list[str], prefix: str, member_id: str, **options) -> None:
        self.urls = [url] if isinstance(url, str) else url
        self.member_id = member_id
        self.prefix = prefix
        self.options = options
        self.changes: list[tuple[float, View, str]] = []
        self.member: GroupMember | None = None
        self.scope = trio.CancelScope()
        self.done = trio.Event()

    async def start(self, nursery: trio.Nursery) -> Running:
        etcd = EtcdClient(self.urls, timeout_s=0.3)
        self.member = GroupMember(
            etcd,
            GROUP,
            MemberInfo(self.member_id, intake=f"{self.member_id}:7000"),
            prefix=self.prefix,
            lease_ttl_ms=TTL_MS,
            on_change=lambda _, view, why: self.changes.append((trio.current_time(), view, why)),
            **self.options,
        )

        async def run() -> None:
            async with etcd:
                with self.scope:
                    await self.member.run()
            self.done.set()

        nursery.start_soon(run)
        return self

    @property
    def role(self) -> Role:
        return self.member.role

    def last_took(self, role: Role) -> float:
        """When the member last took ``role`` (it must have)."""
        return next(t for t, view, _ in reversed(self.changes) if view.role is role)

    async def stop(self) -> None:
        self.scope.cancel()
        await self.done.wait()


async def wait_for(condition, timeout_s: float = 10.0, what: str = "condition") -> float:
    """Poll ``condition()`` (state held in etcd has no event here) until it holds; returns
    the time it was seen. The default bound is generous (a loaded machine answers etcd
    late); a test whose claim is how soon passes its own or asserts the time returned."""
    with trio.move_on_after(timeout_s):
        while not condition():
            await trio.sleep(0.002)
        return trio.current_time()
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def leaders(members: list[Running]) -> list[Running]:
    return [m for m in members if m.role is Role.LEADER]


def settled(members: list[Running]) -> bool:
    """One leader, every other member following it at its epoch."""
    found = leaders(members)
    if len(found) != 1:
        return False
    leader = found[0].member
    return all(
        m.member.view == View(Role.FOLLOWER, leader.epoch, leader.info)
        for m in members
        if m is not found[0]
    )


async def leader_and_follower(
    nursery: trio.Nursery,
    prefix: str,
    first: tuple[str | list[str], str],
    second: tuple[str | list[str], str],
) -> tuple[Running, Running]:
    """Start ``first`` and wait until it leads, then ``second`` and wait until it
    follows; each is (etcd url or urls, member id)."""
    leader = await Running(first[0], prefix, first[1]).start(nursery)
    await wait_for(lambda: leader.role is Role.LEADER, what="the first leader")
    follower = await Running(second[0], prefix, second[1]).start(nursery)
    await wait_for(lambda: settled([leader, follower]), what="a follower")
    return leader, follower


async def elected(nursery: trio.Nursery, url: str, prefix: str) -> list[Running]:
    """Start members m0, m1 and m2 and wait until one leads and the others follow."""
    members = [await Running(url, prefix, f"m{i}").start(nursery) for i in range(3)]
    await wait_for(lambda: settled(members), what="one leader, two followers")
    return members


async def test_three_members_elect_exactly_one_leader_and_register(
    etcd_server,
    etcd_prefix,
    nursery,
):
    members = await elected(nursery, etcd_server.url, etcd_prefix)
    (leader,) = leaders(members)
    assert leader.member.elections_won == 1
    assert leader.member.may_lead()
    assert not any(m.member.may_lead() for m in members if m is not leader)

    async with EtcdClient([etcd_server.url]) as etcd:
        keys = GroupKeys(etcd_prefix, GROUP)
        registered = await etcd.range(keys.members, prefix=True)
        held = await etcd.get(keys.leader)
    assert [MemberInfo.from_json(kv.value) for kv in registered.kvs] == [
        MemberInfo(f"m{i}", intake=f"m{i}:7000") for i in range(3)
    ]
    assert held.create_revision == leader.member.epoch
    assert MemberInfo.from_json(held.value) == leader.member.info
    # Nobody ever saw two leaders: each member took LEADER at most once, and only one did.
    took_lead = [m for m in members if any(v.role is Role.LEADER for _, v, _ in m.changes)]
    assert took_lead == [leader]


async def test_a_resigning_leader_hands_over_fast_and_epochs_grow(
    etcd_server,
    etcd_prefix,
    nursery,
):
    members = await elected(nursery, etcd_server.url, etcd_prefix)
    epochs = []
    while len(members) > 1:
        (leader,) = leaders(members)
        epochs.append(leader.member.epoch)
        stopped = trio.current_time()
        await leader.stop()
        assert leader.changes[-1][1] == NO_LEADER  # it stepped down as it stopped
        members.remove(leader)
        taken = await wait_for(lambda: settled(members), what="the next leader")
        assert taken - stopped < 0.5
    epochs.append(members[0].member.epoch)
    assert epochs == sorted(set(epochs))  # strictly increasing


@pytest.mark.slow
async def test_a_leader_cut_off_from_etcd_steps_down_before_its_lease_expires(
    etcd_server, etcd_prefix, etcd_proxy, nursery
):
    cut_off, other = await leader_and_follower(
        nursery, etcd_prefix, (etcd_proxy.url, "cut"), (etcd_server.url, "other")
    )
    old_epoch = cut_off.member.epoch

    etcd_proxy.cut()  # a partition: renewals from "cut" hang, etcd hears nothing
    cut_at = trio.current_time()
    await wait_for(lambda: other.role is Role.LEADER, timeout_s=4, what="a new leader")
    stepped_down = cut_off.last_took(Role.CANDIDATE)
    took_over = other.last_took(Role.LEADER)

    # At the latest ttl - margin after the last renewal answered before the cut...
    assert stepped_down - cut_at < (TTL_MS - TTL_MS // 4) / 1000 + 0.25
    # ... which is before etcd can let the lease go: ttl after that renewal was sent.
    assert stepped_down < took_over
    assert not cut_off.member.may_lead()
    assert "no lease renewal answered" in cut_off.changes[-1][2]
    assert other.member.epoch > old_epoch
    assert took_over - cut_at < TTL_MS / 1000 + 1.5  # etcd checks expiries every 0.5 s

    etcd_proxy.heal()  # the old leader comes back with a new lease, and follows
    await wait_for(lambda: settled([cut_off, other]), what="the old leader following")
    assert cut_off.member.leader.member_id == "other"


@pytest.mark.slow
async def test_a_follower_cut_off_from_etcd_leaves_and_comes_back(
    etcd_server, etcd_prefix, etcd_proxy, nursery
):
    leader, follower = await leader_and_follower(
        nursery, etcd_prefix, (etcd_server.url, "leader"), (etcd_proxy.url, "follower")
    )
    epoch = leader.member.epoch

    etcd_proxy.cut()
    await wait_for(lambda: follower.role is Role.CANDIDATE, what="the follower leaving")
    assert "leaving the group: no lease renewal answered" in follower.changes[-1][2]
    etcd_proxy.heal()
    await wait_for(lambda: settled([leader, follower]), what="the follower back")
    assert leader.member.epoch == epoch  # the leader never noticed
    assert [view.role for _, view, _ in leader.changes] == [Role.LEADER]


@pytest.mark.slow
async def test_a_short_etcd_restart_changes_no_role(tmp_path):
    server = EtcdServer(tmp_path / "etcd").start()  # its own: this one is stopped
    try:
        async with trio.open_nursery() as nursery:
            leader, follower = await leader_and_follower(
                nursery, "/restart", (server.url, "leader"), (server.url, "follower")
            )
            before = (leader.member.view, follower.member.view)

            await trio.to_thread.run_sync(server.stop)
            await trio.to_thread.run_sync(server.restart)  # well inside ttl - margin
            await trio.sleep(TTL_MS / 1000)  # renewals and the watch go through it again

            assert (leader.member.view, follower.member.view) == before
            assert len(leader.changes) == len(follower.changes) == 1
            assert leader.member.may_lead()
            await leader.stop()  # the follower's watch survived the restart
            await wait_for(lambda: follower.role is Role.LEADER, timeout_s=0.5, what="takeover")
            nursery.cancel_scope.cancel()
    finally:
        server.stop()


@pytest.mark.slow
async def test_losing_one_etcd_of_three_changes_no_role(tmp_path):
    cluster = start_cluster(tmp_path)
    urls = [server.url for server in cluster]
    try:
        async with trio.open_nursery() as nursery:
            leader, follower = await leader_and_follower(
                nursery, "/three", (urls, "leader"), (urls, "follower")
            )
            before = (leader.member.view, follower.member.view)

            cluster[0].kill()  # the etcd both members talk to: its machine dies
            await trio.sleep(TTL_MS / 1000)  # renewals and watches move to the others

            assert (leader.member.view, follower.member.view) == before
            assert leader.member.may_lead()
            assert leader.member.etcd.current_endpoint != urls[0]
            await leader.stop()  # the follower's watch moved too
            await wait_for(lambda: follower.role is Role.LEADER, timeout_s=0.5, what="takeover")
            nursery.cancel_scope.cancel()
    finally:
        for server in cluster:
            server.kill()


async def test_may_lead_is_false_past_the_deadline_even_before_the_step_down_runs(
    etcd_server,
    etcd_prefix,
    nursery,
):
    stalled = await Running(etcd_server.url, etcd_prefix, "stalled").start(nursery)
    await wait_for(lambda: stalled.role is Role.LEADER, what="the leader")
    assert stalled.member.may_lead()
    time.sleep((TTL_MS - TTL_MS // 4) / 1000 + 0.05)  # the event loop stalls past it
    assert stalled.role is Role.LEADER  # no task ran to step down ...
    assert not stalled.member.may_lead()  # ... but nothing may be acknowledged


async def test_a_leader_whose_lease_is_revoked_says_so_and_leads_again(
    etcd_server, etcd_prefix, nursery, caplog
):
    """Its key goes while it trusts its lease: the change says it was its own key and
    that it still trusted the lease, and the session's end says etcd no longer knows it."""
    caplog.set_level(logging.INFO, logger="delayd.cluster")
    leader = await Running(etcd_server.url, etcd_prefix, "revoked").start(nursery)
    await wait_for(lambda: leader.role is Role.LEADER, what="the leader")
    epoch = leader.member.epoch
    async with EtcdClient([etcd_server.url]) as etcd:
        await etcd.lease_revoke(leader.member._lease_id)  # as an operator's etcdctl would

    await wait_for(lambda: leader.member.epoch not in (None, epoch), what="leading again")
    said = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("delayd.cluster"))
    assert "own leader key was deleted while this member still trusted its lease" in said or (
        "stepping down: etcd no longer knows the lease" in said  # the renewal saw it first
    ), said
    assert "etcd no longer knows the lease" in said, said


class SlowToRegister(EtcdClient):
    """Registers its first session's member key only after that lease can no longer be
    trusted (a loaded etcd, a stalled process), and counts the campaigns (txns) made
    before that session's lease is revoked."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.first_session = True
        self.campaigns_in_first_session = 0

    async def put(self, *args, **kwargs) -> int:
        if self.first_session:
            await trio.sleep((TTL_MS - TTL_MS // 4) / 1000 + 0.05)
        return await super().put(*args, **kwargs)

    async def txn(self, *args, **kwargs):
        self.campaigns_in_first_session += self.first_session
        return await super().txn(*args, **kwargs)

    async def lease_revoke(self, lease_id: int) -> None:
        self.first_session = False
        await super().lease_revoke(lease_id)


async def test_a_member_does_not_campaign_on_a_lease_it_no_longer_trusts(etcd_server, etcd_prefix):
    """It would lead for no time at all, with a new epoch, and make its server promote
    and demote; it starts a new session instead, and leads on that one."""
    changes = []
    async with SlowToRegister([etcd_server.url], timeout_s=0.3) as etcd, trio.open_nursery() as n:
        member = GroupMember(
            etcd,
            GROUP,
            MemberInfo("slow"),
            prefix=etcd_prefix,
            lease_ttl_ms=TTL_MS,
            on_change=lambda _, view, why: changes.append((view.role, why)),
        )
        n.start_soon(member.run)
        await wait_for(lambda: member.role is Role.LEADER, what="the leader")
        n.cancel_scope.cancel()
    assert etcd.campaigns_in_first_session == 0
    assert [role for role, _ in changes][:1] == [Role.LEADER], changes
    assert member.elections_won == 1


@pytest.mark.slow
async def test_a_member_that_is_not_eligible_never_campaigns(
    etcd_server,
    etcd_prefix,
    nursery,
):
    ready = False
    first = await Running(etcd_server.url, etcd_prefix, "first").start(nursery)
    await wait_for(lambda: first.role is Role.LEADER, what="the first leader")
    waiting = await Running(etcd_server.url, etcd_prefix, "waiting", eligible=lambda: ready).start(
        nursery
    )
    await wait_for(lambda: waiting.role is Role.FOLLOWER, what="a follower")

    await first.stop()
    await wait_for(lambda: waiting.role is Role.CANDIDATE, what="the leader gone")
    await trio.sleep(TTL_MS / 1000)
    assert waiting.role is Role.CANDIDATE  # nobody leads: nobody may

    ready = True
    became = trio.current_time()
    took_over = await wait_for(lambda: waiting.role is Role.LEADER, what="an eligible member")
    assert took_over - became < TTL_MS / 3000 + 0.4  # asked again every ttl/3


# Members in child processes


class MemberProcess:
    """``python -m delayd.cluster`` in a child process, reading its JSON lines."""

    def __init__(self, url: str, prefix: str, member_id: str) -> None:
        self.args = [
            sys.executable,
            "-m",
            "delayd.cluster",
            f"--etcd={url}",
            f"--group={GROUP}",
            f"--member-id={member_id}",
            f"--prefix={prefix}",
            f"--lease-ttl-ms={TTL_MS}",
        ]
        self.process: trio.Process | None = None
        self.views: list[dict] = []
        self._buffer = b""

    async def start(self, nursery: trio.Nursery) -> MemberProcess:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.process = await nursery.start(
            lambda task_status: trio.run_process(
                self.args,
                stdout=subprocess.PIPE,
                check=False,
                env=env,
                task_status=task_status,
            )
        )
        return self

    async def next_view(self) -> dict:
        while b"\n" not in self._buffer:
            data = await self.process.stdout.receive_some()
            assert data, f"member exited with {self.process.poll()} before {self.views}"
            self._buffer += data
        line, self._buffer = self._buffer.split(b"\n", 1)
        self.views.append(json.loads(line))
        return self.views[-1]

    async def wait_role(self, role: str) -> dict:
        with trio.fail_after(10):
            while True:
                view = await self.next_view()
                if view["role"] == role:
                    return view


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill -9", "SIGTERM"])
async def test_a_leader_process_that_dies_is_replaced(
    how,
    etcd_server,
    etcd_prefix,
    nursery,
):
    child = await MemberProcess(etcd_server.url, etcd_prefix, "child").start(nursery)
    led = await child.wait_role("leader")
    here = await Running(etcd_server.url, etcd_prefix, "here").start(nursery)
    await wait_for(lambda: here.role is Role.FOLLOWER, what="a follower")
    assert here.member.leader.member_id == "child"
    assert here.member.epoch == led["epoch"]

    child.process.send_signal(signal.SIGKILL if how == "kill -9" else signal.SIGTERM)
    died = trio.current_time()
    took_over = await wait_for(lambda: here.role is Role.LEADER, timeout_s=4, what="takeover")
    if how == "kill -9":
        # Only the lease's expiry lets anyone in: at least ttl - ttl/3 after the
        # child's last renewal, at most ttl plus etcd's 0.5 s expiry check.
        assert 0.5 < took_over - died < TTL_MS / 1000 + 1.5
    else:
        assert took_over - died < 0.5  # it resigned
        assert (await child.wait_role("candidate"))["reason"] == "stopping"
    assert here.member.epoch > led["epoch"]
