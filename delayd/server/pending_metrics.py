"""Pending messages by horizon, from schedule_log and dispatch_log (the I/O of
delayd.server.pending, and its Prometheus collector).

Three sources feed PendingCounts:

* **At start** (built in the server's blocking ``open``, before the replayer runs):
  every bucket file's length, its *base*. Then, in a worker thread, each bucket is
  counted once: a COMPLETE mark at its base (one small read of dispatch_log's last
  entry) settles it without touching schedule_log; otherwise its SCHEDULED records
  below base are counted by walking their frame headers (storage.scan.count_frames:
  no crc, no payload, a third of a scan's CPU, which matters because this thread
  competes with delivery for the GIL). The cost is proportional to what is not yet
  delivered, read once; it logs progress when it takes long.
* **The replayer's hook**: one call per bucket per append (``on_scheduled``).
* **dispatch_log, incrementally**: every REFRESH_INTERVAL_S a worker thread reads the
  entries appended since the last pass to the bucket files of the live buckets due
  soon (the ones the wheel loads and the sender records into), plus a few later ones
  in turn (cancellations land anywhere). Each entry is read once, CRC-checked by the
  same scanner as the server's; an entry still being written is read next time.

Nothing here scans all logs per scrape: a scrape reads the counts.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import trio
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from delayd.logs import layout, schedule_log
from delayd.logs.buckets import bucket_name, parse_bucket_name
from delayd.logs.dispatch_log import EntryKind, read_last_entry
from delayd.replay.replayer import OnScheduled
from delayd.server.pending import PendingCounts
from delayd.serving.metric_families import labelled
from delayd.timestamps import wall_ms
from storage.errors import CorruptionError
from storage.fs import O_READ, FileSystem
from storage.scan import BadFrame, count_frames, scan_frames

log = logging.getLogger(__name__)

REFRESH_INTERVAL_S = 1.0  # dispatch_log is read this often: the gauge's staleness
SWEEP_BUCKETS = 64  # later buckets read per pass, in turn (for cancellations)
PROGRESS_INTERVAL_S = 2.0  # a long start-up count logs a line this often


def chained(first: OnScheduled | None, second: OnScheduled) -> OnScheduled:
    """One replayer hook calling ``first`` (the wheel's canAdd) and then ``second``."""
    if first is None:
        return second

    def both(bucket_ms: int, offsets: list[int], dues: list[int]) -> None:
        first(bucket_ms, offsets, dues)
        second(bucket_ms, offsets, dues)

    return both


@dataclass(frozen=True, slots=True)
class _Count:
    bucket_ms: int
    records: int
    complete: bool


@dataclass(frozen=True, slots=True)
class _Read:
    bucket_ms: int
    entries: list[tuple[int, int]]  # (kind, schedule_log offset)
    position: int  # where the next pass reads from


class PendingTracker:
    """Keeps a PendingCounts up to date for one data directory; see the module
    docstring. Build it before the replayer runs, chain ``on_scheduled`` into the
    replayer's hook, run ``run`` in the root nursery."""

    def __init__(
        self,
        data_dir: str,
        fs: FileSystem,
        *,
        active_ahead_ms: int,
        clock: Callable[[], int] = wall_ms,
    ) -> None:
        self.fs = fs
        self.schedule_dir = layout.schedule_log_dir(data_dir)
        self.dispatch_dir = layout.dispatch_log_dir(data_dir)
        self.active_ahead_ms = active_ahead_ms  # buckets this close are read every pass
        self.clock = clock
        self.counts = PendingCounts()
        self.on_scheduled = self.counts.on_scheduled
        self._positions: dict[int, int] = {}  # bucket start -> dispatch_log bytes read
        self._sweep_from = -1  # the last later bucket read by the sweep
        self._forgotten: set[int] = set()  # deleted by retention during this pass
        self._bases: list[tuple[int, int]] = []
        for name in sorted(fs.listdir(self.schedule_dir)):
            try:
                bucket_ms = parse_bucket_name(name)
            except ValueError:
                continue
            base = self._size(os.path.join(self.schedule_dir, name))
            self.counts.expect(bucket_ms, base)
            self._bases.append((bucket_ms, base))

    # ------------------------------------------------------------------ the task

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Count what was there at start, then read dispatch_log every
        REFRESH_INTERVAL_S; runs until cancelled."""
        task_status.started()
        await self.count_at_start()
        while True:
            await self.refresh()
            await trio.sleep(REFRESH_INTERVAL_S)

    async def count_at_start(self) -> None:
        """Count every bucket that had a file at start (in a worker thread)."""
        # Abandoned on cancel: a shutdown must not wait for a long count to finish.
        counted = await trio.to_thread.run_sync(
            self._count_at_start, self._bases, abandon_on_cancel=True
        )
        for count in counted:
            self.counts.set_counted(count.bucket_ms, count.records, count.complete)
        self._bases = []

    async def refresh(self) -> None:
        """One pass over dispatch_log (see the module docstring)."""
        self._forgotten = set()
        wanted = self._to_read(self.clock())
        if not wanted:
            return
        for read in await trio.to_thread.run_sync(self._read_entries, wanted):
            if read.bucket_ms in self._forgotten:
                continue
            self._positions[read.bucket_ms] = read.position
            self.counts.add_entries(read.bucket_ms, read.entries)

    def forget(self, bucket_ms: int) -> None:
        """Retention deleted the bucket's files (delayd.server.retention)."""
        self.counts.forget(bucket_ms)
        self._positions.pop(bucket_ms, None)
        self._forgotten.add(bucket_ms)  # a read in flight must not bring it back

    def _to_read(self, now_ms: int) -> list[tuple[int, int]]:
        """(bucket, position) of the buckets this pass reads: the live ones up to
        ``active_ahead_ms`` from now, and SWEEP_BUCKETS later ones from where the last
        sweep stopped, round the list."""
        live = self.counts.live()
        near = [b for b in live if b <= now_ms + self.active_ahead_ms]
        later = live[len(near) :]
        if later:
            start = next((i for i, b in enumerate(later) if b > self._sweep_from), 0)
            swept = (later[start:] + later[:start])[:SWEEP_BUCKETS]
            self._sweep_from = swept[-1]
            near += swept
        return [(b, self._positions.get(b, 0)) for b in near]

    # ------------------------------------------------------------------ worker threads

    def _size(self, path: str) -> int:
        try:
            fd = self.fs.open(path, O_READ)
        except FileNotFoundError:
            return 0
        try:
            return self.fs.fsize(fd)
        finally:
            self.fs.close(fd)

    def _count_at_start(self, bases: list[tuple[int, int]]) -> list[_Count]:
        """The start-up count of every bucket (blocking; see the module docstring)."""
        total_bytes = sum(base for _, base in bases)
        started = last_report = time.monotonic()
        done_bytes = 0
        out = []
        for index, (bucket_ms, base) in enumerate(bases):
            try:
                last = read_last_entry(self.fs, self._dispatch_path(bucket_ms))
            except CorruptionError:
                last = None  # counted from schedule_log; the server reports the damage
            if last is not None and last.kind is EntryKind.COMPLETE and last.offset == base:
                out.append(_Count(bucket_ms, 0, True))
            else:
                out.append(_Count(bucket_ms, self._count_records(bucket_ms, base), False))
                done_bytes += base
            now = time.monotonic()
            if now - last_report >= PROGRESS_INTERVAL_S:
                last_report = now
                log.info(
                    "counting pending messages: %d of %d buckets, %d of at most %d bytes (%.0f s)",
                    index + 1,
                    len(bases),
                    done_bytes,
                    total_bytes,
                    now - started,
                )
        if time.monotonic() - started >= PROGRESS_INTERVAL_S:
            log.info("counted pending messages in %d buckets", len(bases))
        return out

    def _schedule_path(self, bucket_ms: int) -> str:
        return os.path.join(self.schedule_dir, bucket_name(bucket_ms))

    def _dispatch_path(self, bucket_ms: int) -> str:
        return os.path.join(self.dispatch_dir, bucket_name(bucket_ms))

    def _count_records(self, bucket_ms: int, base: int) -> int:
        """SCHEDULED records below ``base`` of the bucket's schedule_log file."""
        path = self._schedule_path(bucket_ms)
        try:
            fd = self.fs.open(path, O_READ)
        except FileNotFoundError:
            return 0
        try:
            # Headers only, no crc: a gauge. The loader checks each record it reads.
            count, bad = count_frames(self.fs, fd, path, 0, base, schedule_log.TYPE_SCHEDULED)
        finally:
            self.fs.close(fd)
        if bad is not None:
            # Below a length the replayer made durable: damage, which the loader will
            # report when it reads the bucket. Count what could be walked and say so.
            log.warning("counting pending messages: %s @ %d: %s", path, bad.position, bad)
        return count

    def _read_entries(self, wanted: list[tuple[int, int]]) -> list[_Read]:
        """The dispatch_log entries of each bucket from its position to its end."""
        out = []
        for bucket_ms, position in wanted:
            path = self._dispatch_path(bucket_ms)
            entries: list[tuple[int, int]] = []
            try:
                fd = self.fs.open(path, O_READ)
            except FileNotFoundError:
                continue
            end = position
            try:
                frames = scan_frames(self.fs, fd, path, 0, position, self.fs.fsize(fd))
                for record in frames:
                    entries.append((record.type, int.from_bytes(record.payload[:8], "little")))
                    end = record.next_offset
            except BadFrame:
                pass  # an entry being written, or a torn tail not cut yet: next pass
            finally:
                self.fs.close(fd)
            out.append(_Read(bucket_ms, entries, end))
        return out


class PendingCollector(Collector):
    """``delayd_pending_messages{horizon}`` and the oldest undelivered bucket."""

    def __init__(self, tracker: PendingTracker) -> None:
        self.tracker = tracker

    def collect(self) -> Iterator[Metric]:
        counts, now_ms = self.tracker.counts, self.tracker.clock()
        bands = counts.bands(now_ms)
        if bands is None:
            return  # still counting at start: absent, not a wrong number
        yield labelled(
            GaugeMetricFamily,
            "delayd_pending_messages",
            "Messages in schedule_log without a dispatch_log entry, by horizon of their "
            "bucket's start from now (bands do not overlap).",
            "horizon",
            bands.items(),
        )
        oldest = GaugeMetricFamily(
            "delayd_store_oldest_undelivered_bucket_start_timestamp_seconds",
            "Start (Unix time, seconds) of the oldest schedule_log bucket holding a message "
            "without a dispatch_log entry; no sample when there is none.",
        )
        bucket_ms = counts.oldest_pending_bucket()
        if bucket_ms is not None:
            oldest.add_metric([], bucket_ms / 1000)
        yield oldest
