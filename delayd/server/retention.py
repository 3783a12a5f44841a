"""Retention: delete what delivery no longer needs, never what it still does.

A trio task of ``delayd serve`` (started once delivery runs) makes a pass every
``retention.interval_ms``, skipped while the replayer is behind. Each pass deletes:

* **message_log segments** whose records all lie below the replayer's *checkpointed*
  position (every one of them is durably in schedule_log, which holds every byte
  delivery needs) and that were sealed more than ``message_log_ms`` ago — a segment is
  sealed when the first record of the next one arrives, so its age is that record's
  receive time. Never the segment being written (storage's ``delete_before``).
* **buckets** — the schedule_log file and the dispatch_log file of a time bucket —
  whose end is more than ``bucket_ms`` ago, that lie below the wheel's loading bucket,
  and whose dispatch_log ends with a COMPLETE mark covering the schedule_log file's
  whole length: every record has its fate (dispatched, dead-lettered, cancelled,
  moved). A bucket without that mark is kept however old (undelivered data).
* **id index files** whose entries all point into buckets older than the oldest bucket
  left (lookups there would find no record anyway).

A bucket is not deleted by the pass itself: the pass appends a RETIRE_BUCKET record
to message_log (delayd.logs.retirement), through intake's append path, and the replayer
deletes the files when it replays the record (``delete_retired``, its ``on_retire``).
In a group every member's replayer does, so the buckets go at the same message_log
position everywhere (docs/replication.md, "Retention in a group").

In a replicated group the leader deletes a message_log segment only once every member
of the in-sync set has copied past it too (``replicated_floor``): a follower that may
take over never lacks a record the leader deleted. A follower deletes no segment by its
own rule: it deletes those the leader no longer holds, once its own replay checkpoint
has passed them (``trim_below_leader``), so message_log goes on every member at the
leader's word, not by each member's clock.

Why a bucket deletion races nothing (docs/operations.md, "Retention"):

* The pass checks COMPLETE and appends the record under the replayer's append lock and
  the delivery dispatch lock; the replay of the record deletes under both again. The
  record carries the schedule_log file's length the pass saw complete, and the replay
  deletes only a file of that length: a schedule record replayed into the bucket in
  between (a clock set back) keeps it, on every member alike (schedule_log is a
  function of message_log). Without one, the sender writes nothing more to a
  COMPLETE bucket's dispatch_log: it has no entry of it left (the wheel manager's
  ``retire`` refuses a bucket it still loads or has entries of), and a cancel or a
  reschedule of one of its messages finds it delivered and writes nothing there.
* Every descriptor of the bucket is closed first: the replayer's and the id index
  reader's (the replayer, before ``on_retire``), the wheel manager's, the sender's
  reader's, DispatchFiles', the pending tracker's, a follower's copy of the
  dispatch_log stream (``streams_retired``).
* A record that arrives for a deleted bucket later (due times in the past are stored
  as the receipt time, so only a clock set back, or an age of 0, can make one) creates
  a new file of that name; it is below the loading bucket, so canAdd puts it straight
  into the wheel, and it is delivered as any other.
* Order on disk: schedule_log files first (directory fsynced), dispatch_log files
  second. A crash in between leaves dispatch_log files without a schedule_log file,
  which ``remove_orphans`` deletes at the next start before anything is appended — a
  schedule_log file is never left without the dispatch_log that says it was delivered
  (which would send it all again).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import trio

from delayd.logs import layout, message_log, retirement, tombstone
from delayd.logs.buckets import bucket_name, bucket_starts
from delayd.logs.dispatch_log import EntryKind, read_last_entry
from delayd.logs.id_index import MAX_MINUTE, MINUTE_MS, pack_location
from delayd.nowait_acquire import holding
from delayd.replay import Replayer
from delayd.server.config import RetentionConfig
from delayd.server.delivery import Delivery
from delayd.server.pending_metrics import PendingTracker
from storage.errors import CorruptionError, DiskFullError
from storage.fs import O_READ, FileSystem
from storage.segmented_log import SegmentedLog, is_segment_name

log = logging.getLogger(__name__)

LOGS = ("message_log", "schedule_log", "dispatch_log", "id_index")
MAX_LAG_RECORDS = 10_000  # a pass is skipped while the replayer is further behind
BATCH_BUCKETS = 64  # buckets retired per hold of the locks (replay waits meanwhile)


@dataclass(frozen=True, slots=True)
class _Bucket:
    start_ms: int
    schedule_bytes: int
    dispatch_bytes: int


def receive_ms_of(rtype: int, payload: bytes) -> int:
    """The receive time of a message_log record (message, tombstone, retirement)."""
    if rtype == message_log.TYPE_MESSAGE:
        return message_log.HEAD.unpack_from(payload)[2]
    if rtype == message_log.TYPE_RETIRE_BUCKET:
        return retirement.decode(payload).receive_ms
    return tombstone.decode(rtype, payload).receive_ms


AppendRetirements = Callable[[list[retirement.Retirement]], int]
"""Append retirements to message_log (no await); returns the log's end after them."""
CommitAppended = Callable[[], Awaitable[bool]]
"""Wait until what was appended is durable and (in a group) acknowledged; False when
it will not be (this member stopped leading)."""


def _file_size(fs: FileSystem, path: str) -> int | None:
    try:
        fd = fs.open(path, O_READ)
    except FileNotFoundError:
        return None
    try:
        return fs.fsize(fd)
    finally:
        fs.close(fd)


def _unlink(fs: FileSystem, path: str) -> None:
    # Gone already: a pass cut short by a crash, or an operator.
    with contextlib.suppress(FileNotFoundError):
        fs.unlink(path)


def remove_orphans(data_dir: str, fs: FileSystem) -> list[str]:
    """Delete the dispatch_log files that have no schedule_log file — what a crash
    between the two halves of a bucket deletion leaves — and return their names. Call
    at start, before the replayer appends (blocking). Such a file describes records
    that are gone; kept, it would make the loader skip the records of a new file of
    the same name."""
    schedule_dir = layout.schedule_log_dir(data_dir)
    dispatch_dir = layout.dispatch_log_dir(data_dir)
    if not fs.exists(dispatch_dir):
        return []
    scheduled = set(bucket_starts(fs.listdir(schedule_dir))) if fs.exists(schedule_dir) else set()
    orphans = [b for b in bucket_starts(fs.listdir(dispatch_dir)) if b not in scheduled]
    for start_ms in orphans:
        _unlink(fs, os.path.join(dispatch_dir, bucket_name(start_ms)))
    if orphans:
        fs.fsync_dir(dispatch_dir)
        log.warning(
            "retention: removed %d dispatch_log file(s) whose schedule_log file was "
            "already deleted (a deletion cut short): %s",
            len(orphans),
            ", ".join(bucket_name(b) for b in orphans),
        )
    return [bucket_name(b) for b in orphans]


async def trim_below_leader(log_: SegmentedLog, replayer: Replayer, leader_start: int) -> int:
    """Delete the segments of a follower's message_log wholly below ``leader_start``,
    where its leader's copy begins, and below the replay checkpoint (what is below it is
    durably in schedule_log); returns how many. The segment being written stays."""
    cut = min(leader_start, replayer.checkpointed_position)
    if cut <= log_.min_offset:
        return 0
    before = log_.min_offset
    deleted = await replayer.without_log_reads(partial(log_.delete_before, cut))
    if deleted:
        log.info(
            "retention: deleted %d message_log segment(s) below offset %d (%d bytes): the "
            "leader's message_log begins at %d",
            deleted,
            log_.min_offset,
            log_.min_offset - before,
            leader_start,
        )
    return deleted


class Retention:
    """The retention task of one delay server; see the module docstring. Build it
    after the server opened (it becomes the replayer's ``on_retire``: every member
    deletes retired buckets, a follower too), run ``run`` once delivery runs;
    ``run_pass`` is one pass (for tests). ``append_retirements`` and
    ``commit_appended``: intake's append path (the server's IntakePath); without them
    the records go straight to message_log. Counters for metrics: ``deleted_files``,
    ``deleted_bytes`` (by log), ``passes``, ``skipped_passes``, ``last_pass_ms``."""

    def __init__(
        self,
        config: RetentionConfig,
        message_log: SegmentedLog,
        replayer: Replayer,
        delivery: Delivery,
        *,
        pending: PendingTracker | None = None,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self.config = config
        self.message_log = message_log
        self.replayer = replayer
        self.delivery = delivery
        self.pending = pending
        self.clock = clock or delivery.now_ms
        self.fs = delivery.fs
        self.schedule_dir = layout.schedule_log_dir(delivery.data_dir)
        self.dispatch_dir = layout.dispatch_log_dir(delivery.data_dir)
        self.width_ms = delivery.manager.width_ms
        self.deleted_files: Counter[str] = Counter({name: 0 for name in LOGS})
        self.deleted_bytes: Counter[str] = Counter({name: 0 for name in LOGS})
        self.passes = 0
        self.skipped_passes = 0  # the replayer was behind
        self.last_pass_ms: int | None = None
        self._sealed_ms: dict[int, int] = {}  # segment base -> when it was sealed
        # In a group: how far every in-sync member has message_log durable (the
        # leader's own end included); segments at or above it stay. None: no group.
        self.replicated_floor: Callable[[], int] | None = None
        self.append_retirements: AppendRetirements = self._append_to_log
        self.commit_appended: CommitAppended = self._flush_log
        # In a group: told of buckets about to be deleted (a follower stops copying
        # their dispatch_log stream), then that they were (the leader's streams shrank).
        self.streams_retired: Callable[[list[int]], object] | None = None
        self.streams_deleted: Callable[[], object] | None = None
        self._retiring: dict[int, int] = {}  # bucket -> message_log end after its record
        self._index_trimmed_after = 0  # schedule_log files deleted at the last index trim
        replayer.on_retire = self.delete_retired

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """A pass every ``interval_ms`` until cancelled. Raises what a deletion raises
        (a StorageError, an OSError other than a file already gone)."""
        task_status.started()
        while True:
            await trio.sleep(self.config.interval_ms / 1000)
            if self.replayer.lag_records > MAX_LAG_RECORDS:
                self.skipped_passes += 1
                continue
            await self.run_pass()

    async def run_pass(self) -> None:
        """Delete what is due for deletion now (see the module docstring)."""
        now_ms = self.clock()
        await self._trim_message_log(now_ms)
        await self._trim_buckets(now_ms)
        self.passes += 1
        self.last_pass_ms = now_ms

    # ------------------------------------------------------------------ message_log

    async def _trim_message_log(self, now_ms: int) -> None:
        log_ = self.message_log
        limit = self.replayer.checkpointed_position
        if self.replicated_floor is not None:
            limit = min(limit, self.replicated_floor())
        names = await trio.to_thread.run_sync(self.fs.listdir, log_.directory)
        bases = sorted(int(n) for n in names if is_segment_name(n))
        cut = None
        # bases[-1] is the segment being written: never a candidate.
        for next_base in bases[1:]:
            if next_base > limit:
                break
            if self.config.message_log_ms and (
                self._segment_sealed_ms(next_base) > now_ms - self.config.message_log_ms
            ):
                break
            cut = next_base
        if cut is None:
            return
        deleted = await self.replayer.without_log_reads(partial(log_.delete_before, cut))
        if not deleted:
            return
        freed = cut - bases[0]  # offsets are dense: a sealed segment's bytes
        self._sealed_ms = {b: ms for b, ms in self._sealed_ms.items() if b > cut}
        self.deleted_files["message_log"] += deleted
        self.deleted_bytes["message_log"] += freed
        log.info(
            "retention: deleted %d message_log segment(s) below offset %d (%d bytes); "
            "replay checkpoint at %d",
            deleted,
            cut,
            freed,
            limit,
        )

    def _segment_sealed_ms(self, next_base: int) -> int:
        """When the segment before ``next_base`` was sealed: the receive time of the
        first record after it (read once per segment, on the event loop, where the log
        is read)."""
        sealed = self._sealed_ms.get(next_base)
        if sealed is None and next_base >= self.message_log.end_offset:
            return self.clock()  # no record after it yet (an empty segment a crash left)
        if sealed is None:
            record = self.message_log.read(next_base)
            sealed = self._sealed_ms[next_base] = receive_ms_of(record.type, record.payload)
        return sealed

    # ------------------------------------------------------------------ buckets

    async def _trim_buckets(self, now_ms: int) -> None:
        manager = self.delivery.manager
        # A bucket ends at start + width; it is old enough once that is bucket_ms ago.
        newest = min(
            now_ms - self.width_ms - self.config.bucket_ms,
            manager.cursors.loading.bucket_ms - 1,
        )
        if self.deleted_files["schedule_log"] > self._index_trimmed_after:
            # Replays deleted buckets since the last look: the oldest bucket left may
            # have moved, and index files with it.
            self._index_trimmed_after = self.deleted_files["schedule_log"]
            await self._trim_id_index()
        position = self.replayer.position
        self._retiring = {b: end for b, end in self._retiring.items() if end > position}
        candidates = await trio.to_thread.run_sync(self._complete_buckets, newest)
        candidates = [c for c in candidates if c.start_ms not in self._retiring]
        appended = False
        try:
            for index in range(0, len(candidates), BATCH_BUCKETS):
                batch = candidates[index : index + BATCH_BUCKETS]
                appended |= await self._retire_buckets(batch)
        except DiskFullError as exc:
            # Nothing of the refused batch was appended; a later pass tries again.
            log.warning("retention: no room in message_log to retire buckets: %s", exc)
        # The replay deletes them (delete_retired); a pass does not wait for it.
        if appended and await self.commit_appended():
            self.replayer.notify(0)

    def _complete_buckets(self, newest_ms: int) -> list[_Bucket]:
        """Buckets starting at or before ``newest_ms`` whose dispatch_log ends with a
        COMPLETE mark at their schedule_log file's length (worker thread; a hint only:
        checked again under the locks)."""
        out = []
        for start_ms in bucket_starts(self.fs.listdir(self.schedule_dir)):
            if start_ms > newest_ms:
                break
            bucket = self._complete(start_ms)
            if bucket is not None:
                out.append(bucket)
        return out

    def _complete(self, start_ms: int) -> _Bucket | None:
        name = bucket_name(start_ms)
        schedule_bytes = _file_size(self.fs, os.path.join(self.schedule_dir, name))
        if schedule_bytes is None:
            return None
        dispatch_path = os.path.join(self.dispatch_dir, name)
        try:
            last = read_last_entry(self.fs, dispatch_path)
        except CorruptionError:
            return None  # the server reports damage when it reads the file; keep it
        if last is None or last.kind is not EntryKind.COMPLETE or last.offset != schedule_bytes:
            return None
        dispatch_bytes = _file_size(self.fs, dispatch_path)
        if dispatch_bytes is None:
            return None
        return _Bucket(start_ms, schedule_bytes, dispatch_bytes)

    async def _retire_buckets(self, batch: list[_Bucket]) -> bool:
        """Append a retirement for each bucket of ``batch`` still complete (checked
        again under both locks: nothing appends meanwhile) that the wheel manager has
        no business with; whether any was. Until the replay passes its record a
        bucket is not retired again (``_retiring``)."""
        replayer, delivery = self.replayer, self.delivery
        async with replayer.append_lock, delivery.dispatch_lock:
            still = await trio.to_thread.run_sync(self._still_complete, batch)
            manager = delivery.manager
            chosen = [c for c in still if manager.may_retire(c.start_ms)]
            if not chosen:
                return False
            now_ms = self.clock()
            end = self.append_retirements(
                [retirement.Retirement(c.start_ms, c.schedule_bytes, now_ms) for c in chosen]
            )
        self._retiring.update((c.start_ms, end) for c in chosen)
        return True

    def _still_complete(self, batch: list[_Bucket]) -> list[_Bucket]:
        return [c for c in batch if self._complete(c.start_ms) == c]

    def _append_to_log(self, retirements: list[retirement.Retirement]) -> int:
        payloads = [retirement.encode(r) for r in retirements]
        rtype = message_log.TYPE_RETIRE_BUCKET
        offsets = self.message_log.append_batch(payloads, rtype)
        self.replayer.offer_typed(offsets, payloads, rtype)
        return self.message_log.end_offset

    async def _flush_log(self) -> bool:
        await trio.to_thread.run_sync(self.message_log.flush)
        return True

    async def delete_retired(self, starts: list[int]) -> None:
        """The replayer's ``on_retire`` (every member's, the leader's included): close
        every descriptor of the buckets ``starts`` and delete their files (schedule_log
        first: ``retirement.delete_bucket_files``). Under the append lock."""
        delivery = self.delivery
        async with holding(delivery.dispatch_lock):
            for start_ms in starts:
                # A follower's manager, never run, refuses: it holds nothing of them.
                delivery.manager.retire(start_ms)
                delivery.manager.reader.forget(start_ms)
                delivery.sender.reader.forget(start_ms)
            if self.streams_retired is not None:
                self.streams_retired(starts)
            sizes = await trio.to_thread.run_sync(self._delete_files, starts)
            if self.pending is not None:
                for start_ms in starts:
                    self.pending.forget(start_ms)
        if self.streams_deleted is not None:
            self.streams_deleted()
        schedule_sizes = [s for s, _ in sizes if s is not None]
        dispatch_sizes = [d for _, d in sizes if d is not None]
        schedule_bytes, dispatch_bytes = sum(schedule_sizes), sum(dispatch_sizes)
        self.deleted_files["schedule_log"] += len(schedule_sizes)
        self.deleted_files["dispatch_log"] += len(dispatch_sizes)
        self.deleted_bytes["schedule_log"] += schedule_bytes
        self.deleted_bytes["dispatch_log"] += dispatch_bytes
        log.info(
            "retention: deleted %d complete bucket(s) %s..%s (schedule_log %d bytes, "
            "dispatch_log %d bytes)",
            len(starts),
            bucket_name(starts[0]),
            bucket_name(starts[-1]),
            schedule_bytes,
            dispatch_bytes,
        )

    def _delete_files(self, starts: list[int]) -> list[tuple[int | None, int | None]]:
        """Delete the buckets' files; their (schedule_log, dispatch_log) sizes before
        (None: no file, a deletion a crash cut short)."""
        sizes = []
        for start_ms in starts:
            self.delivery.dispatch.forget(start_ms)  # flushes and closes its descriptor
            name = bucket_name(start_ms)
            schedule = _file_size(self.fs, os.path.join(self.schedule_dir, name))
            dispatch = _file_size(self.fs, os.path.join(self.dispatch_dir, name))
            sizes.append((schedule, dispatch))
        retirement.delete_bucket_files(self.fs, self.delivery.data_dir, starts)
        return sizes

    # ------------------------------------------------------------------ id index

    async def _trim_id_index(self) -> None:
        index = self.replayer.index
        if index is None:
            return
        async with self.replayer.append_lock:  # no put, no lookup meanwhile
            files, freed = await trio.to_thread.run_sync(self._unlink_index_files)
        if files:
            self.deleted_files["id_index"] += files
            self.deleted_bytes["id_index"] += freed
            log.info("retention: deleted %d id_index file(s) (%d bytes)", files, freed)

    def _unlink_index_files(self) -> tuple[int, int]:
        """Delete the index files whose entries all point below the oldest bucket left
        (worker thread, append lock held by the caller); (files, bytes)."""
        assert self.replayer.index is not None
        store = self.replayer.index.store
        remaining = bucket_starts(self.fs.listdir(self.schedule_dir))
        oldest_minute = remaining[0] // MINUTE_MS if remaining else MAX_MINUTE
        cutoff = pack_location(max(0, oldest_minute) * MINUTE_MS, 0)
        before = {path: _file_size(self.fs, path) or 0 for path in store.files}
        files = store.delete_before(cutoff)
        kept = set(store.files)
        return files, sum(size for path, size in before.items() if path not in kept)
