"""A broker as a member of a replicated group: its streams, its ReplicationGate, its
role hooks (docs/replication.md, "Broker groups").

``ReplicatedBroker`` joins an open Broker to a member runner (delayd.replication.member):
its commitlog and committed-offsets generations become streams of the runner's set
(under a prefix: ``broker/`` beside a delay server's streams, none in a standalone
broker group), its appenders signal the runner's growth, and it is the broker's gate —
store acks and commits wait for ``wait_acknowledged``, and the high watermark follows
the Leader's acknowledged commitlog offset. ``BrokerGroupReplication`` is the runner of
a standalone ``delayd broker`` group.

The high watermark of a newly promoted member starts where its old leader last told
it the group acknowledged the commitlog (``told_acked``), or, told nothing since its
process started, where its acked checkpoint says (delayd.broker.acked_checkpoint), not
at the commitlog it holds: a record copied to this member only may still be cut (a
later leader that lacks it), so the records past it stay hidden from consumers
(``hold_unacknowledged``) until the new Leader's in-sync followers have them too
(Kafka's rule).
"""

from __future__ import annotations

import contextlib

import trio

from delayd.broker.acked_checkpoint import AckedCheckpoint, acked_checkpoint_path
from delayd.broker.broker import Broker
from delayd.broker.replica import BrokerReplica, broker_epoch_history_path
from delayd.cluster.config import ClusterConfig
from delayd.replication import COMMITLOG, EpochHistory, Leader, LeaderStopped
from delayd.replication.member import MemberReplication
from delayd.replication.streams import BrokerStreams, offsets_stream
from delayd.serving.membership import Membership
from delayd.serving.tls import ServerTls


class ReplicatedBroker:
    """See the module docstring; implements delayd.broker.gate.ReplicationGate."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.replica = BrokerReplica(broker)
        self.streams = BrokerStreams(self.replica.commitlog, broker.offsets)
        # What consumers may see: the commitlog offset the group acknowledged.
        self.high_watermark = 0
        self.acked_checkpoint = AckedCheckpoint(acked_checkpoint_path(broker.store.directory))
        self._member: MemberReplication | None = None
        self._prefix = ""

    def join(self, member: MemberReplication, prefix: str) -> None:
        """Replicate with ``member``, this broker's streams named ``prefix`` + their
        own names in its set; from now on the broker's acks wait for its group."""
        self._member = member
        self._prefix = prefix
        self.replica.signal_growth(member.grew)
        self.broker.attach_gate(self)

    # ------------------------------------------------------------------ the gate

    def commitlog_acked(self) -> int:
        return self.high_watermark

    async def wait_commitlog(self, offset: int) -> bool:
        assert self._member is not None
        stream = self._prefix + COMMITLOG
        if not await self._member.wait_acknowledged(offset, stream=stream):
            return False
        # Acknowledged means visible: the broker's reput goes this far at once, not when
        # follow_high_watermark next runs.
        self.high_watermark = max(self.high_watermark, offset)
        return True

    async def wait_offsets(self, generation: int, offset: int) -> bool:
        assert self._member is not None
        while True:
            stream = self._prefix + offsets_stream(generation)
            try:
                return await self._member.wait_acknowledged(offset, stream=stream)
            except ValueError:
                # Compacted away meanwhile: the newer generation's snapshot holds it.
                generation, offset = self.broker.offsets.position()

    # ------------------------------------------------------------------ roles

    def promoted(self) -> None:
        """The member leads: derive what was copied, take sends and commits; consumers
        see what the group acknowledged as far as this member was told (module
        docstring), the rest once ``follow_high_watermark`` moves past it."""
        assert self._member is not None
        self.replica.promote()
        store = self.broker.store
        durable = store.commitlog.durable_offset
        told = self._member.told_acked.get(self._prefix + COMMITLOG)
        if told is None:
            told = self.acked_checkpoint.read()  # told nothing since the process started
        if told is None:
            # Never told at all: a member whose commitlog predates its group, all its own.
            self.high_watermark = max(self.high_watermark, durable)
        else:
            self.high_watermark = min(max(self.high_watermark, told), durable)
            store.hold_unacknowledged(self.high_watermark)
        self.broker.high_watermark_moved()

    async def follow_high_watermark(self, leader: Leader) -> None:
        """While ``leader`` serves: move the high watermark as the group acknowledges
        the commitlog (which wakes the PULLs held on the records it uncovers)."""
        stream = self._prefix + COMMITLOG
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._keep_acked_checkpoint)
            with contextlib.suppress(LeaderStopped):
                while True:
                    acked = await leader.wait_acknowledged_past(stream, self.high_watermark)
                    self.high_watermark = acked
                    self.broker.high_watermark_moved()
            nursery.cancel_scope.cancel()

    async def _keep_acked_checkpoint(self) -> None:
        """Save the high watermark now and then, off the path that moves it."""
        while True:
            await self.acked_checkpoint.save(self.high_watermark)
            await trio.sleep(self.acked_checkpoint.interval_s)

    def following(self) -> None:
        """Sends and commits refused; replication writes the streams."""
        self.replica.follow()

    def predates_replication(self, history: EpochHistory) -> bool:
        """Whether ``history`` was written before this broker's streams were replicated
        with it (its last entry, written when the member last began an epoch, does not
        name the commitlog): what the broker holds then is its own — delivered into it
        while the member led on its own — not a copy of any leader's."""
        if not history.entries:
            return False
        return self._prefix + COMMITLOG not in history.entries[-1].starts

    async def forget_own_records(self) -> None:
        """Cut every stream of this broker to nothing, durably, with what it derived:
        a member whose history predates the broker's replication follows with nothing
        of its own (no offset of it is the leader's: copying after it would mix two
        brokers' records). A member that leads instead keeps its records: from its
        first epoch they are the group's."""
        for name in self.streams.names():
            stream = self.streams.get(name)
            if stream.end_offset > 0:
                stream.truncate(0)
                await self.truncated(self._prefix + name, 0)

    async def truncated(self, stream: str, offset: int) -> None:
        if stream == self._prefix + COMMITLOG:
            # CommitlogStream cut the derived state with it.
            self.high_watermark = min(self.high_watermark, offset)
        else:
            await self.replica.on_truncated(stream, offset)

    async def durable(self, flushed: dict[str, int]) -> None:
        if any(name.startswith(self._prefix) for name in flushed):
            await self.replica.on_durable(flushed)
        follower = None if self._member is None else self._member.follower
        told = None if follower is None else follower.acked.get(self._prefix + COMMITLOG)
        if told is not None:
            await self.acked_checkpoint.save(told)


class BrokerGroupReplication(MemberReplication):
    """A standalone broker group's member (``delayd broker --etcd --group``): the
    member runner over the broker's own streams and epoch history
    (``<data>/broker/replication/epochs``)."""

    def __init__(
        self,
        broker: ReplicatedBroker,
        data_dir: str,
        membership: Membership,
        config: ClusterConfig,
        listeners: list[trio.SocketListener] | None,
        *,
        tls: ServerTls | None = None,
    ) -> None:
        history = EpochHistory.open(broker_epoch_history_path(data_dir))
        super().__init__(broker.streams, history, membership, config, listeners, tls=tls)
        self.broker = broker
        broker.join(self, "")

    async def _promoted(self, epoch: int) -> None:
        self.broker.promoted()

    async def _while_leading(self, leader: Leader) -> None:
        await self.broker.follow_high_watermark(leader)

    async def _following(self) -> None:
        self.broker.following()

    async def _truncated(self, stream: str, offset: int) -> None:
        await self.broker.truncated(stream, offset)

    async def _durable(self, flushed: dict[str, int]) -> None:
        await self.broker.durable(flushed)
