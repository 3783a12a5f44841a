"""A delay group member's data path (docs/replication.md): as leader it serves its
message_log and dispatch_log to the followers and holds acks until the group has the
records; as follower it copies the leader's and replays message_log in follower mode
(deriving, deciding no tombstone). The embedded broker's streams join the set
(``broker``: delayd.server.broker_member), so that the broker moves with its delay
server: one Leader or Follower, one connection, one epoch for every log.

``GroupReplication`` is the member runner (delayd.replication.member) with the delay
server's hooks. The streams are the server's own open message_log (one object: the
leader reads what intake appends, the follower appends where the replayer reads); the
LogWriter's fsyncs call ``grew``. The dispatch_log buckets a leader sends through the
server's writer (``dispatch_files``, never past its durable end; its flushes call
``grew``); a follower copies into files of its own, closed again at a promotion so that
the writer opens the copies: a promoted member does not deliver again what the old
leader recorded delivered. A follower that lacks records the leader's retention deleted
is sent a snapshot of the leader's derived state (delayd.server.snapshot) and starts
again from it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable

import trio

from delayd.cluster.config import AckMode, ClusterConfig
from delayd.logs import layout
from delayd.logs.bucket_files import BucketFiles
from delayd.logs.buckets import bucket_name
from delayd.replay import Replayer
from delayd.replication import MESSAGE_LOG, DelayStreams, EpochHistory, Leader, dispatch_stream
from delayd.replication.member import MemberReplication
from delayd.replication.snapshot import SnapshotReceiver, SnapshotSource
from delayd.replication.streams import EMBEDDED_BROKER_PREFIX, JoinedStreams, StreamSet
from delayd.server.broker_member import ReplicatedBroker
from delayd.server.rebuild import RebuildNeeded
from delayd.server.snapshot import DelaySnapshots, SnapshotReceived
from delayd.serving.membership import Membership
from delayd.serving.tls import ServerTls
from storage.fs import REAL_FS, FileSystem
from storage.segmented_log import SegmentedLog

log = logging.getLogger(__name__)

ROUTES_RECHECK_S = 0.5  # how often a wait for route records looks at the in-sync set

FOLLOWER_POLL_S = 0.005  # how often a follower's replayer looks for copied records


class GroupReplication(MemberReplication):
    """See the module docstring. ``listeners``: the replication listener bound at
    start. ``broker``: the embedded broker as a member (its streams replicated with
    the delay server's, promoted before ``on_promoted``, following before the
    Follower starts); None: not replicated."""

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
        on_promoted: Callable[[int], Awaitable[object]] | None = None,
        on_demoted: Callable[[int], object] | None = None,
        on_following: Callable[[], Awaitable[object]] | None = None,
        tls: ServerTls | None = None,
        dispatch_files: Callable[[], BucketFiles] | None = None,
        on_leader_retained: Callable[[int], Awaitable[object]] | None = None,
        broker: ReplicatedBroker | None = None,
        snapshots_installed: int = 0,
    ) -> None:
        self.data_dir = data_dir
        self.on_promoted = on_promoted
        self.on_demoted = on_demoted
        self.on_following = on_following
        # Following: the leader's message_log now begins here (its retention deleted
        # what lay below); the server deletes the same (retention.trim_below_leader).
        self.on_leader_retained = on_leader_retained
        self.fs = fs
        self.replayer = replayer
        self._leader_poll_s = replayer.poll_interval_s  # intake notifies it, or the policy's
        # The server's dispatch_log writer of the moment: what a leader sends from.
        self.dispatch_files = dispatch_files
        self.delay_streams = DelayStreams(
            data_dir,
            message_log=message_log,
            fs=fs,
            with_dispatch_log=dispatch_files is not None,
        )
        self.broker = broker
        streams: StreamSet = self.delay_streams
        if broker is not None:
            streams = JoinedStreams(
                {"": self.delay_streams, EMBEDDED_BROKER_PREFIX: broker.streams}
            )
        super().__init__(
            streams,
            EpochHistory.open_in(data_dir, fs),
            membership,
            config,
            listeners,
            tls=tls,
        )
        if broker is not None:
            broker.join(self, EMBEDDED_BROKER_PREFIX)
        self.snapshots_installed = snapshots_installed
        self._snapshots: DelaySnapshots | None = None

    def stats(self) -> dict[str, int | str]:
        """STATS fields: how far the group acknowledged message_log and, on the
        leader, the in-sync followers and how far each known follower is behind: bytes,
        records (-1: it lacks records retention deleted) and ms."""
        out: dict[str, int | str] = {"replication.ack": str(self.config.ack)}
        leader, follower = self.leader, self.follower
        if leader is not None:
            out["replication.acked_offset_bytes"] = leader.tracker.acked.get(MESSAGE_LOG, 0)
            out["replication.in_sync_followers"] = len(leader.in_sync)
            for member, lag in sorted(leader.lag().items()):
                out[f"replication.lag_bytes/{member}"] = lag
            for member, records in sorted(leader.lag_records().items()):
                out[f"replication.lag_records/{member}"] = -1 if records is None else records
            for member, ms in sorted(leader.lag_ms().items()):
                out[f"replication.lag_ms/{member}"] = ms
        elif follower is not None:
            out["replication.acked_offset_bytes"] = follower.acked.get(MESSAGE_LOG, 0)
            out["replication.leader_epoch"] = follower.leader_epoch or 0
        return out

    def message_log_copied(self) -> int:
        """Leading: how far every in-sync member has message_log durable, what the
        leader's retention may delete below; 0 while no Leader runs."""
        leader = self.leader
        return 0 if leader is None else leader.copied_by_in_sync(MESSAGE_LOG)

    def buckets_retired(self, starts: list[int]) -> None:
        """The replay of a retirement is about to delete these buckets' files
        (retention's ``streams_retired``): a follower closes its dispatch_log copies
        and copies no more of them. A leader's streams shrink once the files are gone
        (``grew``: its Leader drops them from the in-sync reference)."""
        self.delay_streams.retire_dispatch([bucket_name(start) for start in starts])

    # ------------------------------------------------------------------ acks

    async def wait_dispatch_acknowledged(self, buckets: Iterable[int]) -> bool:
        """Whether the group acknowledged the dispatch_log ``buckets`` (start ms) up to
        what is durable here now (``wait_acknowledged``'s rules): the entries that
        decided a cancel or reschedule, made durable before, are then the group's.
        Only those buckets are looked at: no listing of the directory per request."""
        if self.config.ack is AckMode.LEADER or not self.delay_streams.with_dispatch_log:
            return True
        targets = {}
        for bucket_ms in sorted(buckets):
            name = dispatch_stream(bucket_name(bucket_ms))
            targets[name] = self.delay_streams.get(name).durable_offset
        for name, end in targets.items():
            if not await self.wait_acknowledged(end, stream=name):
                return False
        return True

    async def wait_routes_copied(self, buckets: Iterable[int]) -> bool:
        """``wait_dispatch_acknowledged`` for the sender's route records
        (docs/cluster.md, "A resend after a failover"), while the group has its
        ``min_in_sync`` in-sync followers: a leader left without them (its followers
        down or behind) goes on delivering, as it does to a broker group, rather than
        stop until one returns. The set is looked at again every ROUTES_RECHECK_S of
        the wait. False when this member may no longer lead."""
        buckets = list(buckets)
        while True:
            leader = self.leader
            if leader is None:
                return False
            if len(leader.in_sync) < self.config.min_in_sync:
                return True
            with trio.move_on_after(ROUTES_RECHECK_S):
                return await self.wait_dispatch_acknowledged(buckets)

    async def wait_acknowledged(self, offset: int, *, stream: str = MESSAGE_LOG) -> bool:
        return await super().wait_acknowledged(offset, stream=stream)

    # ------------------------------------------------------------------ roles

    def _before_leading(self) -> None:
        # The buckets copied as a follower are closed: the server's writer opens them.
        self.delay_streams.share_dispatch(self.dispatch_files)

    async def _promoted(self, epoch: int) -> None:
        # The embedded broker leads before delivery starts (on_promoted lets it).
        if self.broker is not None:
            self.broker.promoted()
        if self.on_promoted is not None:
            # What was copied as a follower is replayed before intake takes more.
            await self.on_promoted(epoch)
        self.replayer.poll_interval_s = self._leader_poll_s

    async def _while_leading(self, leader: Leader) -> None:
        if self.broker is not None:
            await self.broker.follow_high_watermark(leader)

    def _demoted(self, epoch: int) -> None:
        if self.on_demoted is not None:
            self.on_demoted(epoch)

    async def _following(self) -> None:
        # Copied records become durable in the follower's own flushes: the replayer
        # looks for them (notify comes from intake, which a follower has none of).
        # ``on_following`` puts the replayer in follower mode (it derives schedule_log,
        # the id index and known ids, and decides no tombstone); ``on_promoted`` has
        # the canceller decide them again before intake and delivery resume.
        if self.on_following is not None:
            # Delivery stopped and its dispatch_log files closed before any is copied;
            # the embedded broker takes no more sends after that.
            await self.on_following()
        if self.broker is not None:
            self.broker.following()
            if self.broker.predates_replication(self.history):
                log.warning(
                    "group %s: the epoch history predates the replication of the embedded "
                    "broker: its records are this member's own, cut before it follows",
                    self.config.group,
                )
                await self.broker.forget_own_records()
        self.delay_streams.share_dispatch(None)
        self.replayer.poll_interval_s = FOLLOWER_POLL_S
        self.replayer.notify(0)  # it may be waiting for intake, with no deadline

    def _snapshot_source(self) -> SnapshotSource | None:
        if self._snapshots is None:
            self._snapshots = DelaySnapshots(self.data_dir)
        return self._snapshots

    def _snapshot_receiver(self) -> SnapshotReceiver | None:
        return SnapshotReceiver(layout.received_snapshot_dir(self.data_dir), self.fs)

    async def _snapshot_received(self, manifest: dict) -> None:
        """Installed with nothing running, as a cut is (``delayd serve`` catches it)."""
        raise SnapshotReceived(self.data_dir, manifest)

    async def _retained(self, starts: dict[str, int]) -> None:
        if self.on_leader_retained is not None and MESSAGE_LOG in starts:
            await self.on_leader_retained(starts[MESSAGE_LOG])

    async def _truncating(self, stream: str, offset: int) -> None:
        """The leader is cutting ``stream`` back to ``offset``. A cut of message_log: the
        replayer may have read the records that go (even in a step not finished yet), so
        the member stops before the cut and starts again without its derived state, the
        simplest correct rebuild (``RebuildNeeded``: the derived state goes first)."""
        if stream == MESSAGE_LOG:
            raise RebuildNeeded(self.data_dir, offset)

    async def _truncated(self, stream: str, offset: int) -> None:
        """The embedded broker's stream was cut (its commitlog cut its derived state
        first, CommitlogStream): the broker catches up with it."""
        if self.broker is not None and stream.startswith(EMBEDDED_BROKER_PREFIX):
            await self.broker.truncated(stream, offset)

    async def _durable(self, flushed: dict[str, int]) -> None:
        if self.broker is not None:
            await self.broker.durable(flushed)
