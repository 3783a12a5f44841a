"""The follower's side of replication: pull the leader's streams by offset.

A follower connects to the leader's replication listener and says FOLLOW: its group,
its member id, the last epoch in its history and where each of its streams ends. The
leader answers TRUNCATE_TO; the follower

1. refuses a leader whose epoch is older than the last one in its history (it answers
   FENCED with the newer epoch and reconnects later: the role finds the new leader);
2. cuts each stream back to the offset given, durably: it awaits
   ``on_truncating(stream, offset)`` before each cut (the server may remove what it
   derived from the records that go first, or raise to make the cut itself with
   nothing running) and ``on_truncated(stream, offset)`` after it, so the server can
   rebuild what it derived from the cut records;
3. begins the leader's epoch in its history with its ends after the cut, when newer;

then (unless it lacks records retention deleted: a snapshot, below) appends every
RECORDS frame raw at the offset it names (the storage checks every
CRC and that the offset is the stream's end, so a copy is byte-identical or refused),
makes them durable in group commits (one flush in a worker thread covers every record
that arrived meanwhile), reports DURABLE after each and then awaits
``on_durable(flushed)``, where the server derives what it derives from the new durable
records (as a restart's recovery would). A broken connection, a refused
frame or a stale leader ends the session; ``run`` reconnects with exponential backoff.

A follower whose streams end below where the leader's begin (RETAINED says so) cannot
catch up by copying. Without a ``snapshots`` receiver it refuses to go on
(FollowRefused); with one it waits for the leader's SNAPSHOT, writes its files
(``SnapshotReceiver``: all or nothing, durably), then awaits ``on_snapshot(manifest)``,
where the server installs it (a delay member stops and starts again from it), and the
session ends.

With a ``ClientTls`` the follower connects over TLS: it verifies the leader's
certificate and, for mutual TLS, presents its own. A refused handshake (either side's
refusal) is a TlsError, logged as a warning, and the follower keeps retrying with the
same backoff: rotating a certificate (and SIGHUP on the leader) is what fixes it, and
the follower reads its own files again at every connection, so it sees a rotation of
them too.
"""

from __future__ import annotations

import dataclasses
import logging
import ssl
from collections.abc import Awaitable, Callable

import trio

from delayd.errors import ConnectionClosedError, DelaydError
from delayd.replication import wire
from delayd.replication.connection import receive_event
from delayd.replication.epochs import EpochHistory
from delayd.replication.snapshot import SnapshotError, SnapshotReceiver
from delayd.replication.streams import Stream, StreamSet
from delayd.tls import ClientTls, ServerTlsConfig, TlsError, handshake_failure
from storage.errors import RawAppendRefused

log = logging.getLogger(__name__)

MIN_BACKOFF_MS = 50
MAX_BACKOFF_MS = 2000
HANDSHAKE_TIMEOUT_S = 10.0

# Why a session ended, as ``failures`` counts it (a bounded metric label).
FAILURE_REASONS = ("tls", "refused", "network", "protocol")

OnTruncated = Callable[[str, int], Awaitable[object]]
OnDurable = Callable[[dict[str, int]], Awaitable[object]]
OnRetained = Callable[[dict[str, int]], Awaitable[object]]
OnSnapshot = Callable[[dict], Awaitable[object]]


def member_client_tls(config: ServerTlsConfig) -> ClientTls:
    """What a member of a group whose listeners serve ``config`` (``[tls]``) uses to
    follow: it presents its own certificate (which mutual TLS on the leader asks for)
    and trusts the client CA, the one that signed every member's certificate (the
    system's trust store when none is set)."""
    return ClientTls(config.client_ca_file, config.cert_file, config.key_file)


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
        on_truncating: OnTruncated | None = None,
        on_durable: OnDurable | None = None,
        on_retained: OnRetained | None = None,
        min_backoff_ms: int = MIN_BACKOFF_MS,
        max_backoff_ms: int = MAX_BACKOFF_MS,
        tls: ClientTls | None = None,
        snapshots: SnapshotReceiver | None = None,
        on_snapshot: OnSnapshot | None = None,
        snapshots_installed: int = 0,
    ) -> None:
        self.streams = streams
        self.history = history
        self.group = group
        self.member = member
        self.leader = leader
        self.on_truncated = on_truncated
        self.on_truncating = on_truncating
        self.on_durable = on_durable
        self.on_retained = on_retained
        self.leader_starts: dict[str, int] = {}  # where the leader's streams begin
        self.min_backoff_ms = min_backoff_ms
        self.max_backoff_ms = max_backoff_ms
        self.tls = tls
        self.acked: dict[str, int] = {}  # the group's acknowledged offsets, as last told
        self.leader_epoch: int | None = None
        self.sessions = 0  # sessions that got as far as TRUNCATE_TO
        self.last_error: BaseException | None = None
        self.connections = 0  # attempts to connect to the leader
        self.failures = dict.fromkeys(FAILURE_REASONS, 0)  # sessions ended by an error
        self.received_bytes = 0  # record bytes copied from the leader
        self.snapshots = snapshots
        self.on_snapshot = on_snapshot
        self.snapshots_received = 0  # whole and durable, handed to on_snapshot
        self.snapshots_installed = snapshots_installed  # as the server says (metrics)
        self._lacking = False  # RETAINED said this member lacks deleted records
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
            except* SESSION_ERRORS as failed:
                self._failed(failed.exceptions[0])
            if self.sessions > sessions:
                backoff_ms = self.min_backoff_ms
            await trio.sleep(backoff_ms / 1000)
            backoff_ms = min(backoff_ms * 2, self.max_backoff_ms)

    def _failed(self, error: BaseException) -> None:
        self.last_error = error
        reason = _failure_reason(error)
        self.failures[reason] += 1
        # A refused certificate needs an operator (it fails the same way until a
        # rotation); a broken connection is routine during a failover.
        level = logging.WARNING if reason == "tls" else logging.INFO
        log.log(
            level,
            "member %s of group %s: following %s:%d ended: %s",
            self.member,
            self.group,
            *self.leader,
            error,
        )

    async def follow_once(self) -> None:
        """One session: connect, FOLLOW, truncate, then copy until the connection
        ends (returns) or a frame is refused (raises FollowRefused; TlsError for a
        refused TLS handshake)."""
        self._appended = trio.Event()
        self._dirty = {}
        self.connections += 1
        host, port = self.leader
        stream = await self._connect()
        async with stream:
            decoder = wire.WireDecoder()
            # What a broken session left unsynced is made durable first: the ends
            # FOLLOW reports are then durable, and the leader counts them as such.
            await trio.to_thread.run_sync(self.streams.flush_all)
            follow = wire.Follow(
                self.group, self.member, self.history.last_epoch(), self.streams.ends()
            )
            try:
                await stream.send_all(wire.encode(follow))
                answer = await receive_event(stream, decoder)
            except trio.BrokenResourceError as exc:
                # Under TLS 1.3 a leader's refusal of this member's certificate
                # arrives as the first read fails, after the handshake ended.
                raise self._refusal(exc) from None
            if answer is None:
                tls = "" if self.tls is not None else ", and does it serve TLS (ClientTls)"
                raise ConnectionClosedError(
                    f"the leader at {host}:{port} closed the connection before answering "
                    f"FOLLOW: does it lead group {self.group}{tls}?"
                )
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

    async def _connect(self) -> trio.abc.Stream:
        """A connection to the leader, with the TLS handshake done when ``tls`` is
        set. Raises OSError, TlsError (a file or a certificate refused), or
        FollowRefused when the handshake does not end in time."""
        host, port = self.leader
        if self.tls is None:
            return await trio.open_tcp_stream(host, port)
        # A copy reads the files again: a rotated certificate is used from now on.
        context = dataclasses.replace(self.tls).ssl_context
        tcp = await trio.open_tcp_stream(host, port)
        # https_compatible: a leader's close without close_notify is EOF (delayd.tls).
        secure = trio.SSLStream(
            tcp, context, server_hostname=self.tls.server_name or host, https_compatible=True
        )
        try:
            with trio.fail_after(HANDSHAKE_TIMEOUT_S):
                await secure.do_handshake()
        except trio.TooSlowError:
            await tcp.aclose()
            raise FollowRefused(
                f"no TLS handshake with {host}:{port} within {HANDSHAKE_TIMEOUT_S:g} s"
            ) from None
        except trio.BrokenResourceError as exc:
            await tcp.aclose()
            raise self._refusal(exc) from None
        return secure

    def _refusal(self, exc: trio.BrokenResourceError) -> Exception:
        """What a broken connection means: a TlsError saying who refused what when
        TLS failed under it, else the broken connection itself."""
        cause = exc.__cause__
        if self.tls is not None and isinstance(cause, ssl.SSLError):
            return handshake_failure(cause, "{}:{}".format(*self.leader))
        return exc

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
                if self.on_truncating is not None:
                    await self.on_truncating(name, offset)
                stream.truncate(offset)
                if self.on_truncated is not None:
                    await self.on_truncated(name, offset)

    async def _copy(self, stream: trio.abc.Stream, decoder: wire.WireDecoder, epoch: int) -> None:
        self._lacking = False
        while True:
            event = await receive_event(stream, decoder)
            if event is None:
                return
            if isinstance(event, wire.Fenced):
                raise FollowRefused(f"the leader says epoch {event.epoch} exists: it is fenced")
            if isinstance(event, wire.Retained):
                await self._retained(event.starts)
                continue
            if isinstance(event, wire.Snapshot) and self._lacking:
                await self._receive_snapshot(stream, decoder, event, epoch)
                return
            if not isinstance(event, wire.Records):
                raise FollowRefused(f"the leader sent {type(event).__name__} after TRUNCATE_TO")
            if event.epoch != epoch:
                raise FollowRefused(
                    f"RECORDS of epoch {event.epoch} on a session of epoch {epoch}: refused"
                )
            self.acked.update(event.acked)
            if not self.streams.copies(event.stream):
                continue  # deleted here by the leader's word: it deletes it too
            target = self.streams.get(event.stream)
            try:
                target.append_raw(event.offset, event.data)
            except RawAppendRefused as exc:
                # Not the bytes or not the offset this copy needs: a new session starts
                # again from FOLLOW. Any other storage error is this member's disk's and
                # stops it (a failed fsync must not be retried).
                raise FollowRefused(f"{event.stream}: {exc}") from exc
            self.received_bytes += len(event.data)
            self._dirty[event.stream] = target
            self._appended.set()

    async def _retained(self, starts: dict[str, int]) -> None:
        """The leader's streams now begin at ``starts``: refuse to go on when this
        member lacks records below one (retention deleted them on the leader: copying
        cannot bring them back), else let the server delete what the leader did."""
        self.leader_starts = dict(starts)
        lacking = []
        for name, start in sorted(starts.items()):
            held = self.streams.find(name)
            end = 0 if held is None else held.end_offset
            if end < start:
                lacking.append(f"{name} ends at {end} here, the leader's begins at {start}")
        if lacking and self.snapshots is not None:
            log.warning(
                "member %s of group %s lacks records the leader deleted (%s): waiting for "
                "a snapshot of the leader's state",
                self.member,
                self.group,
                "; ".join(lacking),
            )
            self._lacking = True
            return
        if lacking:
            host, port = self.leader
            raise FollowRefused(
                f"member {self.member} lacks records the leader at {host}:{port} deleted "
                f"({'; '.join(lacking)}): retention deleted them, so it cannot catch up "
                'by copying (docs/replication.md, "Retention in a group")'
            )
        if self.on_retained is not None:
            await self.on_retained(starts)

    async def _receive_snapshot(
        self,
        stream: trio.abc.Stream,
        decoder: wire.WireDecoder,
        begin: wire.Snapshot,
        epoch: int,
    ) -> None:
        """Write the snapshot ``begin`` announces, chunk by chunk, until SNAPSHOT_END;
        then it is whole and durable and ``on_snapshot`` installs it. Any other frame,
        or a chunk out of place, ends the session (what was written is discarded by
        the next snapshot or the next start)."""
        receiver = self.snapshots
        assert receiver is not None
        started = trio.current_time()
        try:
            await trio.to_thread.run_sync(receiver.begin, begin.manifest)
            files, size = len(receiver.files), sum(f.size for f in receiver.files)
            log.info(
                "member %s of group %s: receiving a snapshot: %d file(s), %d bytes",
                self.member,
                self.group,
                files,
                size,
            )
            while True:
                event = await receive_event(stream, decoder)
                if event is None:
                    raise ConnectionClosedError("the leader hung up in the middle of a snapshot")
                if isinstance(event, wire.SnapshotEnd | wire.SnapshotChunk) and (
                    event.epoch != epoch
                ):
                    raise FollowRefused(f"a snapshot frame of epoch {event.epoch}, not {epoch}")
                if isinstance(event, wire.SnapshotEnd):
                    break
                if not isinstance(event, wire.SnapshotChunk):
                    raise FollowRefused(f"the leader sent {type(event).__name__} in a snapshot")
                await trio.to_thread.run_sync(receiver.write, event.file, event.offset, event.data)
                self.received_bytes += len(event.data)
            manifest = await trio.to_thread.run_sync(receiver.finish)
        except SnapshotError as exc:
            raise FollowRefused(f"snapshot refused: {exc}") from exc
        finally:
            receiver.close()
        self.snapshots_received += 1
        log.info(
            "member %s of group %s: snapshot received: %d file(s), %d bytes in %.2f s",
            self.member,
            self.group,
            files,
            size,
            trio.current_time() - started,
        )
        if self.on_snapshot is not None:
            await self.on_snapshot(manifest)

    async def _commit(self, stream: trio.abc.Stream) -> None:
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


# What ends a session and is retried after a backoff; anything else (a disk error)
# stops the follower.
SESSION_ERRORS = (
    OSError,
    trio.BrokenResourceError,
    ConnectionClosedError,
    TlsError,
    wire.WireError,
    FollowRefused,
)


def _failure_reason(error: BaseException) -> str:
    if isinstance(error, TlsError):
        return "tls"
    if isinstance(error, FollowRefused):
        return "refused"
    if isinstance(error, wire.WireError):
        return "protocol"
    return "network"


def _flush_all(streams: dict[str, Stream]) -> dict[str, int]:
    return {name: stream.flush() for name, stream in streams.items()}
