"""PendingCounts (delayd.server.pending): the arithmetic of pending messages per bucket
and by horizon, driven by plain calls — the hook, start-up counts, dispatch entries;
and PendingTracker (delayd.server.pending_metrics) over real log files."""

from __future__ import annotations

import logging
import os

from delayd.logs import layout, message_log, schedule_log
from delayd.logs.bucket_files import BucketFiles
from delayd.logs.buckets import bucket_name
from delayd.logs.dispatch_files import DispatchFiles
from delayd.logs.dispatch_log import EntryKind
from delayd.logs.message_log import MessageRecord
from delayd.server import pending_metrics
from delayd.server.pending import PendingCounts
from delayd.server.pending_metrics import PendingTracker
from storage.fs import REAL_FS

MIN = 60_000
NOW = 1_000 * MIN  # a bucket-aligned "now"
DISPATCHED, DEAD, CANCELLED, COMPLETE = (
    EntryKind.DISPATCHED.value,
    EntryKind.DEAD_LETTERED.value,
    EntryKind.CANCELLED.value,
    EntryKind.COMPLETE.value,
)


def schedule(counts: PendingCounts, bucket_ms: int, n: int, first_offset: int = 0) -> None:
    for i in range(n):
        counts.on_scheduled(bucket_ms, [first_offset + 100 * i], [bucket_ms + 1])


def test_bands_by_bucket_start_and_later_as_the_rest():
    counts = PendingCounts()
    schedule(counts, NOW - 5 * MIN, 1)  # overdue: 1m
    schedule(counts, NOW + MIN, 2)  # starts exactly 1 min ahead: 1m
    schedule(counts, NOW + 2 * MIN, 3)  # 10m
    schedule(counts, NOW + 59 * MIN, 4)  # 1h
    schedule(counts, NOW + 23 * 60 * MIN, 5)  # 1d
    schedule(counts, NOW + 3 * 24 * 60 * MIN, 6)  # later
    assert counts.bands(NOW) == {"1m": 3, "10m": 3, "1h": 4, "1d": 5, "later": 6}
    assert counts.total == 21
    assert counts.oldest_pending_bucket() == NOW - 5 * MIN
    # An hour on, everything is an hour nearer.
    assert counts.bands(NOW + 60 * MIN) == {"1m": 10, "10m": 0, "1h": 0, "1d": 5, "later": 6}


def test_every_done_kind_counts_and_complete_marks_do_not():
    counts = PendingCounts()
    schedule(counts, NOW, 5)
    counts.add_entries(NOW, [(DISPATCHED, 0), (DEAD, 100), (CANCELLED, 200), (COMPLETE, 500)])
    assert counts.bands(NOW)["1m"] == 2
    counts.add_entries(NOW, [(DISPATCHED, 300), (DISPATCHED, 400)])
    assert counts.bands(NOW)["1m"] == 0 and counts.total == 0
    assert counts.live() == [] and counts.oldest_pending_bucket() is None
    schedule(counts, NOW, 1, first_offset=500)  # a late record in the same bucket
    assert counts.live() == [NOW] and counts.bands(NOW)["1m"] == 1


def test_start_up_count_splits_entries_at_the_base():
    counts = PendingCounts()
    counts.expect(NOW, base=300)  # 3 records of 100 bytes at start
    counts.expect(NOW + MIN, base=200)  # COMPLETE at its base
    assert counts.bands(NOW) is None and counts.oldest_pending_bucket() is None
    schedule(counts, NOW, 2, first_offset=300)  # appended after start
    counts.add_entries(NOW, [(DISPATCHED, 0), (DISPATCHED, 300)])  # one old, one new
    counts.add_entries(NOW + MIN, [(DISPATCHED, 0), (DISPATCHED, 100), (COMPLETE, 200)])
    schedule(counts, NOW + MIN, 1, first_offset=200)
    counts.set_counted(NOW, 3, False)
    assert counts.bands(NOW) is None  # one bucket still uncounted
    counts.set_counted(NOW + MIN, 0, True)
    # NOW: 3 old - 1 + 2 new - 1 = 3; NOW + MIN: old side settled, 1 new.
    assert counts.bands(NOW) == {"1m": 4, "10m": 0, "1h": 0, "1d": 0, "later": 0}
    assert counts.total == 4


def test_entries_of_a_complete_bucket_below_its_base_are_ignored_after_the_count():
    counts = PendingCounts()
    counts.expect(NOW, base=200)
    counts.set_counted(NOW, 0, True)
    assert counts.live() == []
    schedule(counts, NOW, 1, first_offset=200)
    # Read from the file's start: the old entries, then the new record's.
    counts.add_entries(NOW, [(DISPATCHED, 0), (DISPATCHED, 100), (COMPLETE, 200)])
    assert counts.total == 1
    counts.add_entries(NOW, [(DISPATCHED, 200)])
    assert counts.total == 0 and counts.live() == []


# --------------------------------------------------------------------- PendingTracker


def write_bucket(data: str, bucket_ms: int, count: int) -> list[int]:
    """``count`` SCHEDULED records in the bucket's schedule_log file; their offsets."""
    payloads = [
        schedule_log.encode_scheduled(
            i,
            message_log.encode_record(
                MessageRecord(bucket_ms + i, i + 1, bucket_ms, f"m{bucket_ms}-{i}", "orders")
            ),
        )
        for i in range(count)
    ]
    with BucketFiles(layout.schedule_log_dir(data)) as files:
        return files.append_batch(bucket_ms, payloads, schedule_log.TYPE_SCHEDULED)


async def test_tracker_counts_the_logs_at_start_then_follows_hook_and_dispatch_log(
    tmp_path, monkeypatch, caplog
):
    """Three buckets on disk: A due in 5 min with 3 records and no entry, B 10 min ago
    with 2 records, both dispatched and a COMPLETE mark, C 5 min ago with 2 records,
    one dispatched. Then the hook adds one to A and the sender records C's second."""
    data = str(tmp_path)
    a, b, c = NOW + 5 * MIN, NOW - 10 * MIN, NOW - 5 * MIN
    write_bucket(data, a, 3)
    b_offsets = write_bucket(data, b, 2)
    c_offsets = write_bucket(data, c, 2)
    dispatch = DispatchFiles(layout.dispatch_log_dir(data))
    dispatch.record(b, EntryKind.DISPATCHED, b_offsets, NOW, b"local")
    dispatch.mark_complete(
        b, os.path.getsize(f"{layout.schedule_log_dir(data)}/{bucket_name(b)}"), NOW
    )
    dispatch.record(c, EntryKind.DISPATCHED, c_offsets[:1], NOW, b"local")
    dispatch.flush()
    monkeypatch.setattr(pending_metrics, "PROGRESS_INTERVAL_S", 0.0)  # report every bucket

    tracker = PendingTracker(data, REAL_FS, active_ahead_ms=3 * MIN, clock=lambda: NOW)
    assert tracker.counts.bands(NOW) is None
    with caplog.at_level(logging.INFO, logger="delayd.server.pending_metrics"):
        await tracker.count_at_start()
    await tracker.refresh()
    assert tracker.counts.bands(NOW) == {"1m": 1, "10m": 3, "1h": 0, "1d": 0, "later": 0}
    assert tracker.counts.oldest_pending_bucket() == c
    a_size = os.path.getsize(f"{layout.schedule_log_dir(data)}/{bucket_name(a)}")
    tracker.on_scheduled(a, [a_size], [a + 7])  # as the replayer's hook would
    dispatch.record(c, EntryKind.DISPATCHED, c_offsets[1:], NOW, b"local")
    dispatch.flush()
    await tracker.refresh()
    assert tracker.counts.bands(NOW) == {"1m": 0, "10m": 4, "1h": 0, "1d": 0, "later": 0}
    assert tracker.counts.oldest_pending_bucket() == a
    await tracker.refresh()  # every entry is read once
    assert tracker.counts.total == 4
    dispatch.close()
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("counting pending messages: 3 of 3 buckets") for line in lines)
