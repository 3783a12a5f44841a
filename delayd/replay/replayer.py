"""The replayer: tails message_log and files each record into its schedule_log bucket.

As QMQ's MessageLogReplayer it reads message_log from a persisted position and appends
each record to the schedule_log segment of its due time (ScheduleLog.locateSegment),
offering each appended record to a hook (QMQ's iterateCallback, which the wheel uses for
canAdd). Unlike QMQ it is exactly-once across crashes: it reads only what message_log
has made durable, writes its checkpoint only after the bucket files it covers are
fsynced, and on restart cuts what a crashed run appended past its checkpoint
(delayd.replay.recovery, docs/replay.md).

Cancel and reschedule tombstones (delayd.logs.tombstone) are replayed in the same
order: a step holds either messages or tombstones, never both, so a tombstone is handed
to ``on_tombstones`` after every message before it is in schedule_log and in the id
index, and before any message after it (docs/cancel.md).

The replayer notes the offset of every tombstone it passes (``tombstones``,
delayd.replay.tombstone_index; ``scan_tombstones`` finds those below where it began),
so that a take-over reads those records only.

Bucket retirements (delayd.logs.retirement) are replayed in order too, in steps of
their own: the replayer deletes the bucket's files (through ``on_retire`` when the
server has descriptors of them to close first), so every member of a group deletes a
bucket at the same message_log position. It first writes a checkpoint at the
retirement, with the bucket closed: no checkpoint a restart or a snapshot can still
read then lies before a record that needs the bucket, or names its length
(delayd.server.snapshot relies on it).

Without ``on_tombstones`` (a follower of a group, offline tools) the replayer derives
what tombstones put in schedule_log and the id index itself (``derive_tombstones``) and
writes nothing to dispatch_log: the leader's decisions arrive in its dispatch_log. The
leader's canceller appends the same copies at the same places (delayd.logs.moves), so
every member's bucket files are byte-identical.

The work is synchronous (``replay_available``, ``checkpoint``) so that tests can drive
it step by step on the crash simulator; ``run`` is the trio task of the server.

A full disk pauses it, never stops it: a step whose append a bucket file refuses
(DiskFullError) is cut back whole — the buckets it had already written are truncated
to where they were — and tried again after a back-off, as is a checkpoint that found no
space; ``refusals`` reports the pause. Replay only copies what message_log holds, so
nothing acknowledged waits on it but delivery.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from typing import TypeVar

import trio

from delayd.logs import layout, message_log, moves, retirement, schedule_log, tombstone
from delayd.logs.bucket_files import BucketFiles
from delayd.logs.buckets import bucket_name, bucket_of, bucket_width_ms
from delayd.logs.dispatch_log import EntryKind, find_entry
from delayd.logs.id_index import IdIndex, Location, scheduled_id
from delayd.logs.known_ids import KnownIds
from delayd.nowait_acquire import holding
from delayd.replay.recovery import RecoveryReport
from delayd.replay.state import ReplayCheckpoint, write_replay_checkpoint
from delayd.replay.tombstone_index import (
    TombstoneIndex,
    TombstoneRecord,
    read_tombstones_at,
    scan_offsets,
)
from delayd.write_refusals import CHECKPOINT, SCHEDULE_LOG, WriteRefusals
from storage.errors import DiskFullError, StorageError
from storage.framing import HEADER_SIZE
from storage.fs import FileSystem
from storage.scan import Record
from storage.segmented_log import SegmentedLog

OnScheduled = Callable[[int, list[int], list[int]], object]
"""``on_scheduled(bucket_start_ms, offsets_in_bucket, dues_ms)``: records just appended
to the bucket, in order, with their due times; once per bucket per append."""

OnTombstones = Callable[["Replayer", list[TombstoneRecord]], Awaitable[object]]
"""``await on_tombstones(replayer, records)``: consecutive tombstones, in log order,
under the append lock; reschedules write their copies with ``replayer.append_copy``."""
BeforeCheckpoint = Callable[[], Awaitable[object]]
OnRetire = Callable[[list[int]], Awaitable[object]]
"""``await on_retire(bucket_starts)``: delete the files of these buckets
(``retirement.delete_bucket_files``), closing every descriptor the server holds of them
first; under the append lock, the replayer's own descriptors closed already."""
T = TypeVar("T")


_Entry = tuple[int, int, bytes, int, int, bytes, int]
"""A message_log record on its way to schedule_log: (offset, record type, payload,
next offset, and for a MESSAGE its due_ms, message id bytes and receive_ms — what intake
already knew when it offered the record, or what one unpack of the head gives)."""


@dataclass(frozen=True, slots=True)
class _Group:
    """One bucket's records in a replay step, in message_log order."""

    payloads: list[bytes] = field(default_factory=list)  # schedule payloads
    dues: list[int] = field(default_factory=list)  # for the hook
    ids: list[bytes] = field(default_factory=list)  # for the id index
    receive_ms: list[int] = field(default_factory=list)  # dates the id index entries


@dataclass(frozen=True, slots=True)
class _Step:
    """Records read from message_log for one replay step, not appended yet."""

    groups: dict[int, _Group]  # by bucket start ms
    position: int  # message_log offset after the last record
    last_sequence: int
    count: int
    tombstones: list[TombstoneRecord] = field(default_factory=list)  # or these, only
    retirements: list[retirement.Retirement] = field(default_factory=list)  # or these


DEFAULT_BATCH_RECORDS = 4096  # records per step before yielding to other tasks
DEFAULT_MAX_TAIL_BYTES = 64 * 1024 * 1024  # offered records kept in memory (see offer)
DEFAULT_CHECKPOINT_INTERVAL_S = 1.0  # a checkpoint costs an fsync per touched bucket + 2
DISK_FULL_RETRY_S = (0.05, 1.0)  # first and longest wait before a refused step runs again


def _entries(records: Iterable[Record]) -> Iterator[_Entry]:
    """Records read back from message_log as entries (one unpack of a MESSAGE's head)."""
    identity_of = message_log.identity_of
    message_type = message_log.TYPE_MESSAGE
    for offset, rtype, payload, next_offset in records:
        if rtype != message_type:  # a tombstone or a retirement
            yield offset, rtype, payload, next_offset, 0, b"", 0
            continue
        due_ms, message_id, receive_ms = identity_of(payload)
        yield offset, rtype, payload, next_offset, due_ms, message_id, receive_ms


class Replayer:
    """Copies message_log records into schedule_log; see the module docstring.

    Built by ``delayd.replay.open_replayer``, which runs recovery first. Attributes for
    metrics: ``lag_bytes``, ``lag_records``, ``position``, ``checkpointed_position``,
    ``replayed_total``, ``checkpoints``.
    """

    def __init__(
        self,
        log: SegmentedLog,
        buckets: BucketFiles,
        *,
        fs: FileSystem,
        data_dir: str,
        segment_scale: int,
        checkpoint: ReplayCheckpoint,
        recovery: RecoveryReport,
        on_scheduled: OnScheduled | None = None,
        index: IdIndex | None = None,
        batch_records: int = DEFAULT_BATCH_RECORDS,
        checkpoint_interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S,
        poll_interval_s: float | None = None,
        max_tail_bytes: int = DEFAULT_MAX_TAIL_BYTES,
    ) -> None:
        self.log = log
        self.buckets = buckets
        self.fs = fs
        self.data_dir = data_dir
        self.segment_scale = segment_scale
        self.recovery = recovery
        self.on_scheduled: OnScheduled | None = on_scheduled
        # Without a handler (a follower, offline tools) derive_tombstones replays them;
        # a leader sets both hooks (delayd.server.delivery).
        self.on_tombstones: OnTombstones | None = None
        self.before_checkpoint: BeforeCheckpoint | None = None
        # Without it a retirement deletes the bucket's files here (offline tools, a
        # server without retention); the server's retention sets it.
        self.on_retire: OnRetire | None = None
        self.index = index
        # Set by the server (idempotent intake): told which accepted ids the index
        # answers for once they are put.
        self.known: KnownIds | None = None
        self.batch_records = batch_records
        self.checkpoint_interval_s = checkpoint_interval_s
        # None: rely on notify() alone (sync flush: intake notifies after each fsync).
        # With the async flush policy message_log becomes durable in the background, so
        # the replayer also looks every poll_interval_s.
        self.poll_interval_s = poll_interval_s
        self._position = checkpoint.position
        self._checkpointed = checkpoint.position
        self._replayed_sequence = checkpoint.next_sequence - 1
        self._head_sequence = recovery.next_sequence - 1
        self.max_tail_bytes = max_tail_bytes
        self._tail: deque[_Entry] = deque()
        self._carry: _Entry | None = None  # read by a step that ended before it
        self._tail_bytes = 0
        self.tail_overflows = 0  # times the offered tail was dropped for its size
        self.replayed_from_tail = 0  # records replayed from memory, not read back
        self.replayed_total = 0  # records appended to schedule_log by this process
        self.tombstones_total = 0  # tombstones handed to on_tombstones
        self.retired_total = 0  # retirements replayed
        # Where message_log's tombstones are, for a take-over (scan_tombstones).
        self.tombstones = TombstoneIndex(checkpoint.position)
        self._scanning: trio.Event | None = None  # set when scan_tombstones' scan ends
        self.checkpoints = 0  # checkpoints written by this process
        # Held from an append to the end of its on_scheduled calls: whoever reads a
        # bucket file's length under it (the wheel manager, fixing a bucket's loading
        # end) knows every record below that length has been offered to the hook.
        self.append_lock = trio.Lock()
        # Retention (delayd.server.retention) pauses message_log reads to delete segments.
        self._reads_paused: trio.Event | None = None
        self._wake = trio.Event()
        self._checkpoint_written = trio.Event()
        self._checkpoint_dir = layout.checkpoint_dir(data_dir)
        self._stopping = False
        self._stopped = trio.Event()
        self.refusals = WriteRefusals()  # the server shares its own

    # ------------------------------------------------------------------ state

    @property
    def position(self) -> int:
        """message_log offset of the next record to replay."""
        return self._position

    @property
    def checkpointed_position(self) -> int:
        """message_log offset of the last checkpoint written."""
        return self._checkpointed

    @property
    def next_sequence(self) -> int:
        """The sequence after the last replayed record."""
        return self._replayed_sequence + 1

    @property
    def lag_bytes(self) -> int:
        """Bytes of message_log not yet in schedule_log."""
        return self.log.end_offset - self._position

    @property
    def lag_records(self) -> int:
        """Accepted records (as reported by notify) not yet in schedule_log."""
        return max(0, self._head_sequence - self._replayed_sequence)

    def notify(self, head_sequence: int) -> None:
        """Intake appended records up to ``head_sequence`` (and, with the sync policy,
        made them durable): wake the run loop."""
        self._head_sequence = max(self._head_sequence, head_sequence)
        self._wake.set()

    # ------------------------------------------------------------------ the work

    def replay_available(self, max_records: int | None = None) -> int:
        """Append the durable message_log records from ``position`` (at most
        ``max_records``) to their buckets; returns how many.

        Raises CorruptionError for a damaged record, RecordFormatError for a record type
        this version cannot replay, StorageError when a bucket cannot be written.
        """
        step = self._collect(max_records)
        if step is None:
            return 0
        if step.retirements:
            if self.on_retire is not None:
                raise RuntimeError("retirements need the async run loop (on_retire is set)")
            starts = self._close_retired(step.retirements)
            self._forget_indexed(starts)
            if starts:
                self.checkpoint(always=True)  # see the module docstring
                retirement.delete_bucket_files(self.fs, self.data_dir, starts)
            self._finish(step, {})
            return step.count
        if step.tombstones:
            if self.on_tombstones is not None:
                raise RuntimeError("tombstones need the async run loop (on_tombstones is set)")
            self.derive_tombstones(step.tombstones)
            self.tombstones_total += len(step.tombstones)
            self._finish(step, {})
            return step.count
        self._finish(step, self._append(step.groups))
        return step.count

    def _collect(self, max_records: int | None) -> _Step | None:
        """Read the next durable records and group their schedule payloads by bucket."""
        target = self.log.durable_offset
        if self._position >= target:
            return None
        limit = math.inf if max_records is None else max_records
        width = bucket_width_ms(self.segment_scale)
        # The codecs, inlined for the once-per-record path: message_log.due_ms_of is
        # the unpack at offset 0, schedule_log.encode_scheduled the prefix + payload.
        pack_prefix = schedule_log.PREFIX.pack
        message_type = message_log.TYPE_MESSAGE
        groups: dict[int, _Group] = {}
        position = self._position
        count = 0
        last_payload = b""
        for entry in self._records(position, target):
            offset, rtype, payload, next_offset, due_ms, message_id, receive_ms = entry
            if rtype != message_type:
                message_log.check_type(rtype, self.log.directory, offset)
                if count:  # messages first: the tombstones are the next step
                    self._carry = entry
                    break
                if rtype == message_log.TYPE_RETIRE_BUCKET:
                    return self._collect_retirements(entry, target, limit)
                return self._collect_tombstones(entry, target, limit)
            start = due_ms - due_ms % width  # bucket_of, inlined
            group = groups.get(start)
            if group is None:
                group = groups[start] = _Group()
            group.payloads.append(pack_prefix(offset) + payload)
            group.dues.append(due_ms)
            group.ids.append(message_id)
            group.receive_ms.append(receive_ms)
            position = next_offset
            last_payload = payload
            count += 1
            if count >= limit:
                break
        if not count:
            if next(self.log.iter_from(self._position, target), None) is None:
                # Only an END_OF_SEGMENT marker lies between the position and the durable
                # end (a crash came between a segment's marker and the next segment):
                # step past it, or the start-up catch-up — which intake waits for —
                # would wait for a record that only a send can bring.
                self._position = target
            return None
        return _Step(groups, position, message_log.sequence_of(last_payload), count)

    def _collect_tombstones(self, first: _Entry, target: int, limit: float) -> _Step:
        """``first`` and the tombstones right after it, up to the next message."""
        tombstones = [(first[0], first[1], first[2])]
        position = first[3]
        if len(tombstones) < limit:
            for entry in self._records(position, target):
                offset, rtype, payload, next_offset = entry[:4]
                if rtype not in message_log.TOMBSTONE_TYPES:
                    self._carry = entry
                    break
                message_log.check_type(rtype, self.log.directory, offset)
                tombstones.append((offset, rtype, payload))
                position = next_offset
                if len(tombstones) >= limit:
                    break
        return _Step({}, position, self._replayed_sequence, len(tombstones), tombstones)

    def _collect_retirements(self, first: _Entry, target: int, limit: float) -> _Step:
        """``first`` and the retirements right after it, up to the next other record.
        Raises RecordFormatError for a malformed one."""
        retirements = [retirement.decode(first[2])]
        position = first[3]
        if len(retirements) < limit:
            for entry in self._records(position, target):
                rtype, payload, next_offset = entry[1:4]
                if rtype != message_log.TYPE_RETIRE_BUCKET:
                    self._carry = entry
                    break
                retirements.append(retirement.decode(payload))
                position = next_offset
                if len(retirements) >= limit:
                    break
        count = len(retirements)
        return _Step({}, position, self._replayed_sequence, count, retirements=retirements)

    async def _checkpoint_before_retiring(self) -> None:
        """A checkpoint at the retirement being replayed, its buckets closed: written
        before their files go (module docstring). Raises DiskFullError (the step runs
        again: nothing of it is done yet)."""
        if self.before_checkpoint is not None:
            await self.before_checkpoint()
        await trio.to_thread.run_sync(partial(self.checkpoint, always=True))
        self._announce_checkpoint()

    def _announce_checkpoint(self) -> None:
        self._checkpoint_written.set()
        self._checkpoint_written = trio.Event()

    def _close_retired(self, retirements: list[retirement.Retirement]) -> list[int]:
        """The buckets of ``retirements`` to delete, their bucket files closed (flushed:
        ``run`` calls it in a worker thread): each whose schedule_log file still has the
        length the leader found complete, or has no file any more (deleted before a
        crash: its dispatch_log file may be left). The length is a function of
        message_log, so every member decides alike."""
        starts = []
        for retired in retirements:
            start_ms = retired.start_ms
            opened = self.buckets.opened(start_ms)
            if opened is not None:
                size: int | None = opened.end_offset
            else:
                size = self.buckets.size(start_ms) if self.buckets.exists(start_ms) else None
            if size is not None and size != retired.schedule_bytes:
                continue  # appended to since the leader decided: kept everywhere
            self.buckets.close_bucket(start_ms)
            starts.append(start_ms)
        return starts

    def _forget_indexed(self, starts: list[int]) -> None:
        """Close the id index reader's descriptors of these buckets (the event loop's)."""
        if self.index is not None:
            for start_ms in starts:
                self.index.reader.forget(start_ms)

    def offer(
        self,
        offsets: list[int],
        payloads: list[bytes],
        known: tuple[list[int], list[bytes], int] | None = None,
    ) -> None:
        """Intake just appended MESSAGE ``payloads`` to message_log at ``offsets`` (every
        append, in order): keep them so that replay need not read back and re-check what
        it has in memory (as RocketMQ's reput reads the commitlog's mapped tail). Bounded
        by ``max_tail_bytes``; past it the tail is dropped and replay reads message_log.

        ``known``: (due_ms of each, message id bytes of each, the batch's receive_ms),
        which intake had at hand — replay then need not unpack them again."""
        if not self._room_for(payloads):
            return
        if known is None:
            # The next offset of a tail entry is never read (_from_tail works it out).
            records = map(Record, offsets, repeat(message_log.TYPE_MESSAGE), payloads, offsets)
            self._tail.extend(_entries(records))
            return
        dues, ids, receive_ms = known
        message_type = message_log.TYPE_MESSAGE
        self._tail.extend(
            [
                (offset, message_type, payload, 0, due_ms, message_id, receive_ms)
                for offset, payload, due_ms, message_id in zip(
                    offsets, payloads, dues, ids, strict=True
                )
            ]
        )

    def offer_typed(self, offsets: list[int], payloads: list[bytes], rtype: int) -> None:
        """``offer`` for records of type ``rtype`` (tombstones)."""
        if self._room_for(payloads):
            entries = zip(offsets, repeat(rtype), payloads, repeat(0), repeat(0), repeat(b""))
            self._tail.extend((*entry, 0) for entry in entries)

    def _room_for(self, payloads: list[bytes]) -> bool:
        size = sum(map(len, payloads))
        if self._tail_bytes + size > self.max_tail_bytes:
            self._tail.clear()
            self._tail_bytes = 0
            self.tail_overflows += 1
            return False
        self._tail_bytes += size
        return True

    def _records(self, position: int, target: int) -> Iterator[_Entry]:
        """The records from ``position`` up to ``target``: from the offered tail when
        it starts exactly there, else from message_log."""
        carry, self._carry = self._carry, None
        if carry is not None and carry[0] == position:
            return self._with_carry(carry, target)
        tail = self._tail
        while tail and tail[0][0] < position:
            self._tail_bytes -= len(tail.popleft()[2])
        if tail and tail[0][0] == position:
            return self._from_tail(position, target)
        return _entries(self.log.iter_from(position, target))

    def _with_carry(self, carry: _Entry, target: int) -> Iterator[_Entry]:
        yield carry
        yield from self._records(carry[3], target)

    def _from_tail(self, position: int, target: int) -> Iterator[_Entry]:
        # Only while each offered record starts where the previous one ended: an
        # END_OF_SEGMENT marker between two (a segment roll), or records that were never
        # offered, end the run, and the next step reads message_log from there.
        tail = self._tail
        popleft = tail.popleft
        taken = 0
        try:
            while tail:
                offset, rtype, payload, _, due_ms, message_id, receive_ms = tail[0]
                if offset != position:
                    return
                end = offset + HEADER_SIZE + len(payload)
                if end > target:
                    return
                popleft()
                self._tail_bytes -= len(payload)
                taken += 1
                yield offset, rtype, payload, end, due_ms, message_id, receive_ms
                position = end
        finally:
            self.replayed_from_tail += taken

    def _append(self, groups: dict[int, _Group]) -> dict[int, list[int]]:
        """Append each group to its bucket file; the offsets, by bucket. Touches only
        the bucket files, so ``run`` may call it in a worker thread.

        All or nothing on a full disk: DiskFullError after the buckets already written
        are cut back, so the step can run again without copying a record twice."""
        append, rtype = self.buckets.append_batch, schedule_log.TYPE_SCHEDULED
        done: dict[int, list[int]] = {}
        try:
            for start, group in groups.items():
                done[start] = append(start, group.payloads, rtype)
        except DiskFullError:
            for start, offsets in done.items():
                self.buckets.get(start).truncate(offsets[0])
            raise
        return done

    def _finish(self, step: _Step, offsets: dict[int, list[int]]) -> None:
        index = self.index
        if index is not None:
            for start, bucket_offsets in offsets.items():
                group = step.groups[start]
                index.put_batch(group.ids, start, bucket_offsets, group.receive_ms)
            if self.known is not None and not step.tombstones:
                self.known.indexed_through(step.last_sequence)
        hook = self.on_scheduled
        if hook is not None:
            for start, bucket_offsets in offsets.items():
                hook(start, bucket_offsets, step.groups[start].dues)
        self._position = step.position
        self._replayed_sequence = step.last_sequence
        self._head_sequence = max(self._head_sequence, step.last_sequence)
        if step.retirements:
            self.retired_total += step.count
        elif step.tombstones:
            self.tombstones.note([offset for offset, _, _ in step.tombstones])
        else:
            self.replayed_total += step.count

    def derive_tombstones(self, records: list[TombstoneRecord]) -> None:
        """Replay tombstones without deciding anything (no ``on_tombstones``): append
        the copy each reschedule appends on the leader, index it and offer it to
        ``on_scheduled``; write nothing to dispatch_log. A cancel appends nothing.

        A reschedule of type 5 always copies (delayd.logs.moves). One of type 4 (written
        before groups) copied only when the message moved, which its server recorded
        as RESCHEDULED on the record it moved: that entry, read from the dispatch_log
        the leader wrote, says whether to copy. Without the id index there is nothing
        to copy from: tombstones are passed over."""
        index = self.index
        if index is None:
            return
        for offset, rtype, payload in records:
            if rtype not in message_log.RESCHEDULE_TYPES:
                continue
            stone = tombstone.decode(rtype, payload)
            assert stone.due_ms is not None
            locations = index.lookup(stone.message_id)
            if not stone.always_copies and not self._moved_by_leader(locations):
                continue
            copy = moves.moved_copy(locations, stone.due_ms)
            if copy is None:
                continue
            try:
                self.append_copy(offset, copy)
            except DiskFullError as exc:
                # Copies before it are appended and indexed: the step cannot run again
                # as a whole. Stop; a restart cuts them and replays from the checkpoint.
                raise StorageError(f"replaying reschedule tombstones failed: {exc}") from exc

    def tombstones_between(self, start: int, end: int) -> list[TombstoneRecord]:
        """The tombstones message_log holds in [start, end) (``end`` at most
        ``position``), in order: the records at the offsets ``tombstones`` lists, read
        with descriptors of their own (``read_tombstones_at``), so a worker thread may
        call it while the event loop appends and reads. What a member that followed a
        leader decides again when it takes over; segments retention deleted were
        replayed and decided long before. Below where this process's replay began it
        needs ``scan_tombstones`` to have returned (RuntimeError before)."""
        offsets = self.tombstones.between(max(start, self.log.min_offset), end)
        return read_tombstones_at(self.fs, self.data_dir, offsets)

    async def scan_tombstones(self) -> None:
        """Fill ``tombstones`` below where this process's replay began: one scan of
        message_log from its first segment in a worker thread (off the event loop,
        while replay goes on); a caller that comes while it runs waits for it, one
        after it returns at once. Retention deletes no segment while it reads
        (``without_log_reads`` waits for it). Cancelling it stops the scan within
        CHECK_EVERY_RECORDS records; a later call scans again."""
        index = self.tombstones
        while not index.complete:
            if self._scanning is not None:
                await self._scanning.wait()
            elif self._reads_paused is not None:
                await self._reads_paused.wait()
            else:
                scanning = self._scanning = trio.Event()
                try:
                    start, end = self.log.min_offset, index.replay_start
                    check = trio.from_thread.check_cancelled
                    found = await trio.to_thread.run_sync(
                        scan_offsets, self.fs, self.data_dir, start, end, check
                    )
                    index.add_below(start, found)
                finally:
                    self._scanning = None
                    scanning.set()

    def _moved_by_leader(self, locations: list[Location]) -> bool:
        """Whether a type-4 reschedule moved the id whose records are ``locations``:
        its current record (the latest: type 4 made no void copies) has RESCHEDULED
        for its fate. Only the reschedule being replayed can have written it."""
        current = moves.latest(locations)
        if current is None:
            return False
        directory = layout.dispatch_log_dir(self.data_dir)
        path = f"{directory}/{bucket_name(current.bucket_ms)}"
        entry = find_entry(self.fs, path, current.offset)
        return entry is not None and entry.kind is EntryKind.RESCHEDULED

    def append_copy(self, message_log_offset: int, message_payload: bytes) -> tuple[int, int]:
        """Append a SCHEDULED record for ``message_payload`` (a MESSAGE payload, e.g. a
        rescheduled copy with its new due time) on behalf of the message_log record at
        ``message_log_offset`` — the tombstone being replayed, so that the bucket's
        records stay in message_log order and recovery cuts the copy with the tombstone.
        Indexes it and offers it to on_scheduled. Call from ``on_tombstones`` only
        (under the append lock). Returns (bucket start ms, offset)."""
        due_ms = message_log.due_ms_of(message_payload)
        start = bucket_of(due_ms, self.segment_scale)
        payload = schedule_log.encode_scheduled(message_log_offset, message_payload)
        (offset,) = self.buckets.append_batch(start, [payload], schedule_log.TYPE_SCHEDULED)
        if self.index is not None:
            self.index.put(
                scheduled_id(payload),
                start,
                offset,
                message_log.receive_ms_of(payload, schedule_log.PREFIX_SIZE),
            )
        if self.on_scheduled is not None:
            self.on_scheduled(start, [offset], [due_ms])
        return start, offset

    def checkpoint(self, *, always: bool = False) -> bool:
        """Make the replayed records durable and record the position; returns whether a
        checkpoint was written (False when nothing was replayed since the last one,
        unless ``always``: a retirement replaces one that may name a bucket it closed).

        Order is the idempotency argument: bucket files first, checkpoint second.
        """
        if not always and self._position == self._checkpointed and not self.buckets.dirty:
            return False
        position, next_sequence = self._position, self._replayed_sequence + 1
        self.buckets.flush()
        if self.index is not None:
            self.index.flush()  # every record below the checkpoint is indexed durably
        sizes = self.buckets.open_sizes()
        write_replay_checkpoint(
            self.fs, self.data_dir, ReplayCheckpoint(position, next_sequence, sizes)
        )
        self._checkpointed = position
        self.checkpoints += 1
        return True

    # ------------------------------------------------------------------ trio task

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Replay as records become durable, checkpoint every ``checkpoint_interval_s``;
        after ``request_stop``, replay what is durable, checkpoint and return."""
        task_status.started()
        last_checkpoint = trio.current_time()
        full_wait_s = DISK_FULL_RETRY_S[0]
        try:
            while True:
                self._wake = trio.Event()
                try:
                    replayed = await self._replay_step()
                except DiskFullError as exc:
                    # A retirement's step writes a checkpoint too.
                    refused = CHECKPOINT if exc.directory == self._checkpoint_dir else SCHEDULE_LOG
                    next_wait_s = await self._wait_for_space(refused, exc, full_wait_s)
                    if next_wait_s is None:
                        return  # recovery replays the rest from the checkpoint
                    full_wait_s = next_wait_s
                    continue
                if replayed:
                    self.refusals.clear(SCHEDULE_LOG)
                    full_wait_s = DISK_FULL_RETRY_S[0]
                    await trio.lowlevel.checkpoint()  # let intake run between batches
                    # A full step, or one cut short by a tombstone: there is more.
                    if self._position < self.log.durable_offset:
                        continue
                pending = self._position != self._checkpointed
                # One absolute deadline for both the test and the wait: "now - last >=
                # interval" false while "last + interval - now" rounds to 0 made the loop
                # wait 0 s forever on trio's MockClock (which never reached the time).
                checkpoint_at = last_checkpoint + self.checkpoint_interval_s
                if pending and (self._stopping or trio.current_time() >= checkpoint_at):
                    if self.before_checkpoint is not None:
                        # What tombstones below the checkpoint decided (dispatch_log
                        # entries) must be durable before replay can pass them for good.
                        await self.before_checkpoint()
                    try:
                        await trio.to_thread.run_sync(self.checkpoint)
                    except DiskFullError as exc:
                        # The old checkpoint stands (replay from it is idempotent).
                        next_wait_s = await self._wait_for_space(CHECKPOINT, exc, full_wait_s)
                        if next_wait_s is None:
                            return
                        full_wait_s = next_wait_s
                        continue
                    self.refusals.clear(CHECKPOINT)
                    last_checkpoint = trio.current_time()
                    self._announce_checkpoint()
                    continue
                if self._stopping and self._position >= self.log.durable_offset:
                    return
                deadline = checkpoint_at if pending else math.inf
                if self.poll_interval_s is not None:
                    deadline = min(deadline, trio.current_time() + self.poll_interval_s)
                with trio.move_on_at(deadline):
                    await self._wake.wait()
        finally:
            self._stopped.set()

    async def _wait_for_space(self, log: str, exc: DiskFullError, wait_s: float) -> float | None:
        """After ``log`` found the disk full: refuse its writes (/readyz, metrics), wait
        ``wait_s`` and return the next, doubled back-off (up to DISK_FULL_RETRY_S[1]);
        None at once when stopping, as a shutdown does not wait for space."""
        self.refusals.refuse(log, exc)
        if self._stopping:
            return None
        await trio.sleep(wait_s)
        return min(2 * wait_s, DISK_FULL_RETRY_S[1])

    async def _replay_step(self) -> int:
        """One step of ``replay_available`` for the event loop. Appends to open files
        are page-cache writes and run inline; a step that must open files (create one:
        a directory fsync; evict one: an fdatasync) runs them in a worker thread so
        that intake is not held up — as happens all the time when delays are spread
        over more buckets than ``max_open_files``."""
        while self._reads_paused is not None:
            await self._reads_paused.wait()
        step = self._collect(self.batch_records)
        if step is None:
            return 0
        if step.retirements:
            async with holding(self.append_lock):
                starts = await trio.to_thread.run_sync(self._close_retired, step.retirements)
                self._forget_indexed(starts)
                if starts:
                    await self._checkpoint_before_retiring()
                if self.on_retire is None:
                    await trio.to_thread.run_sync(
                        retirement.delete_bucket_files, self.fs, self.data_dir, starts
                    )
                elif starts:
                    await self.on_retire(starts)
                self._finish(step, {})
            return step.count
        if step.tombstones:
            async with holding(self.append_lock):
                if self.on_tombstones is None:
                    self.derive_tombstones(step.tombstones)
                else:
                    try:
                        await self.on_tombstones(self, step.tombstones)
                    except DiskFullError as exc:
                        # Its decisions (answers, withdrawals) are made as it goes: a
                        # step cut short cannot run again. Stop; a restart replays the
                        # tombstones from the checkpoint, from disk.
                        raise StorageError(
                            f"replaying cancel/reschedule tombstones failed: {exc}"
                        ) from exc
                self.tombstones_total += len(step.tombstones)
                self._finish(step, {})
            return step.count
        async with holding(self.append_lock):
            if all(self.buckets.is_open(start) for start in step.groups):
                offsets = self._append(step.groups)
            else:
                offsets = await trio.to_thread.run_sync(self._append, step.groups)
            try:
                self._finish(step, offsets)
            except DiskFullError as exc:
                # The records are in schedule_log already (an id index file that found
                # no room to roll): running the step again would copy them twice.
                raise StorageError(f"indexing replayed records failed: {exc}") from exc
        return step.count

    # ------------------------------------------------------------------ retention

    async def without_log_reads(self, work: Callable[[], T]) -> T:
        """Run ``work`` in a worker thread while this replayer reads nothing from
        message_log: storage's SegmentedLog lets a worker thread flush while the event
        loop appends, but not delete segments while the event loop reads (its segment
        list is not locked for readers). A running ``scan_tombstones`` is such a read:
        the work waits for it. The index forgets the tombstones of deleted segments."""
        while self._scanning is not None:
            await self._scanning.wait()
        paused = self._reads_paused = trio.Event()
        try:
            return await trio.to_thread.run_sync(work)
        finally:
            self._reads_paused = None
            paused.set()
            self.tombstones.forget_below(self.log.min_offset)

    async def wait_checkpointed(self, position: int) -> None:
        """Wait until ``run`` wrote a checkpoint at or past message_log ``position``."""
        while self._checkpointed < position:
            await self._checkpoint_written.wait()

    async def stop(self) -> None:
        """Ask ``run`` to finish: replay everything durable, write the checkpoint, return.
        Waits until it has. Call after intake stopped and message_log was flushed."""
        self._stopping = True
        self._wake.set()
        await self._stopped.wait()

    def close(self) -> None:
        """Flush and close the bucket files and the id index (does not write a
        checkpoint)."""
        try:
            self.buckets.close()
        finally:
            if self.index is not None:
                self.index.close()
                self.index.reader.close()
