"""The follower's side of replication: pull the leader's streams by offset.

A follower connects to the leader's replication listener and says FOLLOW: its group,
its member id, the last epoch in its history and where each of its streams ends. The
leader answers TRUNCATE_TO; the follower

1. refuses a leader whose epoch is older than the last one in its history (it answers
   FENCED with the newer epoch and reconnects later: the role finds the new leader);
2. cuts each stream back to the offset given, durably, and awaits
   ``on_truncated(stream, offset)`` for each stream it cut, so the server can rebuild
   what it derived from the cut records (simplest: drop derived state and replay);
3. begins the leader's epoch in its history with its ends after the cut, when newer;

then appends every RECORDS frame raw at the offset it names (the storage checks every
CRC and that the offset is the stream's end, so a copy is byte-identical or refused),
makes them durable in group commits (one flush in a worker thread covers every record
that arrived meanwhile), reports DURABLE after each and then awaits
``on_durable(flushed)``, where the server derives what it derives from the new durable
records (as a restart's recovery would). A broken connection, a refused
frame or a stale leader ends the session; ``run`` reconnects with exponential backoff.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from delayd.errors import DelaydError
from delayd.replication import wire
from delayd.replication.connection import receive_event
from delayd.replication.epochs import EpochHistory
from delayd.replication.streams import Stream, StreamSet
from storage.errors import RawAppendRefused

log = logging.getLogger(__name__)

MIN_BACKOFF_MS = 50
MAX_BACKOFF_MS = 2000

OnTruncated = Callable[[str, int], Awaitable[object]]
OnDurable = Callable[[dict[str, int]], Awaitable[object]]


class FollowRefused(DelaydError):
    """This session with the leader ended for a reason the follower found (a stale
    epoch, an out-of-order frame); it reconnects after a backoff."""


class Follower:
    """Follows the leader at ``leader`` ((host, port) of its replication listener)."""

    def __init__(
        self,
        streams: StreamSet,
        history: EpochHistory,
        *,
        group: str,
        member: str,
        leader: tuple[str, int],
        on_truncated: OnTruncated | None = None,
        on_durable: OnDurable | None = None,
        min_backoff_ms: int = MIN_BACKOFF_MS,
        max_backoff_ms: int = MAX_BACKOFF_MS,
    ) -> None:
        self.streams = streams
        self.history = history
        self.group = group
        self.member = member
        self.leader = leader
        self.on_truncated = on_truncated
        self.on_durable = on_durable
        self.min_backoff_ms = min_backoff_ms
        self.max_backoff_ms = max_backoff_ms
        self.acked: dict[str, int] = {}  # the group's acknowledged offsets, as last told
        self.leader_epoch: int | None = None
        self.sessions = 0  # sessions that got as far as TRUNCATE_TO
        self.last_error: BaseException | None = None
        self._appended = trio.Event()
        self._dirty: dict[str, Stream] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """wire.Follow until cancelled, reconnecting after every failure with a backoff
        that doubles from min_backoff_ms to max_backoff_ms (reset by a session that
        reached TRUNCATE_TO)."""
        task_status.started()
        backoff_ms = self.min_backoff_ms
        while True:
            sessions = self.sessions
            try:
                await self.follow_once()
            except* (OSError, trio.BrokenResourceError, wire.WireError, FollowRefused) as failed:
                self.last_error = failed.exceptions[0]
                log.info(
                    "member %s of group %s: following %s:%d ended: %s",
                    self.member,
                    self.group,
                    *self.leader,
                    self.last_error,
                )
            if self.sessions > sessions:
                backoff_ms = self.min_backoff_ms
            await trio.sleep(backoff_ms / 1000)
            backoff_ms = min(backoff_ms * 2, self.max_backoff_ms)

    async def follow_once(self) -> None:
        """One session: connect, FOLLOW, truncate, then copy until the connection
        ends (returns) or a frame is refused (raises FollowRefused)."""
        host, port = self.leader
        self._appended = trio.Event()
        self._dirty = {}
        stream = await trio.open_tcp_stream(host, port)
        async with stream:
            decoder = wire.WireDecoder()
            # What a broken session left unsynced is made durable first: the ends
            # FOLLOW reports are then durable, and the leader counts them as such.
            await trio.to_thread.run_sync(self.streams.flush_all)
            follow = wire.Follow(
                self.group, self.member, self.history.last_epoch(), self.streams.ends()
            )
            await stream.send_all(wire.encode(follow))
            answer = await receive_event(stream, decoder)
            if answer is None:
                return
            if isinstance(answer, wire.Fenced):
                raise FollowRefused(
                    f"the leader at {host}:{port} is fenced by epoch {answer.epoch}"
                )
            if not isinstance(answer, wire.TruncateTo):
                raise FollowRefused(f"the leader answered FOLLOW with {type(answer).__name__}")
            if answer.epoch < self.history.last_epoch():
                await stream.send_all(wire.encode(wire.Fenced(self.history.last_epoch())))
                raise FollowRefused(
                    f"the leader at {host}:{port} leads epoch {answer.epoch}, older than "
                    f"epoch {self.history.last_epoch()} this member has seen: refused"
                )
            await self._truncate(answer.offsets)
            if answer.epoch > self.history.last_epoch():
                self.history.begin(answer.epoch, self.streams.ends())
            self.leader_epoch = answer.epoch
            self.sessions += 1
            durable = self.streams.durable_ends()
            if self.on_durable is not None:
                # What an earlier session left durable but not yet derived.
                await self.on_durable(durable)
            await stream.send_all(wire.encode(wire.Durable(durable)))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._commit, stream)
                await self._copy(stream, decoder, answer.epoch)
                nursery.cancel_scope.cancel()

    async def _truncate(self, offsets: dict[str, int]) -> None:
        for name, offset in offsets.items():
            stream = self.streams.get(name)
            if offset < stream.end_offset:
                log.warning(
                    "member %s of group %s: %s cut back from %d to %d (records the group "
                    "never acknowledged)",
                    self.member,
                    self.group,
                    name,
                    stream.end_offset,
                    offset,
                )
                stream.truncate(offset)
                if self.on_truncated is not None:
                    await self.on_truncated(name, offset)

    async def _copy(self, stream: trio.SocketStream, decoder: wire.WireDecoder, epoch: int) -> None:
        while True:
            event = await receive_event(stream, decoder)
            if event is None:
                return
            if isinstance(event, wire.Fenced):
                raise FollowRefused(f"the leader says epoch {event.epoch} exists: it is fenced")
            if not isinstance(event, wire.Records):
                raise FollowRefused(f"the leader sent {type(event).__name__} after TRUNCATE_TO")
            if event.epoch != epoch:
                raise FollowRefused(
                    f"RECORDS of epoch {event.epoch} on a session of epoch {epoch}: refused"
                )
            target = self.streams.get(event.stream)
            try:
                target.append_raw(event.offset, event.data)
            except RawAppendRefused as exc:
                # Not the bytes or not the offset this copy needs: a new session starts
                # again from FOLLOW. Any other storage error is this member's disk's and
                # stops it (a failed fsync must not be retried).
                raise FollowRefused(f"{event.stream}: {exc}") from exc
            self.acked.update(event.acked)
            self._dirty[event.stream] = target
            self._appended.set()

    async def _commit(self, stream: trio.SocketStream) -> None:
        """Group commit: flush every stream that grew since the last flush, in a worker
        thread, then say DURABLE; records arriving meanwhile wait for the next one."""
        while True:
            await self._appended.wait()
            self._appended = trio.Event()
            dirty, self._dirty = self._dirty, {}
            flushed = await trio.to_thread.run_sync(_flush_all, dirty)
            await stream.send_all(wire.encode(wire.Durable(flushed)))
            if self.on_durable is not None:
                await self.on_durable(flushed)


def _flush_all(streams: dict[str, Stream]) -> dict[str, int]:
    return {name: stream.flush() for name, stream in streams.items()}
