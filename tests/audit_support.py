"""Data directories for the audit tests, written by the project's own writers.

``DelayData`` appends MESSAGE records and cancel / reschedule tombstones to message_log
(SegmentedLog), SCHEDULED records to schedule_log buckets and entries to dispatch_log
buckets (BucketFiles, RecordFile), encoded by the logs' codecs — so a test can plant
exactly the faults it wants (a missing entry, a second entry, a record scheduled twice,
a reschedule without its copy) in files the audit reads as it would read a server's.
``sends_and_cancels`` writes ids sent twice and cancels contradicted by a delivery, as a
server without intake's duplicate check leaves them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from delayd.logs import layout, message_log, tombstone
from delayd.logs.bucket_files import BucketFiles
from delayd.logs.buckets import bucket_name, bucket_of
from delayd.logs.dispatch_log import EntryKind, check_group_name, encode_entry
from delayd.logs.message_log import TYPE_MESSAGE, MessageRecord, encode_record
from delayd.logs.schedule_log import TYPE_SCHEDULED, encode_scheduled
from delayd.logs.tombstone import Tombstone
from delayd.replay.state import ReplayCheckpoint, ensure_segment_scale, write_replay_checkpoint
from storage.fs import REAL_FS
from storage.segmented_log import SegmentedLog

T0 = 1_795_341_600_000  # 2026-11-22T10:00:00Z
MINUTE = 60_000


@dataclass(frozen=True)
class Scheduled:
    """Where one message ended up: its schedule_log record and the message_log record
    that record names (a rescheduled copy names the RESCHEDULE tombstone)."""

    message_id: str
    due_ms: int
    bucket_ms: int
    offset: int  # in the bucket's schedule_log file
    message_log_offset: int
    payload: bytes = field(default=b"", repr=False)  # the MESSAGE payload it holds

    @property
    def bucket(self) -> str:
        return bucket_name(self.bucket_ms)


class DelayData:
    """A data directory being written; use as a context manager (closes the files).

    Buckets are one minute wide (segment_scale 1, stored as the server stores it), and
    closing writes the replay checkpoint at the end of message_log, as a server that
    replayed everything leaves it: damage the audit finds in a bucket is then judged as
    recovery would judge it in a bucket it never reopens for a scan (delayd.logs.log_files).
    """

    def __init__(self, root: str, *, segment_size: int = 1 << 20) -> None:
        self.root = root
        ensure_segment_scale(REAL_FS, root, 1)
        self.message_log = SegmentedLog.open(
            layout.message_log_dir(root), segment_size=segment_size
        )
        self.schedule_log = BucketFiles(layout.schedule_log_dir(root))
        self.dispatch_log = BucketFiles(layout.dispatch_log_dir(root))
        self.sequence = 0

    def __enter__(self) -> DelayData:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        end = self.message_log.end_offset
        self.message_log.close()
        self.schedule_log.close()
        self.dispatch_log.close()
        checkpoint = ReplayCheckpoint(end, self.sequence + 1, {})
        write_replay_checkpoint(REAL_FS, self.root, checkpoint)

    def accept(
        self,
        message_id: str,
        due_ms: int,
        *,
        subject: str = "orders.timeout",
        key: str | None = None,
        body: bytes = b"body",
        copies: int = 1,
    ) -> Scheduled | None:
        """Append a message to message_log and ``copies`` SCHEDULED records of it to its
        bucket (1 as the replayer does; 0 or 2 plant a fault). Returns the first."""
        self.sequence += 1
        payload = encode_record(
            MessageRecord(
                due_ms, self.sequence, due_ms - MINUTE, message_id, subject, key, {}, body
            )
        )
        (message_log_offset,) = self.message_log.append_batch([payload], TYPE_MESSAGE)
        bucket_ms = bucket_of(due_ms, 1)
        scheduled = encode_scheduled(message_log_offset, payload)
        offsets = self.schedule_log.append_batch(bucket_ms, [scheduled] * copies, TYPE_SCHEDULED)
        if not offsets:
            return None
        return Scheduled(message_id, due_ms, bucket_ms, offsets[0], message_log_offset, payload)

    def tombstone(self, message_id: str, receive_ms: int, due_ms: int | None = None) -> int:
        """Append a CANCEL tombstone (``due_ms`` None) or a RESCHEDULE to ``due_ms`` to
        message_log, and nothing else; returns its message_log offset."""
        stone = Tombstone(message_id, receive_ms, due_ms)
        (offset,) = self.message_log.append_batch([tombstone.encode(stone)], stone.rtype)
        return offset

    def cancel(self, record: Scheduled, at_ms: int) -> int:
        """A cancel of a pending message as the server records it: the tombstone, then a
        CANCELLED entry for the record. Returns the tombstone's offset."""
        offset = self.tombstone(record.message_id, at_ms)
        self.entry(record, at_ms, EntryKind.CANCELLED)
        return offset

    def reschedule(
        self, record: Scheduled, due_ms: int, at_ms: int, *, copies: int = 1
    ) -> Scheduled | None:
        """A reschedule of a pending message as the server records it (docs/cancel.md):
        the RESCHEDULE tombstone, a RESCHEDULED entry for the record, and ``copies``
        copies of it (1 as the server does; 0 or 2 plant a fault) — the MESSAGE payload
        with the new due time, behind the tombstone's message_log offset. Returns the
        first copy."""
        offset = self.tombstone(record.message_id, at_ms, due_ms)
        self.entry(record, at_ms, EntryKind.RESCHEDULED)
        # As delayd.server.cancels builds it: due_ms is the payload's first field.
        moved = message_log.DUE_MS.pack(due_ms) + record.payload[message_log.DUE_MS.size :]
        bucket_ms = bucket_of(due_ms, 1)
        scheduled = encode_scheduled(offset, moved)
        offsets = self.schedule_log.append_batch(bucket_ms, [scheduled] * copies, TYPE_SCHEDULED)
        if not offsets:
            return None
        return Scheduled(record.message_id, due_ms, bucket_ms, offsets[0], offset, moved)

    def entry(
        self,
        record: Scheduled,
        at_ms: int,
        kind: EntryKind = EntryKind.DISPATCHED,
        group: str = "default",
    ) -> int:
        """Append a dispatch_log entry about ``record``; returns its byte position."""
        withdrawn = kind in (EntryKind.CANCELLED, EntryKind.RESCHEDULED)
        group_bytes = b"" if withdrawn else check_group_name(group)
        (position,) = self.dispatch_log.append_batch(
            record.bucket_ms, [encode_entry(record.offset, at_ms, group_bytes)], kind
        )
        return position

    def complete(self, bucket_ms: int) -> None:
        """A COMPLETE mark covering the bucket's schedule_log file as it is now."""
        length = self.schedule_log.get(bucket_ms).end_offset
        self.dispatch_log.append_batch(bucket_ms, [encode_entry(length, T0)], EntryKind.COMPLETE)


def sends_and_cancels(data: DelayData, as_of_ms: int) -> dict[str, Scheduled]:
    """Ids sent twice, and cancels answered CANCELLED yet delivered (as a server that
    scheduled both sends withdrew only the newer one); and what is not a finding: a
    cancel that withdrew the only record, a message moved (a second record of its id,
    not a second send), moved and then cancelled, a cancel answered ALREADY_DELIVERED.
    The ids sent twice and still pending are due after ``as_of_ms``. Returns records
    by name (tests/test_audit.py; docs/audit.md shows the report of them)."""
    kept = {}
    # Sent twice, both pending.
    kept["twice"] = data.accept("twice-1", as_of_ms + 10 * MINUTE)
    kept["twice-again"] = data.accept("twice-1", as_of_ms + 20 * MINUTE)
    # Sent twice; the cancel withdrew the newer send, the older one was sent after it.
    kept["lost"] = data.accept("cancel-lost-1", T0 + 5_000)
    kept["lost-newer"] = data.accept("cancel-lost-1", T0 + MINUTE + 5_000)
    data.cancel(kept["lost-newer"], at_ms=T0 + 1_000)
    data.entry(kept["lost"], kept["lost"].due_ms + 2)
    # Sent twice; the older one was sent before the cancel withdrew the newer one.
    kept["early"] = data.accept("sent-before-1", T0 + 2_000)
    data.entry(kept["early"], kept["early"].due_ms + 1)
    kept["early-newer"] = data.accept("sent-before-1", T0 + 2 * MINUTE)
    data.cancel(kept["early-newer"], at_ms=T0 + 10_000)
    cancels_and_moves_done_right(data)
    return kept


def cancels_and_moves_done_right(data: DelayData) -> None:
    """What is not a finding: a cancel that withdrew the only record, a message moved
    (a second record of its id, not a second send), moved and then cancelled, a cancel
    answered ALREADY_DELIVERED (nothing written but the tombstone)."""
    data.cancel(data.accept("cancelled-ok", T0 + MINUTE + 1_000), at_ms=T0)
    moved = data.accept("moved-ok", T0 + 3_000)
    copy = data.reschedule(moved, T0 + MINUTE + 3_000, at_ms=T0)
    data.entry(copy, copy.due_ms + 4)
    moved = data.accept("moved-cancelled", T0 + 4_000)
    data.cancel(data.reschedule(moved, T0 + 2 * MINUTE + 4_000, at_ms=T0), at_ms=T0 + 1)
    sent = data.accept("sent-then-cancel", T0 + 6_000)
    data.entry(sent, sent.due_ms + 3)
    data.tombstone("sent-then-cancel", T0 + 20_000)


BROKER_GROUPS = ("bg-1", "bg-2")


def group_copy(
    root: str, group: str, count: int, *, undelivered: frozenset[int] = frozenset()
) -> list[Scheduled]:
    """One member's copy of delay group ``group``'s logs: ``count`` messages (ids
    ``group-0``, ``group-1``, …), one every 10 s from T0 + 1 s (six to a one-minute
    bucket), each dispatched 3 ms after its due time to one of two broker groups
    (by turns) — but the ones whose index is in ``undelivered``. The writers are
    deterministic, so a copy with fewer messages is a byte-for-byte prefix of one with
    more, as a follower that lags holds."""
    with DelayData(root) as data:
        records = [data.accept(f"{group}-{i}", T0 + 1000 + i * 10_000) for i in range(count)]
        for i, record in enumerate(records):
            if i not in undelivered:
                data.entry(record, record.due_ms + 3, group=BROKER_GROUPS[i % 2])
    return records


def schedule_path(root: str, bucket_ms: int) -> str:
    return os.path.join(layout.schedule_log_dir(root), bucket_name(bucket_ms))


def dispatch_path(root: str, bucket_ms: int) -> str:
    return os.path.join(layout.dispatch_log_dir(root), bucket_name(bucket_ms))


# Tiny inputs: compiling generated code for every query plan would cost more than
# interpreting it (NO_CODEGEN is Spark's own test setting); and a JVM that lives for a
# minute gains nothing from the optimising JIT compiler (C2), whose compiling competes
# with the tests for the cores — C1 alone starts Spark ~20% faster (measured).
SPARK_TEST_CONF = {
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.codegen.wholeStage": "false",
    "spark.sql.codegen.factoryMode": "NO_CODEGEN",
    "spark.sql.adaptive.enabled": "false",
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1",
}


def read_table(out: str, name: str) -> list[dict]:
    """The rows of one of the audit's Parquet tables."""
    import pyarrow.parquet as pq

    return pq.read_table(os.path.join(out, name)).to_pylist()
