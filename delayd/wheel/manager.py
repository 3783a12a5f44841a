"""WheelManager: loads schedule_log buckets into the wheel ahead of their time, puts
records the replayer appends behind the loader straight in (canAdd), and marks a bucket
complete in dispatch_log once every record of it has an entry.

As QMQ's WheelTickManager, with these differences (docs/delivery.md):

* Restart recovery looks at every bucket that is not marked complete, not only the last
  two: the loader skips exactly the offsets its dispatch_log lists, and a bucket marked
  COMPLETE at its current length is not read at all.
* The loader asks the file's length under the replayer's append lock
  (``Replayer.append_lock``), so no record can be appended between "the loader fixed the
  bucket's end" and "the replayer asked canAdd about it" — the race QMQ's loader and
  replayer threads leave open.
* Loading is streamed in chunks from a worker thread, advancing the loaded cursor after
  each chunk, so a failed load resumes where it stopped (LoadCursors.begin).

Every entry the manager puts in the wheel is *outstanding* for its bucket until the
sender reports it recorded in dispatch_log (``on_recorded``); a bucket whose time has
passed, that is fully loaded and has nothing outstanding, gets a COMPLETE mark.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import trio
from sortedcontainers import SortedList

from delayd.logs.buckets import bucket_width_ms
from delayd.logs.dispatch_files import DispatchFiles
from delayd.logs.schedule_reader import ScheduleReader
from delayd.wheel.cursor import LoadCursors
from delayd.wheel.ticker import Ticker
from delayd.wheel.timer import MAX_BUCKET
from storage.errors import DiskFullError

log = logging.getLogger(__name__)


class Whereabouts(enum.Enum):
    """Where ``WheelManager.withdraw`` found a schedule_log record."""

    REMOVED = "removed from the wheel"  # it had not fired: now it never will
    SKIPPED = "the loader will skip it"  # its bucket is being loaded, not this record yet
    # Its bucket is being loaded and the loader read an entry for it at begin (a restart
    # loads only what dispatch_log does not list): that entry is its fate, not SKIPPED.
    RECORDED = "listed in its dispatch_log"
    NOT_LOADED = "its bucket is not loaded"  # dispatch_log decides what the loader skips
    TAKEN = "not in the wheel"  # loaded and fired (the sender has it, or it is recorded)


LOAD_CHUNK_RECORDS = 65_536  # records read per worker-thread call while loading
# Less than this is read on the event loop: a thread hop costs more than reading a
# small bucket, and the many small buckets of a light load then cost no hops at all.
INLINE_READ_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class ManagerStatistics:
    """A snapshot for metrics: the cursors, how far ahead the wheel is loaded, entries
    the manager handed to the wheel and that are not yet recorded, counts."""

    loading_bucket_ms: int
    loading_offset: int
    loaded_offset: int
    loaded_until_ms: int  # end of the last fully loaded bucket (start of loading if not)
    outstanding: int
    buckets_loaded: int
    buckets_completed: int
    entries_loaded: int
    entries_added: int  # through canAdd
    entries_skipped: int  # listed in dispatch_log when loaded (recovery)


class WheelManager:
    """See the module docstring. Build it, pass ``on_scheduled`` to the replayer as its
    hook, and run ``run`` in the root nursery after replay caught up."""

    def __init__(
        self,
        ticker: Ticker,
        reader: ScheduleReader,
        dispatch: DispatchFiles,
        append_lock: trio.Lock,
        dispatch_lock: trio.Lock,
        *,
        segment_scale: int,
        load_ahead_ms: int | None = None,
    ) -> None:
        self.ticker = ticker
        self.reader = reader
        self.dispatch = dispatch
        self.append_lock = append_lock
        self.dispatch_lock = dispatch_lock  # DispatchFiles is shared with the sender
        self.width_ms = bucket_width_ms(segment_scale)
        self.load_ahead_ms = 2 * self.width_ms if load_ahead_ms is None else load_ahead_ms
        if self.load_ahead_ms < 0:
            raise ValueError(f"load_ahead_ms must be >= 0, got {self.load_ahead_ms}")
        self.cursors = LoadCursors()
        self._ids: dict[int, int] = {}  # bucket start -> wheel bucket id
        self._starts: dict[int, int] = {}  # wheel bucket id -> bucket start
        self._free_ids: list[int] = []
        self._next_id = 0
        self._outstanding: dict[int, int] = {}  # bucket start -> entries not recorded
        self._marked: dict[int, int] = {}  # bucket start -> length its COMPLETE covers
        # Called after COMPLETE marks were written: whoever flushes dispatch_log (the
        # sender) makes them durable, and so shipped to followers, even when idle.
        self.on_marked: Callable[[], None] = lambda: None
        # Offsets of the loading bucket withdrawn after it began, before the loader
        # reached them: the dispatch state it read at begin does not list them.
        self._skip: set[int] = set()
        # Offsets of the loading bucket its dispatch_log listed at begin (delivered,
        # dead-lettered, cancelled or moved, by this run or an earlier one).
        self._done: set[int] = set()
        # Every bucket that has a schedule_log file: listed once here, then told by the
        # hook (a bucket's file is created by its first append), so the loader never
        # lists a directory of thousands of buckets again.
        self._known = SortedList(reader.buckets())
        self._wake = trio.Event()
        self.buckets_loaded = 0
        self.buckets_completed = 0
        self.entries_loaded = 0
        self.entries_added = 0
        self.entries_skipped = 0

    # ------------------------------------------------------------------ bucket ids

    def bucket_of_id(self, bucket_id: int) -> int:
        """The bucket start (epoch ms) of a wheel bucket id."""
        return self._starts[bucket_id]

    def _id_for(self, bucket_ms: int) -> int:
        bucket_id = self._ids.get(bucket_ms)
        if bucket_id is None:
            if self._free_ids:
                bucket_id = self._free_ids.pop()
            else:
                if self._next_id > MAX_BUCKET:
                    raise RuntimeError("more than 2**24 buckets with entries in the wheel")
                bucket_id, self._next_id = self._next_id, self._next_id + 1
            self._ids[bucket_ms] = bucket_id
            self._starts[bucket_id] = bucket_ms
        return bucket_id

    def bucket_id(self, bucket_ms: int) -> int | None:
        """The wheel bucket id of a bucket with entries in flight, or None."""
        return self._ids.get(bucket_ms)

    def _release_id(self, bucket_ms: int) -> None:
        bucket_id = self._ids.pop(bucket_ms, None)
        if bucket_id is not None:
            del self._starts[bucket_id]
            self._free_ids.append(bucket_id)

    # ------------------------------------------------------------------ the hook

    def on_scheduled(self, bucket_ms: int, offsets: list[int], dues: list[int]) -> None:
        """The replayer's hook (called under its append lock, right after the append of
        records at ``offsets``, due at ``dues``, to the bucket): canAdd each, or leave
        it to the loader and wake that when the bucket is already in the load window."""
        if offsets[0] == 0 and bucket_ms not in self._known:
            self._known.add(bucket_ms)  # its first record: the file is new
        cursors = self.cursors
        if bucket_ms > cursors.loading.bucket_ms:  # canAdd says no to all (the usual case)
            if bucket_ms <= self.ticker.now_ms() + self.load_ahead_ms:
                self._wake.set()
            return
        can_add = cursors.can_add
        for offset, due_ms in zip(offsets, dues, strict=True):
            if can_add(bucket_ms, offset):
                self._add(bucket_ms, offset, due_ms)
                self.entries_added += 1
            elif bucket_ms <= self.ticker.now_ms() + self.load_ahead_ms:
                self._wake.set()

    def _add(self, bucket_ms: int, offset: int, due_ms: int) -> None:
        self.ticker.add(due_ms, self._id_for(bucket_ms), offset)
        self._outstanding[bucket_ms] = self._outstanding.get(bucket_ms, 0) + 1

    # ------------------------------------------------------------------ cancel

    def withdraw(self, bucket_ms: int, offset: int, due_ms: int) -> Whereabouts:
        """Take the record at (bucket, offset), due at ``due_ms``, out of the loading
        path if it is still there; says where it was. Synchronous: call it with the
        append lock held (no loader step may begin a bucket meanwhile) and the dispatch
        lock held (the caller records the entry before anything else runs).

        REMOVED: the caller records it and calls ``on_recorded``. SKIPPED: the caller
        records it (it was never outstanding). NOT_LOADED: its fate is whatever its
        dispatch_log says; an entry the caller appends now is read when the bucket
        begins. RECORDED: its dispatch_log entry (read when the bucket began) is its
        fate. TAKEN: the sender has it or it has an entry.
        """
        bucket_id = self._ids.get(bucket_ms)
        if bucket_id is not None and self.ticker.remove(due_ms, bucket_id, offset):
            return Whereabouts.REMOVED
        cursors = self.cursors
        loading = cursors.loading
        if bucket_ms > loading.bucket_ms:
            return Whereabouts.NOT_LOADED
        if bucket_ms == loading.bucket_ms and cursors.loaded.offset <= offset < loading.offset:
            if offset in self._done:
                # Not pending: delivered (maybe by the run before a restart, which is
                # why the loader skips it), cancelled or moved. Calling it SKIPPED
                # would answer CANCELLED for a delivered message, or let a reschedule
                # bring back a cancelled one.
                return Whereabouts.RECORDED
            self._skip.add(offset)
            return Whereabouts.SKIPPED
        return Whereabouts.TAKEN

    # ------------------------------------------------------------------ retention

    def may_retire(self, bucket_ms: int) -> bool:
        """Whether ``retire`` would forget the bucket now (it changes nothing)."""
        return bucket_ms < self.cursors.loading.bucket_ms and bucket_ms not in self._outstanding

    def retire(self, bucket_ms: int) -> bool:
        """Forget a bucket whose files retention is about to delete, closing this
        manager's descriptor of it; False (and nothing forgotten) while the manager
        still has business with it: not below the loading bucket, entries outstanding
        or a COMPLETE mark still to write. Call with the append and dispatch locks held.

        A record appended to the bucket later (a file of the same name, new) is below
        the loading bucket, so canAdd puts it straight into the wheel."""
        if not self.may_retire(bucket_ms):
            return False
        if bucket_ms in self._known:
            self._known.remove(bucket_ms)
        self._marked.pop(bucket_ms, None)
        self.reader.forget(bucket_ms)
        return True

    # ------------------------------------------------------------------ the sender's report

    def on_recorded(self, bucket_id: int, count: int) -> None:
        """``count`` entries of wheel bucket ``bucket_id`` now have dispatch_log entries
        (dispatched, dead-lettered or cancelled)."""
        bucket_ms = self._starts[bucket_id]
        left = self._outstanding[bucket_ms] - count
        if left < 0:
            raise RuntimeError(f"bucket {bucket_ms}: more entries recorded than loaded")
        self._outstanding[bucket_ms] = left
        if left == 0 and self._fully_loaded(bucket_ms):
            self._wake.set()  # the loop marks it complete once its time has passed

    def _fully_loaded(self, bucket_ms: int) -> bool:
        loading = self.cursors.loading.bucket_ms
        return bucket_ms < loading or (bucket_ms == loading and self.cursors.complete)

    @property
    def outstanding(self) -> int:
        return sum(self._outstanding.values())

    # ------------------------------------------------------------------ the task

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load buckets as they come within ``load_ahead_ms``, mark finished ones
        complete; runs until cancelled. Raises CorruptionError from a bucket file."""
        task_status.started()
        while True:
            self._wake = trio.Event()
            if await self._load_next():
                continue
            await self._mark_finished()
            with trio.move_on_at(self._next_wake_s()):
                await self._wake.wait()

    def _next_wake_s(self) -> float:
        """Trio time to look again without a wake-up: when the next bucket file comes
        within the window, or when a finished bucket's time has passed (so that it can
        be marked). Nothing else: an idle manager does not wake."""
        deadlines = [math.inf]
        later = self._next_known()
        if later is not None:
            deadlines.append(self.ticker.deadline(later - self.load_ahead_ms))
        idle = [b for b, left in self._outstanding.items() if left == 0 and self._fully_loaded(b)]
        if idle:
            deadlines.append(self.ticker.deadline(min(idle) + self.width_ms))
        return max(trio.current_time(), min(deadlines))

    def _next_known(self) -> int | None:
        """The first bucket with a file above the loading one."""
        known = self._known
        index = known.bisect_right(self.cursors.loading.bucket_ms)
        return known[index] if index < len(known) else None

    async def _load_next(self) -> bool:
        """Begin (or resume) the next bucket within the window and load it; False when
        there is none."""
        async with self.append_lock:
            cursors = self.cursors
            if cursors.complete:
                horizon = self.ticker.now_ms() + self.load_ahead_ms
                later = self._next_known()
                if later is None or later > horizon:
                    return False
                bucket_ms = later
            else:
                bucket_ms = cursors.loading.bucket_ms  # resume a failed load
            end = self.reader.size(bucket_ms)
            resumed = bucket_ms == cursors.loading.bucket_ms
            start = cursors.begin(bucket_ms, end)
            if not resumed:
                self._skip = set()
            # Read the dispatch state under the lock too: nothing can be recorded for
            # records the loader has not handed out yet, so it cannot go stale.
            async with self.dispatch_lock:
                if self.dispatch.size(bucket_ms) <= INLINE_READ_BYTES:
                    state = self.dispatch.state(bucket_ms)
                else:
                    state = await trio.to_thread.run_sync(self.dispatch.state, bucket_ms)
            self._done = state.done
        if state.complete_up_to == end:
            cursors.advance(end)  # every record has an entry: nothing to read
            self.entries_skipped += len(state.done)
            self._marked[bucket_ms] = end  # and its mark is there: not written again
        else:
            await self._load(bucket_ms, start, end, state.done)
        cursors.finish()
        # Considered by _mark_finished even when every record was already recorded.
        self._outstanding.setdefault(bucket_ms, 0)
        if not resumed:
            self.buckets_loaded += 1
        log.debug("loaded bucket %d up to %d", bucket_ms, end)
        return True

    async def _load(self, bucket_ms: int, start: int, end: int, done: set[int]) -> None:
        position = start
        scan = self.reader.scan_dues
        while position < end:
            if end - position <= INLINE_READ_BYTES:
                offsets, dues, position = scan(bucket_ms, position, end, LOAD_CHUNK_RECORDS)
            else:
                offsets, dues, position = await trio.to_thread.run_sync(
                    scan, bucket_ms, position, end, LOAD_CHUNK_RECORDS
                )
            skip = self._skip
            for offset, due_ms in zip(offsets, dues, strict=True):
                if offset in done or offset in skip:
                    self.entries_skipped += 1
                else:
                    self._add(bucket_ms, offset, due_ms)
                    self.entries_loaded += 1
            self.cursors.advance(position)

    async def _mark_finished(self) -> None:
        """COMPLETE-mark every bucket whose time has passed, that is fully loaded and
        has no outstanding entry, unless it is marked at its length already."""
        now_ms = self.ticker.now_ms()
        finished = [
            b
            for b, left in self._outstanding.items()
            if left == 0 and b + self.width_ms <= now_ms and self._fully_loaded(b)
        ]
        if not finished:
            return
        marked = self.buckets_completed
        try:
            await self._mark(finished, now_ms)
        finally:
            if self.buckets_completed != marked:
                self.on_marked()

    async def _mark(self, finished: list[int], now_ms: int) -> None:
        # Lengths read under the append lock cover only records with entries.
        async with self.append_lock, self.dispatch_lock:
            for bucket_ms in finished:
                if self._outstanding.get(bucket_ms) != 0:
                    continue  # canAdd put a new entry in while we waited for the lock
                size = self.reader.size(bucket_ms)
                if self._marked.get(bucket_ms) != size:
                    try:
                        self.dispatch.mark_complete(bucket_ms, size, now_ms)
                    except DiskFullError:
                        # The mark only saves a restart some reading: the bucket and
                        # the rest stay outstanding, and a later pass marks them.
                        return
                    self._marked[bucket_ms] = size
                    self.buckets_completed += 1
                del self._outstanding[bucket_ms]
                self._release_id(bucket_ms)

    def statistics(self) -> ManagerStatistics:
        cursors = self.cursors
        loading = cursors.loading
        if loading.bucket_ms < 0:
            loaded_until = self.ticker.now_ms()
        elif cursors.complete:
            loaded_until = loading.bucket_ms + self.width_ms
        else:
            loaded_until = loading.bucket_ms
        return ManagerStatistics(
            loading.bucket_ms,
            loading.offset,
            cursors.loaded.offset,
            loaded_until,
            self.outstanding,
            self.buckets_loaded,
            self.buckets_completed,
            self.entries_loaded,
            self.entries_added,
            self.entries_skipped,
        )
