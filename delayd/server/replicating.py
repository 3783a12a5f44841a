"""A delay group member's data path (docs/replication.md): as leader it serves its
message_log and dispatch_log to the followers and holds acks until the group has the
records; as follower it copies the leader's and replays message_log in follower mode
(deriving, deciding no tombstone).

``GroupReplication.run`` follows the member's role: at each promotion a ``Leader`` at
the member's epoch on the replication listener, at each demotion (or when the leader
changes) a ``Follower`` of the leader named in etcd's leader key. The streams are the
server's own open message_log (one object: the leader reads what intake appends, the
follower appends where the replayer reads); the LogWriter's fsyncs call ``grew``. The
dispatch_log buckets a leader sends through the server's writer (``dispatch_files``,
never past its durable end; its flushes call ``grew``); a follower copies into files of
its own, closed again at a promotion so that the writer opens the copies: a promoted
member does not deliver again what the old leader recorded delivered.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from delayd.address import parse_address
from delayd.cluster.config import AckMode, ClusterConfig
from delayd.cluster.members import Role
from delayd.errors import EtcdError
from delayd.logs.bucket_files import BucketFiles
from delayd.replay import Replayer
from delayd.replication import (
    MESSAGE_LOG,
    DelayStreams,
    EpochHistory,
    Follower,
    Leader,
    LeaderFenced,
    LeaderStopped,
)
from delayd.replication.follower import member_client_tls
from delayd.server.rebuild import RebuildNeeded
from delayd.serving.membership import Membership
from delayd.serving.tls import ServerTls
from storage.fs import REAL_FS, FileSystem
from storage.segmented_log import SegmentedLog

log = logging.getLogger(__name__)

FOLLOWER_POLL_S = 0.005  # how often a follower's replayer looks for copied records
RESTART_LEADER_S = 0.1  # before a Leader that stopped while the member leads is replaced


class GroupReplication:
    """See the module docstring. ``listeners``: the replication listener bound at
    start (served by the first Leader; later ones bind its port again)."""

    def __init__(
        self,
        data_dir: str,
        message_log: SegmentedLog,
        replayer: Replayer,
        membership: Membership,
        config: ClusterConfig,
        listeners: list[trio.SocketListener] | None,
        *,
        fs: FileSystem = REAL_FS,
        on_promoted: Callable[[], Awaitable[object]] | None = None,
        on_demoted: Callable[[], object] | None = None,
        on_following: Callable[[], Awaitable[object]] | None = None,
        tls: ServerTls | None = None,
        dispatch_files: Callable[[], BucketFiles] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.tls = tls  # the server's listeners' TLS: the replication listener's too
        self.on_promoted = on_promoted
        self.on_demoted = on_demoted
        self.on_following = on_following
        self.fs = fs
        self.replayer = replayer
        self._leader_poll_s = replayer.poll_interval_s  # intake notifies it, or the policy's
        self.membership = membership
        self.config = config
        # The server's dispatch_log writer of the moment: what a leader sends from.
        self.dispatch_files = dispatch_files
        self.streams = DelayStreams(
            data_dir,
            message_log=message_log,
            fs=fs,
            with_dispatch_log=dispatch_files is not None,
        )
        self.history = EpochHistory.open_in(data_dir, fs)
        self.leader: Leader | None = None
        self.follower: Follower | None = None
        self._listeners = listeners
        # Where the replication listener is bound: a leader after the first binds again.
        self._bound: tuple[str, int] | None = None
        if listeners:
            self._bound = listeners[0].socket.getsockname()[:2]

    def grew(self) -> None:
        """message_log grew or became durable (the LogWriter's ``on_durable``)."""
        self.streams.grew()

    def stats(self) -> dict[str, int | str]:
        """STATS fields: how far the group acknowledged message_log and, on the
        leader, the in-sync followers and the bytes each connected follower lacks."""
        out: dict[str, int | str] = {"replication.ack": str(self.config.ack)}
        leader, follower = self.leader, self.follower
        if leader is not None:
            out["replication.acked_offset_bytes"] = leader.tracker.acked.get(MESSAGE_LOG, 0)
            out["replication.in_sync_followers"] = len(leader.in_sync)
            for member, lag in sorted(leader.lag().items()):
                out[f"replication.lag_bytes/{member}"] = lag
        elif follower is not None:
            out["replication.acked_offset_bytes"] = follower.acked.get(MESSAGE_LOG, 0)
            out["replication.leader_epoch"] = follower.leader_epoch or 0
        return out

    # ------------------------------------------------------------------ acks

    async def wait_dispatch_acknowledged(self) -> bool:
        """Whether the group acknowledged every dispatch_log bucket up to what is
        durable here now (``wait_acknowledged``'s rules): a cancel's or reschedule's
        entry, made durable before, is then the group's."""
        if self.config.ack is AckMode.LEADER or not self.streams.with_dispatch_log:
            return True
        targets = {
            name: end for name, end in self.streams.durable_ends().items() if name != MESSAGE_LOG
        }
        for name, end in targets.items():
            if not await self.wait_acknowledged(end, stream=name):
                return False
        return True

    async def wait_acknowledged(self, offset: int, *, stream: str = MESSAGE_LOG) -> bool:
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
        if self.history.last_epoch() < epoch:
            # The epoch begins where the copies end, durable, before the promotion
            # appends anything (the take-over's dispatch_log entries, delivery,
            # intake): an old leader returning is cut back to these starts, so a start
            # past this member's own first writes would leave that old leader's tail
            # in place.
            await trio.to_thread.run_sync(self.streams.flush_all)
            self.history.begin(epoch, self.streams.ends())
        # The buckets copied as a follower are closed: the server's writer opens them.
        self.streams.share_dispatch(self.dispatch_files)

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
        )
        assert self._bound is not None, "a member of a group has a replication listener"
        host, port = self._bound
        if self.on_promoted is not None:
            # What was copied as a follower is replayed before intake takes more.
            await self.on_promoted()
        self.replayer.poll_interval_s = self._leader_poll_s
        group = self.config.group
        log.info("group %s: replication leader at epoch %d on port %d", group, epoch, port)
        async with trio.open_nursery() as nursery:
            await nursery.start(self._run_leader, leader, host, port)
            self.leader = leader
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
        if self.on_demoted is not None:
            self.on_demoted()
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
        # Copied records become durable in the follower's own flushes: the replayer
        # looks for them (notify comes from intake, which a follower has none of).
        # ``on_following`` puts the replayer in follower mode (it derives schedule_log,
        # the id index and known ids, and decides no tombstone); ``on_promoted`` has
        # the canceller decide them again before intake and delivery resume.
        if self.on_following is not None:
            # Delivery stopped and its dispatch_log files closed before any is copied.
            await self.on_following()
        self.streams.share_dispatch(None)
        self.replayer.poll_interval_s = FOLLOWER_POLL_S
        self.replayer.notify(0)  # it may be waiting for intake, with no deadline
        follower = Follower(
            self.streams,
            self.history,
            group=self.config.group,
            member=member.info.member_id,
            leader=parse_address(address),
            on_truncated=self._truncated,
            # A member follows with its own certificate, trusting the CA that signed
            # every member's (mutual TLS between members: docs/replication.md).
            tls=None if self.tls is None else member_client_tls(self.tls.config),
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

    async def _truncated(self, stream: str, offset: int) -> None:
        """The leader cut ``stream`` back to ``offset``. A cut of message_log: the
        replayer may have read the cut records (even in a step not finished yet), so the
        member starts again without its derived state, the simplest correct rebuild."""
        if stream == MESSAGE_LOG:
            raise RebuildNeeded(self.data_dir, offset)
