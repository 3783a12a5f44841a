"""A group member's data path, whatever its streams: lead or follow as its role says.

``MemberReplication.run`` follows the member's role (delayd.serving.membership): at each
promotion a ``Leader`` at the member's epoch on the replication listener bound at start
(a later promotion binds the same port again), whose ``on_in_sync_change`` persists the
in-sync set in etcd, fenced by the epoch, before it counts; at each demotion (or when
the leader changes) a ``Follower`` of the replication address in etcd's leader key.
``wait_acknowledged`` is what an ack waits on. A delay group (delayd.server.replicating)
and a broker group (delayd.server.broker_member) are this runner with their streams and
hooks: subclasses override ``_before_leading``, ``_promoted``, ``_while_leading``,
``_demoted``, ``_following``, ``_truncating``, ``_truncated``, ``_retained`` and
``_durable``, and, for a resync from a snapshot of the leader's state,
``_snapshot_source``, ``_snapshot_receiver`` and ``_snapshot_received``.
"""

from __future__ import annotations

import logging

import trio

from delayd.address import parse_address
from delayd.cluster.config import AckMode, ClusterConfig
from delayd.cluster.group_state import read_group
from delayd.cluster.members import Role
from delayd.errors import EtcdError
from delayd.replication.epochs import EpochHistory
from delayd.replication.follower import Follower, member_client_tls
from delayd.replication.leader import Leader, LeaderFenced, LeaderStopped
from delayd.replication.snapshot import SnapshotReceiver, SnapshotSource
from delayd.replication.streams import StreamSet
from delayd.serving.membership import Membership
from delayd.serving.tls import ServerTls

log = logging.getLogger(__name__)

RESTART_LEADER_S = 0.1  # before a Leader that stopped while the member leads is replaced


class MemberReplication:
    """See the module docstring. ``listeners``: the replication listener bound at start
    (served by the first Leader; later ones bind its port again). ``tls``: the server's
    listeners' TLS, the replication listener's too; members follow with its
    certificate."""

    def __init__(
        self,
        streams: StreamSet,
        history: EpochHistory,
        membership: Membership,
        config: ClusterConfig,
        listeners: list[trio.SocketListener] | None,
        *,
        tls: ServerTls | None = None,
    ) -> None:
        self.streams = streams
        self.history = history
        self.membership = membership
        self.config = config
        self.tls = tls
        self.leader: Leader | None = None
        self.follower: Follower | None = None
        self.snapshots_installed = 0  # by the server at its start (metrics)
        # The group's acknowledged offsets as the leaders this member followed told it
        # (never lowered: what the group acknowledged is never cut).
        self.told_acked: dict[str, int] = {}
        self._listeners = listeners
        # Where the replication listener is bound: a leader after the first binds again.
        self._bound: tuple[str, int] | None = None
        if listeners:
            self._bound = listeners[0].socket.getsockname()[:2]

    def grew(self) -> None:
        """A stream grew or became durable (every appender's ``on_durable``)."""
        self.streams.grew()

    # ------------------------------------------------------------------ hooks

    def _before_leading(self) -> None:
        """Before the Leader reads the streams' ends (a promotion)."""

    def _snapshot_source(self) -> SnapshotSource | None:
        """What a Leader sends a follower that lacks records retention deleted; None:
        such a follower is refused."""
        return None

    def _snapshot_receiver(self) -> SnapshotReceiver | None:
        """Where a Follower writes a snapshot; None: it refuses to go on instead."""
        return None

    async def _snapshot_received(self, manifest: dict) -> None:
        """A whole snapshot is durable in the receiver's directory: install it."""

    async def _promoted(self, epoch: int) -> None:
        """The member leads at ``epoch``: what was copied is derived before requests are
        taken. ``epoch`` is the one this Leader began, which the member's role may have
        left already (a step-down and a new win while this ran): a hook acts for it, not
        for the role's epoch of the moment."""

    async def _while_leading(self, leader: Leader) -> None:
        """Runs beside ``leader`` while it serves (cancelled when it stops)."""

    def _demoted(self, epoch: int) -> None:
        """The member's Leader of ``epoch`` stopped: the member no longer leads, leads at
        a newer epoch (its next Leader's ``_promoted`` follows), or still leads at
        ``epoch`` (the Leader stopped on its own: another one is started for it)."""

    async def _following(self) -> None:
        """Before a Follower copies into the streams."""

    async def _truncating(self, stream: str, offset: int) -> None:
        """The leader is about to cut ``stream`` back to ``offset`` (the Follower's
        on_truncating: what was derived from the records that go may go first)."""

    async def _truncated(self, stream: str, offset: int) -> None:
        """The leader cut ``stream`` back to ``offset`` (the Follower's on_truncated)."""

    async def _retained(self, starts: dict[str, int]) -> None:
        """The leader's streams begin at ``starts`` now (its retention deleted what lay
        below; the Follower's on_retained)."""

    async def _durable(self, flushed: dict[str, int]) -> None:
        """Copied records became durable (the Follower's on_durable)."""

    async def _registered_members(self) -> frozenset[str]:
        """The ids of the group's members registered in etcd now (each on its lease)."""
        member = self.membership.member
        assert member is not None
        state = await read_group(member.etcd, self.config.group, self.config.prefix)
        return frozenset(info.member_id for info in state.members)

    # ------------------------------------------------------------------ acks

    async def wait_acknowledged(self, offset: int, *, stream: str) -> bool:
        """Whether the group acknowledged ``stream`` up to ``offset`` (``ack``: sync —
        the in-sync followers have it durable too; leader — at once). False as soon as
        this member may no longer lead at the epoch it led when called: a member that
        followed meanwhile may have cut and refilled those offsets."""
        if self.config.ack is AckMode.LEADER:
            return True
        epoch = self.membership.view.epoch
        while self.membership.may_lead() and self.membership.view.epoch == epoch:
            leader = self.leader
            if leader is None or leader.epoch != epoch or leader.stopped is not None:
                with trio.move_on_after(0.05):
                    await self.membership.wait_change()
                continue
            try:
                await leader.wait_acknowledged(stream, offset)
                return True
            except LeaderStopped:
                await trio.sleep(0.01)  # the role loop starts the next one, or demotes
        return False

    # ------------------------------------------------------------------ roles

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Lead or follow as the member's role says, until cancelled."""
        task_status.started()
        try:
            while True:
                membership = self.membership
                view = membership.view
                if membership.may_lead() and view.epoch is not None:
                    await self._lead(view.epoch)
                elif view.role is Role.FOLLOWER and view.leader and view.leader.replication:
                    await self._follow(view.leader.replication, view.epoch)
                else:
                    await membership.wait_change()
        finally:
            self.streams.close()
            self.history.close()

    async def _lead(self, epoch: int) -> None:
        member = self.membership.member
        assert member is not None and self.membership.in_sync is not None
        me = member.info.member_id
        persisted = self.membership.in_sync.members or frozenset()
        try:
            alive = await self._registered_members()
        except EtcdError as exc:
            log.warning("group %s: members not read at promotion: %s", self.config.group, exc)
            alive = persisted
        if not persisted <= alive | {me}:
            # A member with no key in etcd (its lease expired: the old leader, killed)
            # follows nobody: waiting replica_lag_ms for it would hold every ack of the
            # promotion. Out of the set, persisted before it counts, as any shrink.
            if not await member.set_in_sync((persisted & alive) | {me}):
                return
            log.info(
                "group %s: in-sync set is now %s (members no longer registered left it)",
                self.config.group,
                sorted((persisted & alive) | {me}),
            )
            persisted = (persisted & alive) | {me}
        self._before_leading()

        async def on_in_sync_change(followers: frozenset[str]) -> None:
            # Persisted before it counts for acks (a shrink), or before the follower
            # may campaign (a growth): the Leader awaits this first.
            if not await member.set_in_sync(followers | {me}):
                raise LeaderStopped(f"member {me} no longer leads: the in-sync set stays")
            log.info("group %s: in-sync set is now %s", self.config.group, sorted(followers | {me}))

        leader = Leader(
            self.streams,
            self.history,
            epoch,
            group=self.config.group,
            ack=str(self.config.ack),
            min_in_sync=self.config.min_in_sync,
            in_sync=persisted - {me},
            on_in_sync_change=on_in_sync_change,
            tls=self.tls,
            snapshots=self._snapshot_source(),
        )
        assert self._bound is not None, "a member of a group has a replication listener"
        host, port = self._bound
        try:
            # Before the member takes a write as leader (``_promoted`` lets intake in),
            # at the ends of its copies made durable: an old leader returning is cut
            # back to these starts.
            if self.history.last_epoch() < epoch:
                await trio.to_thread.run_sync(self.streams.flush_all)
            leader.begin_epoch()
        except LeaderFenced as fenced:
            log.warning("group %s: %s", self.config.group, fenced)
            await trio.sleep(RESTART_LEADER_S)
            return
        await self._promoted(epoch)
        group = self.config.group
        log.info("group %s: replication leader at epoch %d on port %d", group, epoch, port)
        async with trio.open_nursery() as nursery:
            await nursery.start(self._run_leader, leader, host, port)
            self.leader = leader
            nursery.start_soon(self._while_leading, leader)
            while self.membership.may_lead() and self.membership.view.epoch == epoch:
                if leader.stopped is not None:
                    break
                with trio.move_on_after(0.05):
                    await self.membership.wait_change()
            leader.stop()
            nursery.cancel_scope.cancel()
        self.leader = None
        if self.membership.may_lead():
            await trio.sleep(RESTART_LEADER_S)  # stopped on its own: not in a tight loop
        self._demoted(epoch)
        if isinstance(leader.stopped, LeaderFenced):
            # A member saw a newer epoch: this member's lease is going or gone; until
            # its role says so, acks wait (the Leader of this epoch is refused again).
            log.warning("group %s: %s", self.config.group, leader.stopped)

    async def _run_leader(
        self, leader: Leader, host: str, port: int, *, task_status: trio.TaskStatus[None]
    ) -> None:
        listeners, self._listeners = self._listeners, None
        try:
            await leader.run(host, port, listeners=listeners, task_status=task_status)
        except* (EtcdError, LeaderStopped) as failed:
            # The in-sync set could not be persisted: acks wait (they need a running
            # Leader) until a new one, started by ``run`` while this member leads,
            # persists it.
            log.warning(
                "group %s: replication leader stopped: %s", self.config.group, failed.exceptions[0]
            )
            leader.stop()

    async def _follow(self, address: str, epoch: int | None) -> None:
        member = self.membership.member
        assert member is not None
        await self._following()
        follower = Follower(
            self.streams,
            self.history,
            group=self.config.group,
            member=member.info.member_id,
            leader=parse_address(address),
            on_truncating=self._truncating,
            on_truncated=self._truncated,
            on_retained=self._retained,
            on_durable=self._durable,
            # A member follows with its own certificate, trusting the CA that signed
            # every member's (mutual TLS between members: docs/replication.md).
            tls=None if self.tls is None else member_client_tls(self.tls.config),
            snapshots=self._snapshot_receiver(),
            on_snapshot=self._snapshot_received,
            snapshots_installed=self.snapshots_installed,
        )
        self.follower = follower
        log.info("group %s: following %s at epoch %s", self.config.group, address, epoch)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(follower.run)
                view = self.membership.view
                while self.membership.view == view:
                    await self.membership.wait_change()
                nursery.cancel_scope.cancel()
        finally:
            self.follower = None
            for stream, offset in follower.acked.items():
                self.told_acked[stream] = max(offset, self.told_acked.get(stream, 0))
