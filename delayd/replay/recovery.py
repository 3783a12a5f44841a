"""Making schedule_log agree with the replay checkpoint after a crash (docs/replay.md).

The invariant the replayer keeps while running: a checkpoint at message_log offset C is
written only after every schedule record of the message_log records below C is durable.
So after a crash, what schedule_log may hold beyond what C covers is exactly the records
of message_log records at or past C — all appended after C was written, each at the end
of its bucket's file (one replayer appends in message_log order), each carrying its
message_log offset. Recovery removes them:

1. Scan message_log from C to its end. Every record there was either replayed after C
   (its schedule record may be on disk, whole, torn or lost) or not yet: the set of
   buckets those records map to contains every bucket that can hold a suffix to cut.
   A RESCHEDULE tombstone maps to the bucket of its new due time, where its replay
   appended the moved copy (stamped with the tombstone's offset); a CANCEL to none.
   The same scan finds the last sequence, from which intake numbers on, and the
   buckets a RETIRE_BUCKET record after C names (delayd.logs.retirement): a replay
   by an older version, which deleted before it checkpointed at the record, may have
   deleted the file C lists and a later record created a new one of that name, so
   the length C lists is not trusted for them.
2. For each such bucket that has a file, cut it at the first record whose message_log
   offset is >= C. The checkpoint lists the length of every bucket open when it was
   written (all durable then); for those the cut is that length, checked against the
   record there, without scanning the file. Others are scanned from their start.
3. Every other bucket holds only records below C, flushed before C was written: whole
   and durable, so it can later be opened for append at its full length.

After this the replayer appends from C again; the bytes it writes are a function of the
message_log records alone, so every record lands where it had been (stable offsets).
Cutting is idempotent: a crash during recovery leaves the same C and the same work.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from delayd.logs import message_log, retirement, schedule_log
from delayd.logs.bucket_files import BucketFiles
from delayd.logs.buckets import bucket_of
from delayd.logs.log_files import MESSAGE_LOG, list_files
from delayd.replay.state import ReplayCheckpoint, read_replay_checkpoint, read_segment_scale
from storage.errors import CorruptionError
from storage.fs import O_READ, FileSystem
from storage.record_file import RecordFile
from storage.scan import BadFrame, Record, scan_frames
from storage.segmented_log import SegmentedLog


@dataclass
class RecoveryReport:
    """What recovery found and did."""

    position: int  # the checkpoint's message_log offset
    records_after_checkpoint: int = 0
    bytes_after_checkpoint: int = 0
    next_sequence: int = 1  # the sequence intake assigns next
    buckets_checked: int = 0  # buckets the records after the checkpoint map to
    buckets_scanned: int = 0  # of those, files scanned from their start (no known length)
    cut_bytes: dict[int, int] = field(default_factory=dict)  # bucket start ms -> bytes cut


def recover(
    log: SegmentedLog,
    buckets: BucketFiles,
    checkpoint: ReplayCheckpoint,
    segment_scale: int,
) -> RecoveryReport:
    """Cut from schedule_log every record at or past the checkpoint (see the module
    docstring). ``log`` must be freshly opened (its recovery done, so all of it is
    durable). Raises CorruptionError when message_log or a bucket contradicts the
    checkpoint, RecordFormatError for a record type this version cannot replay."""
    position = checkpoint.position
    report = RecoveryReport(position=position, next_sequence=checkpoint.next_sequence)
    if not log.min_offset <= position <= log.end_offset:
        raise CorruptionError(
            log.directory,
            position,
            0,
            f"the replay checkpoint is at message_log offset {position}, but message_log "
            f"holds [{log.min_offset}, {log.end_offset}): records the replayer has not "
            "copied to schedule_log are missing",
        )
    touched: dict[int, None] = {}  # insertion-ordered set of bucket starts
    retired: set[int] = set()
    last_sequence = checkpoint.next_sequence - 1
    for record in log.iter_from(position):
        message_log.check_type(record.type, log.directory, record.offset)
        bucket = replayed_bucket(record, segment_scale)
        if bucket is not None:
            touched[bucket] = None
        _note_retired(record, retired)
        if record.type == message_log.TYPE_MESSAGE:
            last_sequence = max(last_sequence, message_log.sequence_of(record.payload))
        report.records_after_checkpoint += 1
    report.bytes_after_checkpoint = log.end_offset - position
    report.next_sequence = last_sequence + 1
    report.buckets_checked = len(touched)
    checkpoint = trusting(checkpoint, retired)
    for start_ms in touched:
        if not buckets.exists(start_ms):
            continue
        known = checkpoint.bucket_sizes.get(start_ms)
        record_file = buckets.get(start_ms, trusted_end=trusted_end(checkpoint, start_ms))
        if known is None:
            report.buckets_scanned += 1
            cut = _first_at_or_past(record_file, position)
        else:
            cut = known
            _check_cut(record_file, cut, position)
        if cut < record_file.end_offset:
            report.cut_bytes[start_ms] = record_file.end_offset - cut
            record_file.truncate(cut)
    return report


def replayed_bucket(record: Record, segment_scale: int) -> int | None:
    """The bucket (start, epoch ms) whose schedule_log file the replay of message_log
    ``record`` appends to: a MESSAGE's due time's; a RESCHEDULE's new due time's, where
    it appends the moved copy (its due_ms is at the same offset as a message's:
    delayd.logs.tombstone); None for a CANCEL, which appends nothing."""
    if record.type == message_log.TYPE_MESSAGE or record.type in message_log.RESCHEDULE_TYPES:
        return bucket_of(message_log.due_ms_of(record.payload), segment_scale)
    return None


def _note_retired(record: Record, retired: set[int]) -> None:
    if record.type == message_log.TYPE_RETIRE_BUCKET:
        retired.add(retirement.decode(record.payload).start_ms)


def trusting(checkpoint: ReplayCheckpoint, retired: set[int]) -> ReplayCheckpoint:
    """``checkpoint`` without the lengths of the buckets ``retired`` by records after
    it: the file of that name may be a new one (module docstring, step 1)."""
    if not retired & checkpoint.bucket_sizes.keys():
        return checkpoint
    sizes = {b: n for b, n in checkpoint.bucket_sizes.items() if b not in retired}
    return ReplayCheckpoint(checkpoint.position, checkpoint.next_sequence, sizes)


def trusted_end(checkpoint: ReplayCheckpoint, bucket_ms: int) -> int:
    """Where recovery starts scanning the file of a bucket that records after
    ``checkpoint`` map to: the length the checkpoint lists for it (durable then), else
    its start."""
    return checkpoint.bucket_sizes.get(bucket_ms, 0)


def scanned_buckets(fs: FileSystem, data_dir: str) -> dict[int, int] | None:
    """What recovery would scan of schedule_log, found without changing anything: each
    bucket it opens with a scan (start ms -> the trusted_end it scans from); every other
    bucket file is reopened at its full length, so nothing in it is ever cut as a torn
    tail. None when the data directory does not say: no segment_scale stored yet, or a
    checkpoint that cannot be read (the server refuses to start then).

    For ``delayd inspect`` and the audit, which judge damage as recovery would
    (storage.torn_tail)."""
    try:
        segment_scale = read_segment_scale(fs, data_dir)
        checkpoint = read_replay_checkpoint(fs, data_dir)
    except CorruptionError:
        return None
    if segment_scale is None:
        return None
    touched: list[int] = []
    retired: set[int] = set()
    for record in _records_from(fs, data_dir, checkpoint.position):
        bucket = replayed_bucket(record, segment_scale)
        if bucket is not None:
            touched.append(bucket)
        _note_retired(record, retired)
    checkpoint = trusting(checkpoint, retired)
    return {bucket: trusted_end(checkpoint, bucket) for bucket in touched}


def _records_from(fs: FileSystem, data_dir: str, position: int) -> Iterator[Record]:
    """message_log's records from ``position``, read-only, up to the first bad frame
    (where the log's own recovery cuts a torn tail or refuses to open)."""
    for segment in list_files(data_dir, MESSAGE_LOG, fs):
        if segment.base + segment.size <= position:
            continue
        fd = fs.open(segment.path, O_READ)
        try:
            start = max(position - segment.base, 0)
            yield from scan_frames(fs, fd, segment.path, segment.base, start, segment.size)
        except BadFrame:
            return
        finally:
            fs.close(fd)


def _first_at_or_past(record_file: RecordFile, position: int) -> int:
    """Offset of the first record whose message_log offset is >= position (or the end)."""
    for record in record_file.iter_from(0):
        schedule_log.check_type(record.type, record_file.path, record.offset)
        if schedule_log.message_log_offset_of(record.payload) >= position:
            return record.offset
    return record_file.end_offset


def _check_cut(record_file: RecordFile, cut: int, position: int) -> None:
    """The record at the checkpoint's known length must come from past the checkpoint."""
    if cut >= record_file.end_offset:
        return
    record = record_file.read(cut)
    origin = schedule_log.message_log_offset_of(record.payload)
    if origin < position:
        raise CorruptionError(
            record_file.path,
            cut,
            record_file.end_offset - cut,
            f"the replay checkpoint says {os.path.basename(record_file.path)} was "
            f"{cut} bytes long at message_log offset {position}, but the record there "
            f"comes from message_log offset {origin}, below the checkpoint",
        )
