"""PendingCounts: messages scheduled and not yet done, per bucket, counted from the logs.

A message is *pending* from the moment its record is in schedule_log until its
bucket's dispatch_log has an entry for it (any kind but COMPLETE: dispatched,
dead-lettered, cancelled, rescheduled):
the same definition the audit and ``delayd inspect`` use, so the gauge agrees with
them and covers what the wheel has not loaded (QMQ exports no such number, qmq #107;
Pulsar users ask for it, pulsar #6979). Per bucket::

    pending = records below base           (counted once at start; 0 when COMPLETE)
            - entries for offsets below base
            + records appended since start  (the replayer's on_scheduled hook)
            - entries for offsets at or past base

``base`` is the bucket file's length when this process started, taken before the
replayer appends: every record below it was there at start, every record at or past
it is offered to the hook. dispatch_log entries name their schedule_log offset, so each
is put on the right side of ``base`` whenever it is read, and a COMPLETE mark at
``base`` settles the old side without reading the schedule file at all.

Nothing here reads a file or the clock (STYLE.md #4): the hook and the entry batches
come in as calls, ``now_ms`` is an argument; delayd.server.pending_metrics does the
I/O. A message counts in the horizon band of its bucket's *start*, so a band boundary
is as precise as the bucket width (segment_scale_minutes): a message may count one
band nearer than its due time, never farther.
"""

from __future__ import annotations

from collections.abc import Iterable

from sortedcontainers import SortedDict

from delayd.logs.dispatch_log import FATES

# (band label, upper bound of bucket start - now, in ms); the last band is open.
HORIZONS: tuple[tuple[str, float], ...] = (
    ("1m", 60_000),
    ("10m", 600_000),
    ("1h", 3_600_000),
    ("1d", 86_400_000),
    ("later", float("inf")),
)
# Every fate settles one record (dispatched, dead-lettered, cancelled, or rescheduled —
# the copy in its new bucket is a record of its own); COMPLETE marks and the ROUTE and
# ROUTED entries (where a send went) settle none.
_DONE = frozenset(kind.value for kind in FATES)


class BucketCounts:
    """What is known of one bucket; see the module docstring for the arithmetic."""

    __slots__ = ("base", "done_new", "done_old", "new_records", "old_complete", "old_records")

    def __init__(self, base: int, old_records: int | None, old_complete: bool) -> None:
        self.base = base  # schedule_log length at start
        self.old_records = old_records  # records below base; None until counted
        self.old_complete = old_complete  # a COMPLETE mark covers base: old side is done
        self.new_records = 0
        self.done_old = 0
        self.done_new = 0

    @property
    def pending(self) -> int:
        old = 0 if self.old_complete else (self.old_records or 0) - self.done_old
        return old + self.new_records - self.done_new


class PendingCounts:
    """Pending messages per bucket and in total (see the module docstring).

    Buckets that hold files when the server starts are registered with ``expect``
    (their base) and counted with ``set_counted``; ``ready`` turns True once every one
    is. Until then ``bands`` is None: a partial count would look like a real one.
    """

    def __init__(self) -> None:
        self._buckets: dict[int, BucketCounts] = {}
        self._live: SortedDict = SortedDict()  # bucket start -> counts, pending != 0
        self._uncounted = 0
        self.total = 0

    # ------------------------------------------------------------------ start-up

    def expect(self, bucket_ms: int, base: int) -> None:
        """The bucket had a file of ``base`` bytes at start; counted later."""
        self._buckets[bucket_ms] = BucketCounts(base, None, False)
        self._uncounted += 1

    def set_counted(self, bucket_ms: int, old_records: int, old_complete: bool) -> None:
        """The start-up count of an ``expect``-ed bucket: ``old_records`` records below
        its base, or ``old_complete`` when a COMPLETE mark covers the base."""
        counts = self._buckets.get(bucket_ms)
        if counts is None:
            return  # deleted by retention while it was being counted
        if counts.old_records is not None:
            raise ValueError(f"bucket {bucket_ms} counted twice")
        before = counts.pending
        counts.old_records = 0 if old_complete else old_records
        counts.old_complete = old_complete
        if old_complete:
            counts.done_old = 0  # entries below base were read before the mark was known
        self._uncounted -= 1
        self._changed(bucket_ms, counts, before)

    @property
    def ready(self) -> bool:
        """Whether every bucket present at start has been counted."""
        return self._uncounted == 0

    # ------------------------------------------------------------------ updates

    def on_scheduled(self, bucket_ms: int, offsets: list[int], dues: list[int]) -> None:
        """The replayer appended records to the bucket (its on_scheduled hook)."""
        counts = self._buckets.get(bucket_ms)
        if counts is None:
            # A bucket without a file at start: everything in it is new.
            counts = self._buckets[bucket_ms] = BucketCounts(0, 0, False)
        counts.new_records += len(offsets)
        self.total += len(offsets)
        if bucket_ms not in self._live:
            self._live[bucket_ms] = counts

    def add_entries(self, bucket_ms: int, entries: Iterable[tuple[int, int]]) -> None:
        """dispatch_log entries ``(kind, schedule_log offset)`` read from the bucket's
        file, each once. Entries that are no record's fate (COMPLETE marks, ROUTE,
        ROUTED) are skipped."""
        counts = self._buckets.get(bucket_ms)
        if counts is None:
            return  # no record known: entries of a file that appeared without any
        before = counts.pending
        for kind, offset in entries:
            if kind not in _DONE:
                continue
            if offset >= counts.base:
                counts.done_new += 1
            elif not counts.old_complete:
                counts.done_old += 1
        self._changed(bucket_ms, counts, before)

    def forget(self, bucket_ms: int) -> None:
        """Retention deleted the bucket's files: drop what is known of it. A record
        appended later starts a new bucket of that name (``on_scheduled``)."""
        counts = self._buckets.pop(bucket_ms, None)
        if counts is None:
            return
        self.total -= counts.pending
        if counts.old_records is None:
            self._uncounted -= 1
        self._live.pop(bucket_ms, None)

    def _changed(self, bucket_ms: int, counts: BucketCounts, before: int) -> None:
        after = counts.pending
        self.total += after - before
        # An uncounted bucket stays live: its count is still to come.
        if after != 0 or counts.old_records is None:
            self._live[bucket_ms] = counts
        else:
            self._live.pop(bucket_ms, None)

    # ------------------------------------------------------------------ reading

    def live(self) -> list[int]:
        """Starts of the buckets that may still hold pending messages, ascending."""
        return list(self._live)

    def bands(self, now_ms: int) -> dict[str, int] | None:
        """Pending messages per horizon band (HORIZONS) at ``now_ms``; None until
        ``ready``. Costs one step per live bucket within a day of now; the rest is the
        total minus those."""
        if not self.ready:
            return None
        out = dict.fromkeys((label for label, _ in HORIZONS), 0)
        near = 0
        last_near = now_ms + int(HORIZONS[-2][1])
        for bucket_ms in self._live.irange(maximum=last_near):
            pending = self._live[bucket_ms].pending
            delta = bucket_ms - now_ms
            label = next(label for label, upper in HORIZONS if delta <= upper)
            out[label] += pending
            near += pending
        out["later"] = self.total - near
        return {label: max(0, count) for label, count in out.items()}

    def oldest_pending_bucket(self) -> int | None:
        """Start (epoch ms) of the oldest bucket with a pending message; None when none
        (or before ``ready``)."""
        if not self.ready:
            return None
        for bucket_ms, counts in self._live.items():
            if counts.pending > 0:
                return bucket_ms
        return None
