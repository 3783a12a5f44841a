"""The leader's side of replication: serve followers, track them, acknowledge.

Each follower connects to the leader's replication listener and sends FOLLOW with the
epoch it last followed and where its streams end. The leader answers TRUNCATE_TO — for
each of the follower's streams, the least of its end and the end of that epoch in the
leader's history (``EpochHistory.end_of``; everything, for a follower with no history)
— then RECORDS from there, and then every append as it happens: a task per follower
waits on the streams' growth signal, so there is no polling delay (RocketMQ's
HAConnection, QMQ's sync). The follower answers DURABLE as its group commits end.

``wait_acknowledged(stream, offset)`` is what an ack waits on. With ``ack = "sync"`` it
returns once the leader and every follower of the in-sync set have ``offset`` durable,
and the set has at least ``min_in_sync`` followers (delayd.replication.in_sync). Before
the set changes, ``on_in_sync_change(new_set)`` is awaited (the role persists it in
etcd there): a follower stops counting for acks only once the group knows it may no
longer campaign. If the hook raises, ``run`` raises it: a leader that cannot keep the
group's record of the set true must stop. With ``ack = "leader"`` it returns at once;
``lag()`` is what a failover could lose.

A follower whose streams end below where the leader's begin (retention deleted the
records between) cannot catch up by copying: with a ``SnapshotSource`` the leader sends
it a snapshot instead (SNAPSHOT, SNAPSHOT_CHUNK..., SNAPSHOT_END; delayd.replication.
snapshot), waits for it to close the connection, and the follower installs it and
follows again from there; without one it is refused, and said so.

A leader that meets a newer epoch (a follower that followed one, or says FENCED) stops:
every waiter gets LeaderFenced, and ``run`` returns.

With a ``ServerTls`` (the one the server's other listeners share, so SIGHUP reloads it
here too) every connection does its TLS handshake in its own task within
FOLLOW_TIMEOUT_S; under mutual TLS a follower must present a certificate of the client
CA. A refused handshake is logged by ServerTls and counted in ``refused_handshakes``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterable

import trio

from delayd.errors import DelaydError
from delayd.replication import wire
from delayd.replication.connection import receive_event
from delayd.replication.epochs import EpochHistory
from delayd.replication.in_sync import InSyncTracker
from delayd.replication.lag import GrowthClock, RecordCounter
from delayd.replication.snapshot import Snapshot, SnapshotError, SnapshotSource, read_chunk
from delayd.replication.streams import StreamSet
from delayd.serving.listeners import bound_addresses, open_listeners
from delayd.serving.tls import ServerTls

log = logging.getLogger(__name__)

ACK_SYNC = "sync"
ACK_LEADER = "leader"
DEFAULT_REPLICA_LAG_MS = 1000
DEFAULT_MIN_IN_SYNC = 1
CHUNK_BYTES = 1 << 20  # raw bytes per RECORDS frame (one record may exceed it)
LACKING_LOG_INTERVAL_MS = 60_000  # a follower that lacks deleted records is said this often
FOLLOW_TIMEOUT_S = 10.0  # a connection must end its TLS handshake, then say FOLLOW, within this
SNAPSHOT_CLOSE_TIMEOUT_S = 60.0  # a follower has this long to install a snapshot and hang up

OnInSyncChange = Callable[[frozenset[str]], Awaitable[object]]


class LeaderStopped(DelaydError):
    """The leader no longer acknowledges: it was stopped or fenced."""


class LeaderFenced(LeaderStopped):
    """A newer epoch exists: this leader must stop acting as one."""

    def __init__(self, epoch: int, newer: int) -> None:
        self.epoch = epoch
        self.newer = newer
        super().__init__(
            f"leader of epoch {epoch} is fenced: a member has seen epoch {newer}; it "
            "stops acknowledging and must follow the new leader"
        )


def _now_ms() -> int:
    return int(trio.current_time() * 1000)


class Leader:
    """Serves the streams of ``streams`` to followers at ``epoch``.

    ``await nursery.start(leader.run, host, port)`` binds the listener (port 0: a free
    one, see ``addresses``), begins the epoch in ``history`` (when not begun yet) and
    serves until cancelled or fenced. Appenders must call ``streams.grew()`` after
    every append and every flush, as intake notifies the replayer. ``in_sync``: the
    set the group persisted when this leader took over (InSyncTracker.start).
    """

    def __init__(
        self,
        streams: StreamSet,
        history: EpochHistory,
        epoch: int,
        *,
        group: str,
        ack: str = ACK_SYNC,
        replica_lag_ms: int = DEFAULT_REPLICA_LAG_MS,
        min_in_sync: int = DEFAULT_MIN_IN_SYNC,
        in_sync: frozenset[str] = frozenset(),
        on_in_sync_change: OnInSyncChange | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        tls: ServerTls | None = None,
        snapshots: SnapshotSource | None = None,
    ) -> None:
        if ack not in (ACK_SYNC, ACK_LEADER):
            raise ValueError(f"ack must be {ACK_SYNC!r} or {ACK_LEADER!r}, got {ack!r}")
        self.streams = streams
        self.history = history
        self.epoch = epoch
        self.group = group
        self.ack = ack
        self.on_in_sync_change = on_in_sync_change
        self.chunk_bytes = chunk_bytes
        self.tls = tls
        self.snapshots = snapshots  # None: a follower that lacks deleted records is refused
        self.snapshots_sent = 0
        self.tracker = InSyncTracker(replica_lag_ms, min_in_sync, streams.ends())
        self._initial_in_sync = in_sync
        self.addresses: list[tuple[str, int]] = []
        self.connected: set[str] = set()
        self.in_sync_changes = 0
        self.refused_handshakes = 0
        self.sent_bytes = 0
        # Followers that lack records retention deleted here: stream -> their end.
        self.lacking: dict[str, dict[str, int]] = {}
        self._lacking_logged_ms: dict[str, int] = {}
        # When the leader's streams reached each end, and the records between two
        # offsets: each follower's lag in time and in records (delayd.replication.lag).
        self.growth = GrowthClock()
        self.record_counter = RecordCounter()
        self._known_ends = streams.ends()
        # Two wake-ups: the ack waiters' (an acknowledged offset moved, the streams or
        # the in-sync set changed, the leader stopped) and the in-sync task's (what
        # could change the set sooner than it plans to look again). Most growth is an
        # append no ack can follow yet, and most reports come from followers already
        # in the set: both sleep through them (_notice).
        self._progress = trio.Event()
        self._tracked = trio.Event()
        self._in_sync_due_ms: int | None = None  # when the in-sync task looks again
        self._published: dict[str, int] = {}  # the acknowledged offsets waiters last saw
        self._stopped: LeaderStopped | None = None
        self._connections: dict[str, trio.CancelScope] = {}
        self._cancel: trio.CancelScope | None = None

    # ------------------------------------------------------------------ acks

    async def wait_acknowledged(self, stream: str, offset: int) -> None:
        """Return once ``stream`` is acknowledged up to ``offset`` (module docstring).
        Raises LeaderStopped (LeaderFenced) when the leader stops first."""
        while True:
            self._check_running()
            if self.ack == ACK_LEADER:
                return
            progress = self._progress
            if self.acknowledged(stream) >= offset:
                return
            await progress.wait()

    async def wait_acknowledged_past(self, stream: str, offset: int) -> int:
        """Return ``stream``'s acknowledged offset once it is past ``offset`` (the
        leader's durable end with ``ack = "leader"``): what a broker's high watermark
        follows. Raises LeaderStopped (LeaderFenced) when the leader stops first."""
        while True:
            self._check_running()
            progress = self._progress
            if self.ack == ACK_LEADER:
                acked = self.streams.get(stream).durable_offset
            else:
                acked = self.acknowledged(stream)
            if acked > offset:
                return acked
            await progress.wait()

    def acknowledged(self, stream: str) -> int:
        """The acknowledged offset of ``stream`` now (sync rule)."""
        durable = self.streams.get(stream).durable_offset
        return self.tracker.acknowledged(stream, durable)

    @property
    def in_sync(self) -> frozenset[str]:
        """The followers the ack rule counts now."""
        return self.tracker.members

    def lag(self) -> dict[str, int]:
        """Bytes of the leader's streams each known follower lacks durable: the window
        a failover to it could lose under ``ack = "leader"``."""
        ends = self.streams.ends()
        return {member: self.tracker.lag_bytes(member, ends) for member in self.tracker.durable}

    def lag_ms(self) -> dict[str, int]:
        """How long ago the leader had what each known follower has durable: the age of
        the oldest record it lacks, over every stream (0 when it lacks none)."""
        now = _now_ms()
        names = self.streams.names()
        return {
            member: max(
                (self.growth.lag_ms(name, durable.get(name, 0), now) for name in names),
                default=0,
            )
            for member, durable in self.tracker.durable.items()
        }

    def lag_records(self) -> dict[str, int | None]:
        """How many records of the leader's streams each known follower lacks durable
        (END_OF_SEGMENT markers not counted; estimated from the average record size
        where the bytes to walk exceed ``record_counter.budget_bytes``); None for a
        follower that lacks records the leader no longer holds (retention deleted
        them)."""
        out: dict[str, int | None] = {}
        asked: set[tuple[str, str]] = set()
        ends = self.streams.ends()
        for member, durable in self.tracker.durable.items():
            total: int | None = 0
            for name, end in ends.items():
                stream = self.streams.find(name)
                if stream is None or total is None:
                    continue
                start = min(durable.get(name, 0), end)
                asked.add((member, name))
                try:
                    total += self.record_counter.between((member, name), stream, start, end)
                except ValueError:
                    total = None
            out[member] = total
        self.record_counter.keep_only(asked)
        return out

    def deleted_lag(self) -> dict[str, int]:
        """Bytes each follower of ``lacking`` lacks below where the leader's streams
        now begin: what retention deleted before it copied them."""
        starts = self.streams.starts()
        return {
            member: sum(max(0, starts.get(name, 0) - end) for name, end in ends.items())
            for member, ends in self.lacking.items()
        }

    def copied_by_in_sync(self, stream: str) -> int:
        """How far the leader and every follower of the in-sync set have ``stream``
        durable (no ``min_in_sync`` rule): what retention may delete below, so that no
        member that may take over lacks a record the leader deleted."""
        offset = self.streams.get(stream).durable_offset
        for member in self.tracker.members:
            offset = min(offset, self.tracker.durable.get(member, {}).get(stream, 0))
        return offset

    def acknowledged_offsets(self) -> dict[str, int]:
        """Every stream's acknowledged offset now: the leader's durable end with
        ``ack = "leader"``, the sync rule's otherwise."""
        if self.ack == ACK_LEADER:
            return self.streams.durable_ends()
        return {name: self.acknowledged(name) for name in self.streams.names()}

    def stop(self) -> None:
        """Stop acknowledging and serving (waiters get LeaderStopped)."""
        self._halt(LeaderStopped(f"the leader of group {self.group} was stopped"))

    @property
    def stopped(self) -> LeaderStopped | None:
        """Why the leader stopped (LeaderFenced when fenced); None while it serves."""
        return self._stopped

    def _check_running(self) -> None:
        if self._stopped is not None:
            raise self._stopped

    def _halt(self, error: LeaderStopped) -> None:
        if self._stopped is None:
            self._stopped = error
            log.warning("replication leader of group %s stops: %s", self.group, error)
        self._wake()
        if self._cancel is not None:
            self._cancel.cancel()

    def _fenced_by(self, newer: int) -> None:
        self._halt(LeaderFenced(self.epoch, newer))

    def _wake(self) -> None:
        self._progress.set()
        self._progress = trio.Event()
        self._tracked.set()
        self._tracked = trio.Event()

    def _notice(
        self, names: Iterable[str], *, reported_by: str | None = None, streams_changed: bool = False
    ) -> None:
        """The leader's streams ``names`` grew, or the follower ``reported_by``
        reported them durable. The ack waiters wake only when one of their
        acknowledged offsets moved (or a stream appeared or went). The in-sync task
        wakes only when the set may change before it looks again: a report of a
        follower outside the set (it may join), or growth while it planned no look
        (a follower with nothing to copy may now fall behind); a report of a member
        only puts its departure off, and growth while a look is planned lacks
        nothing older than what planned it. A stream that appeared or went may
        change anyone's standing: it wakes both."""
        if (
            streams_changed
            or (reported_by is None and self._in_sync_due_ms is None)
            or (reported_by is not None and reported_by not in self.tracker.members)
        ):
            self._tracked.set()
            self._tracked = trio.Event()
        moved = streams_changed
        for name in names:
            if name not in self._known_ends:
                continue  # a follower's stream this leader does not hold: no ack of it
            stream = self.streams.find(name)
            if stream is None:
                moved = True  # gone: a waiter on it must move to its successor
                continue
            durable = stream.durable_offset
            acked = durable if self.ack == ACK_LEADER else self.tracker.acknowledged(name, durable)
            if self._published.get(name) != acked:
                self._published[name] = acked
                moved = True
        if moved:
            self._progress.set()
            self._progress = trio.Event()

    # ------------------------------------------------------------------ serving

    def begin_epoch(self) -> None:
        """Record in the epoch history where this leader's epoch begins: the streams'
        ends now (once; later calls do nothing). Call it before the member takes any
        write as leader: an old leader that returns is cut back to these offsets, so a
        record of this epoch below them would be cut in the middle, or kept on one disk
        only. Raises LeaderFenced when the history holds a newer epoch."""
        if self.history.last_epoch() > self.epoch:
            raise LeaderFenced(self.epoch, self.history.last_epoch())
        if self.history.last_epoch() < self.epoch:
            self.history.begin(self.epoch, self.streams.ends())

    async def run(
        self,
        host: str,
        port: int,
        *,
        listeners: list[trio.SocketListener] | None = None,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind (or serve ``listeners``, bound already: then closed when it returns),
        begin the epoch (``begin_epoch``), serve followers; until cancelled, stopped or
        fenced."""
        self.begin_epoch()
        self.tracker.start(self._initial_in_sync, _now_ms())
        if listeners is None:
            listeners = await open_listeners("replication", host, port)
        self.addresses = bound_addresses(listeners)
        with trio.CancelScope() as self._cancel:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_growth)
                nursery.start_soon(self._maintain_in_sync)
                await nursery.start(trio.serve_listeners, self._serve_one, listeners)
                task_status.started()
        self._cancel = None
        if self._stopped is None:
            self._stopped = LeaderStopped(f"the leader of group {self.group} stopped serving")
            self._wake()

    async def _watch_growth(self) -> None:
        while True:
            seen = self.streams.version
            ends = self.streams.ends()
            now = _now_ms()
            for name, end in ends.items():
                self.growth.grew(name, end, now)
                if end != self._known_ends.get(name, 0):
                    self.tracker.leader_grew(name, end, now)
            removed = self._known_ends.keys() - ends.keys()
            for name in removed:
                self.tracker.leader_removed(name)  # compacted away: nobody needs it
                self.growth.removed(name)
            streams_changed = bool(removed) or ends.keys() != self._known_ends.keys()
            self._known_ends = ends
            self._notice(ends, streams_changed=streams_changed)
            await self.streams.wait_growth(seen)

    async def _maintain_in_sync(self) -> None:
        tracker = self.tracker
        while True:
            tracked = self._tracked
            now = _now_ms()
            proposed = tracker.proposed(now)
            if proposed != tracker.members:
                log.info(
                    "group %s epoch %d: in-sync followers %s -> %s",
                    self.group,
                    self.epoch,
                    sorted(tracker.members),
                    sorted(proposed),
                )
                if self.on_in_sync_change is not None:
                    await self.on_in_sync_change(proposed)
                tracker.apply(proposed)
                self.in_sync_changes += 1
                self._wake()
                continue
            due_ms = tracker.next_change_ms(now)
            self._in_sync_due_ms = due_ms
            with trio.move_on_at(math.inf if due_ms is None else due_ms / 1000):
                await tracked.wait()
            self._in_sync_due_ms = None

    async def _serve_one(self, tcp: trio.SocketStream) -> None:
        decoder = wire.WireDecoder()
        try:
            async with tcp:
                deadline = trio.current_time() + FOLLOW_TIMEOUT_S
                stream: trio.abc.Stream = tcp
                if self.tls is not None:
                    secure = await self.tls.accept(tcp, FOLLOW_TIMEOUT_S)
                    if secure is None:
                        self.refused_handshakes += 1
                        return
                    stream = secure
                with trio.move_on_at(deadline):
                    follow = await receive_event(stream, decoder)
                if not isinstance(follow, wire.Follow):
                    log.warning("replication: a connection did not start with FOLLOW; closed")
                    return
                await self._follower_session(stream, decoder, follow)
        except* (trio.BrokenResourceError, trio.ClosedResourceError, wire.WireError) as ended:
            log.info("replication connection of group %s ended: %s", self.group, ended.exceptions)

    async def _follower_session(
        self, stream: trio.abc.Stream, decoder: wire.WireDecoder, follow: wire.Follow
    ) -> None:
        if follow.group != self.group:
            log.warning(
                "replication: member %s follows group %s, this leader leads %s; closed",
                follow.member,
                follow.group,
                self.group,
            )
            return
        if follow.last_epoch > self.epoch:
            await stream.send_all(wire.encode(wire.Fenced(follow.last_epoch)))
            self._fenced_by(follow.last_epoch)
            return
        previous = self._connections.pop(follow.member, None)
        if previous is not None:
            previous.cancel()  # the member reconnected: its old connection is dead
        targets = self._truncation(follow)
        positions = {name: targets.get(name, 0) for name in self.streams.names()}
        positions.update(targets)
        await self._out_of_the_set_if_it_lost_records(follow, positions)
        await stream.send_all(wire.encode(wire.TruncateTo(self.epoch, targets)))
        starts = self.streams.starts()
        await stream.send_all(wire.encode(wire.Retained(starts)))
        if self._lacks_deleted(follow.member, positions, starts):
            if self.snapshots is not None:
                await self._send_snapshot(stream, decoder, follow.member)
            return  # without a snapshot the follower refuses to go on at RETAINED
        self.lacking.pop(follow.member, None)
        self.tracker.follower_reset(follow.member, positions)
        self._wake()
        with trio.CancelScope() as scope:
            self._connections[follow.member] = scope
            self.connected.add(follow.member)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._receive_reports, stream, decoder, follow.member)
                    await self._send_records(stream, positions, follow.member)
                    # It lacks records deleted meanwhile: the session ends, and the
                    # follower's next FOLLOW gets a snapshot (or is refused).
                    nursery.cancel_scope.cancel()
            finally:
                if self._connections.get(follow.member) is scope:
                    del self._connections[follow.member]
                    self.connected.discard(follow.member)

    async def _out_of_the_set_if_it_lost_records(
        self, follow: wire.Follow, positions: dict[str, int]
    ) -> None:
        """A member of the in-sync set that comes back with less than the set counts on
        (its disk wiped: no epoch history; or streams shorter than it reported durable)
        leaves the set, persisted, before it hears TRUNCATE_TO: once truncated it begins
        an epoch in its history, and a member with a history that the group lists in
        sync may campaign — it would lead with a partial copy."""
        member = follow.member
        known = self.tracker.durable.get(member, {})
        lost = follow.last_epoch == 0 or any(
            end < known.get(name, 0) for name, end in positions.items()
        )
        if member not in self.tracker.members or not lost:
            return
        self.tracker.follower_reset(member, positions)
        if member in self.tracker.proposed(_now_ms()):
            return  # it lacks nothing the set counts on
        log.warning(
            "group %s: member %s came back with less than it had (%s): it leaves the "
            "in-sync set before it may follow",
            self.group,
            member,
            "no epoch history" if follow.last_epoch == 0 else "shorter streams",
        )
        self._wake()  # _maintain_in_sync persists and applies the smaller set
        while member in self.tracker.members:  # a stopping leader cancels this wait
            progress = self._progress
            await progress.wait()

    def _lacks_deleted(
        self, member: str, positions: dict[str, int], starts: dict[str, int]
    ) -> bool:
        """Whether ``member``, whose streams end at ``positions``, lacks records the
        leader no longer holds (retention deleted them): it cannot catch up by copying.
        Said once per member and minute, and kept in ``lacking``."""
        lacking = {name: positions.get(name, 0) for name, start in starts.items()}
        lacking = {name: end for name, end in lacking.items() if end < starts[name]}
        if not lacking:
            return False
        self.lacking[member] = lacking
        now = _now_ms()
        if now - self._lacking_logged_ms.get(member, -LACKING_LOG_INTERVAL_MS) >= (
            LACKING_LOG_INTERVAL_MS
        ):
            self._lacking_logged_ms[member] = now
            log.warning(
                "group %s: member %s cannot follow: %s; retention deleted the records "
                "between here, so it cannot catch up by copying (docs/replication.md, "
                '"Retention in a group")%s',
                self.group,
                member,
                ", ".join(
                    f"its {name} ends at {end}, this leader's begins at {starts[name]}"
                    for name, end in sorted(lacking.items())
                ),
                "" if self.snapshots is None else ": it gets a snapshot",
            )
        return True

    async def _send_snapshot(
        self, stream: trio.abc.Stream, decoder: wire.WireDecoder, member: str
    ) -> None:
        """Ship a snapshot to ``member`` (it lacks records retention deleted), then wait
        until it hangs up: closing first would reset a connection whose DURABLE reports
        are unread, and the follower could lose the end of the snapshot."""
        assert self.snapshots is not None
        started = trio.current_time()
        try:
            snapshot = await trio.to_thread.run_sync(self.snapshots.take)
        except (SnapshotError, OSError) as exc:
            log.warning("group %s: no snapshot for member %s: %s", self.group, member, exc)
            return
        try:
            log.info(
                "group %s: sending member %s a snapshot: %d file(s), %d bytes, %s",
                self.group,
                member,
                len(snapshot.files),
                snapshot.size,
                snapshot.meta,
            )
            await stream.send_all(wire.encode(wire.Snapshot(self.epoch, snapshot.manifest())))
            await self._send_snapshot_files(stream, snapshot)
            await stream.send_all(wire.encode(wire.SnapshotEnd(self.epoch)))
        except (SnapshotError, OSError) as exc:
            log.warning("group %s: snapshot for member %s failed: %s", self.group, member, exc)
            return
        finally:
            await trio.to_thread.run_sync(snapshot.release)
        self.snapshots_sent += 1
        log.info(
            "group %s: snapshot sent to member %s: %d file(s), %d bytes in %.2f s",
            self.group,
            member,
            len(snapshot.files),
            snapshot.size,
            trio.current_time() - started,
        )
        with trio.move_on_after(SNAPSHOT_CLOSE_TIMEOUT_S):
            while await receive_event(stream, decoder) is not None:
                pass

    async def _send_snapshot_files(self, stream: trio.abc.Stream, snapshot: Snapshot) -> None:
        for index, file in enumerate(snapshot.files):
            offset = 0
            while offset < file.size:
                size = min(self.chunk_bytes, file.size - offset)
                data = await trio.to_thread.run_sync(read_chunk, file.path, offset, size)
                chunk = wire.SnapshotChunk(self.epoch, index, offset, data)
                await stream.send_all(wire.encode(chunk))
                offset += size
                self.sent_bytes += size

    def _truncation(self, follow: wire.Follow) -> dict[str, int]:
        """Where each of the follower's streams must be cut back to (module docstring)."""
        if follow.last_epoch == 0:
            # No history: nothing the follower holds is known to be the group's.
            return dict.fromkeys(follow.ends, 0)
        ends = self.history.end_of(follow.last_epoch)
        if ends is None:
            ends = self.streams.ends()
        return {name: min(end, ends.get(name, 0)) for name, end in follow.ends.items()}

    async def _send_records(
        self, stream: trio.abc.Stream, positions: dict[str, int], member: str
    ) -> None:
        sent_acked: dict[str, int] = {}
        sent_starts = self.streams.starts()  # sent after TRUNCATE_TO
        while self._stopped is None:
            seen = self.streams.version
            starts = self.streams.starts()
            if starts != sent_starts:
                await stream.send_all(wire.encode(wire.Retained(starts)))
                sent_starts = starts
                if self._lacks_deleted(member, positions, starts):
                    return  # deleted under a follower out of the in-sync set
            sent = False
            for name in self.streams.names():
                source = self.streams.find(name)  # gone since listed: nothing to send
                position = positions.get(name, 0)
                if source is None or position >= source.end_offset:
                    continue
                try:
                    data = source.read_raw(position, self.chunk_bytes)
                except ValueError:
                    # Deleted meanwhile (retention runs in a worker thread).
                    starts = self.streams.starts()
                    if not self._lacks_deleted(member, positions, starts):
                        raise
                    await stream.send_all(wire.encode(wire.Retained(starts)))
                    return
                acked = self._acked_changes(sent_acked)
                await stream.send_all(
                    wire.encode(wire.Records(self.epoch, name, position, data, acked))
                )
                positions[name] = position + len(data)
                self.sent_bytes += len(data)
                sent = True
            if not sent:
                await self.streams.wait_growth(seen)

    def _acked_changes(self, sent: dict[str, int]) -> dict[str, int]:
        changed = {
            name: offset for name, offset in self.tracker.acked.items() if sent.get(name) != offset
        }
        sent.update(changed)
        return changed

    async def _receive_reports(
        self, stream: trio.abc.Stream, decoder: wire.WireDecoder, member: str
    ) -> None:
        while True:
            event = await receive_event(stream, decoder)
            if event is None:
                raise trio.BrokenResourceError(f"follower {member} closed the connection")
            if isinstance(event, wire.Durable):
                self.tracker.follower_durable(member, event.offsets)
                self._notice(event.offsets, reported_by=member)
            elif isinstance(event, wire.Fenced):
                self._fenced_by(event.epoch)
                return
            else:
                raise wire.WireError(f"follower {member} sent {type(event).__name__}, not DURABLE")
