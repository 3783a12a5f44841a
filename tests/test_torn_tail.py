"""One rule for torn tail vs corruption: recovery, ``delayd inspect`` and the audit give
the same verdict on the same damage (storage.torn_tail).

Each case builds a damaged data directory; recovery's verdict is what opening the log
does (cut it: torn tail; refuse it, or fail the read below the recovery checkpoint:
corruption), and inspect's and the audit's must say the same, at the same file and byte.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import pyarrow as pa
import pytest

from delayd.audit.kinds import CORRUPT as AUDIT_CORRUPT
from delayd.audit.kinds import TORN_TAIL as AUDIT_TORN_TAIL
from delayd.audit.read.messages import message_batches, schedule_batches
from delayd.audit.spark.sources import list_log
from delayd.inspect import report
from delayd.inspect.files import CORRUPT as INSPECT_CORRUPT
from delayd.inspect.files import TORN_TAIL as INSPECT_TORN_TAIL
from delayd.logs import layout
from delayd.logs.log_files import MESSAGE_LOG, SCHEDULE_LOG, list_files
from delayd.logs.message_log import TYPE_MESSAGE, encode_message
from delayd.logs.schedule_log import encode_scheduled
from delayd.replay import open_replayer
from delayd.replay.state import ReplayCheckpoint, ensure_segment_scale, write_replay_checkpoint
from storage.errors import CorruptionError
from storage.framing import HEADER_SIZE
from storage.fs import REAL_FS
from storage.record_file import RecordFile
from storage.segmented_log import RECOVERY_CHECKPOINT, SegmentedLog
from storage.torn_tail import DEFAULT_MAX_UNSYNCED_BYTES, is_torn_tail
from tests.audit_support import T0
from tests.damage_support import append_bytes, cut, flip_byte

TORN, CORRUPT = "torn", "corrupt"
BUCKET = "202611221000"  # the bucket of T0
SEGMENT_SIZE = 400  # four records a segment


@dataclass(frozen=True)
class Verdict:
    kind: str  # TORN or CORRUPT
    file: str  # the file's name
    position: int  # byte position in that file


def message(i: int) -> bytes:
    return encode_message(T0 + i, i + 1, T0, f"m-{i}".encode(), b"s", None, b"", b"x" * 40)


def write_message_log(data: str, count: int, *, crashed: bool) -> list[int]:
    """Offsets of ``count`` messages in message_log; ``crashed``: as a killed process
    leaves it (flushed, no recovery checkpoint), else closed (checkpoint at its end)."""
    directory = layout.message_log_dir(data)
    with SegmentedLog.open(directory, segment_size=SEGMENT_SIZE) as log:
        offsets = log.append_batch([message(i) for i in range(count)], TYPE_MESSAGE)
    if crashed:
        os.unlink(os.path.join(directory, RECOVERY_CHECKPOINT))
    return offsets


def segment_of(data: str, offset: int) -> tuple[str, int]:
    """The path of the segment holding logical ``offset``, and its base."""
    base = max(f.base for f in list_files(data, MESSAGE_LOG) if f.base <= offset)
    return os.path.join(layout.message_log_dir(data), f"{base:020d}"), base


def write_bucket(
    data: str, count: int, *, replayed: bool, padding: int = 0
) -> tuple[str, list[int]]:
    """A data directory whose message_log holds ``count`` + 1 messages, all due in
    BUCKET, and whose schedule_log bucket holds the first ``count`` of them (then
    ``padding`` bytes of records). ``replayed``: the replay checkpoint is past the last
    message (its copy there too), so recovery never reopens the bucket for a scan; else
    the last message is not replayed yet and recovery scans the bucket from its start.
    Returns the bucket's path and its records' offsets."""
    ensure_segment_scale(REAL_FS, data, 1)
    with SegmentedLog.open(layout.message_log_dir(data)) as log:
        logged = log.append_batch([message(i) for i in range(count + 1)], TYPE_MESSAGE)
        end = log.end_offset
    copied = count + 1 if replayed else count
    path = os.path.join(layout.schedule_log_dir(data), BUCKET)
    with RecordFile.open(path) as record_file:
        payloads = [encode_scheduled(logged[i], message(i)) for i in range(copied)]
        offsets = record_file.append_batch(payloads)
        if padding:
            record_file.append_batch([bytes(padding // 2)] * 2)
    position = end if replayed else logged[count]
    write_replay_checkpoint(REAL_FS, data, ReplayCheckpoint(position, copied + 1, {}))
    return path, offsets


# ---------------------------------------------------------------- the cases


def torn_last_record_of_the_active_segment(data: str) -> Verdict:
    offsets = write_message_log(data, 12, crashed=True)
    path, base = segment_of(data, offsets[-1])
    cut(path, os.path.getsize(path) - 4)
    return Verdict(TORN, os.path.basename(path), offsets[-1] - base)


def zero_filled_tail_of_the_active_segment(data: str) -> Verdict:
    offsets = write_message_log(data, 12, crashed=True)
    path, _ = segment_of(data, offsets[-1])
    size = os.path.getsize(path)
    append_bytes(path, bytes(3000))  # what a crash that extended the file can leave
    return Verdict(TORN, os.path.basename(path), size)


def bad_crc_mid_file_below_the_recovery_checkpoint(data: str) -> Verdict:
    offsets = write_message_log(data, 12, crashed=False)
    path, base = segment_of(data, offsets[-2])
    flip_byte(path, offsets[-2] - base + HEADER_SIZE + 5)
    return Verdict(CORRUPT, os.path.basename(path), offsets[-2] - base)


def damaged_sealed_segment(data: str) -> Verdict:
    offsets = write_message_log(data, 12, crashed=False)
    path, base = segment_of(data, offsets[1])
    assert base == 0 and len(list_files(data, MESSAGE_LOG)) > 2
    flip_byte(path, offsets[1] + HEADER_SIZE + 5)
    return Verdict(CORRUPT, os.path.basename(path), offsets[1])


def damaged_sealed_segment_inside_the_unsynced_window(data: str) -> Verdict:
    # The window spans rolls: a crash can lose the end of a segment sealed since the last
    # flush, so recovery cuts there (and drops the later segments).
    offsets = write_message_log(data, 12, crashed=True)
    path, _ = segment_of(data, offsets[1])
    flip_byte(path, offsets[1] + HEADER_SIZE + 5)
    return Verdict(TORN, os.path.basename(path), offsets[1])


def torn_last_record_of_a_bucket(data: str) -> Verdict:
    path, offsets = write_bucket(data, 5, replayed=False)
    cut(path, os.path.getsize(path) - 4)
    return Verdict(TORN, BUCKET, offsets[-1])


def zero_filled_tail_of_a_bucket(data: str) -> Verdict:
    path, _ = write_bucket(data, 5, replayed=False)
    size = os.path.getsize(path)
    append_bytes(path, bytes(4096))
    return Verdict(TORN, BUCKET, size)


def bad_crc_mid_bucket_inside_the_unsynced_window(data: str) -> Verdict:
    # A later page kept without an earlier one: a power loss can leave this.
    path, offsets = write_bucket(data, 5, replayed=False)
    flip_byte(path, offsets[2] + HEADER_SIZE + 5)
    return Verdict(TORN, BUCKET, offsets[2])


def bad_crc_mid_bucket_before_the_unsynced_window(data: str) -> Verdict:
    path, offsets = write_bucket(data, 5, replayed=False, padding=DEFAULT_MAX_UNSYNCED_BYTES + 4096)
    flip_byte(path, offsets[2] + HEADER_SIZE + 5)
    return Verdict(CORRUPT, BUCKET, offsets[2])


def damaged_tail_of_a_bucket_replayed_to_the_end(data: str) -> Verdict:
    # Recovery reopens it at its full length: it is never cut, so any damage is
    # corruption, however close to its end.
    path, offsets = write_bucket(data, 5, replayed=True)
    flip_byte(path, offsets[-1] + HEADER_SIZE + 5)
    return Verdict(CORRUPT, BUCKET, offsets[-1])


CASES: list[Callable[[str], Verdict]] = [
    torn_last_record_of_the_active_segment,
    zero_filled_tail_of_the_active_segment,
    bad_crc_mid_file_below_the_recovery_checkpoint,
    damaged_sealed_segment,
    damaged_sealed_segment_inside_the_unsynced_window,
    torn_last_record_of_a_bucket,
    zero_filled_tail_of_a_bucket,
    bad_crc_mid_bucket_inside_the_unsynced_window,
    bad_crc_mid_bucket_before_the_unsynced_window,
    damaged_tail_of_a_bucket_replayed_to_the_end,
]


# ---------------------------------------------------------------- the three readers


def recovery_verdict(data: str, copy: str) -> Verdict | None:
    """What starting a server on a copy of ``data`` does: open message_log, recover
    schedule_log (delayd.replay), then read every bucket."""
    shutil.copytree(data, copy)
    sizes = {bucket.name: bucket.size for bucket in list_files(copy, SCHEDULE_LOG)}
    try:
        with SegmentedLog.open(layout.message_log_dir(copy)) as log:
            cut_at = log.recovery.truncated_at
            if cut_at is not None:
                base = max(s.base for s in list_files(copy, MESSAGE_LOG) if s.base <= cut_at)
                return Verdict(TORN, f"{base:020d}", cut_at - base)
            for _ in log.iter_from(log.min_offset):
                pass
            open_replayer(copy, log, segment_scale=1, index=False).close()
    except CorruptionError as exc:
        return Verdict(CORRUPT, os.path.basename(exc.path), exc.offset)
    for bucket in list_files(copy, SCHEDULE_LOG):
        if bucket.size < sizes[bucket.name]:
            return Verdict(TORN, bucket.name, bucket.size)
        try:
            with RecordFile.open(bucket.path, trusted_end=bucket.size) as record_file:
                for _ in record_file.iter_from(0):
                    pass
        except CorruptionError as exc:
            return Verdict(CORRUPT, bucket.name, exc.offset)
    return None


def inspect_verdicts(data: str) -> list[Verdict]:
    kinds = {INSPECT_TORN_TAIL: TORN, INSPECT_CORRUPT: CORRUPT}
    return [
        Verdict(kinds[d.kind], os.path.basename(d.path), d.position)
        for d in report.summary(REAL_FS, data).damages
    ]


def audit_verdicts(data: str) -> list[Verdict]:
    kinds = {AUDIT_TORN_TAIL: TORN, AUDIT_CORRUPT: CORRUPT}
    found = []
    for log, read in ((MESSAGE_LOG, message_batches), (SCHEDULE_LOG, schedule_batches)):
        for file in list_log(data, log):
            rows = pa.Table.from_batches(list(read(file, "s1"))).to_pylist()
            # message_log rows name a logical offset, bucket rows a byte of the file
            found += [
                Verdict(kinds[row["problem"]], file.name, row["offset"] - file.base)
                for row in rows
                if row["problem"] in kinds
            ]
    return found


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.__name__)
def test_recovery_inspect_and_the_audit_agree(tmp_path, case):
    data = str(tmp_path / "data")
    os.makedirs(layout.delay_dir(data))
    ensure_segment_scale(REAL_FS, data, 1)
    expected = case(data)
    assert recovery_verdict(data, str(tmp_path / "copy")) == expected
    assert inspect_verdicts(data) == [expected]
    assert audit_verdicts(data) == [expected]


def test_the_rule_is_the_unsynced_window_above_the_durable_mark():
    window = DEFAULT_MAX_UNSYNCED_BYTES
    assert is_torn_tail(1000, 1000 + window)
    assert not is_torn_tail(1000, 1001 + window)
    assert not is_torn_tail(999, 1000, durable_end=1000)
    assert is_torn_tail(1000, 1000, durable_end=1000)
    assert is_torn_tail(0, 100, max_unsynced_bytes=100)
    assert not is_torn_tail(0, 101, max_unsynced_bytes=100)
