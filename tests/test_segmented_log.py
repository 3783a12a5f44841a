"""SegmentedLog on real files: appends, rolls, reopen, torn tails and corruption."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage.errors import CorruptionError, LogClosedError, RecordTooLargeError
from storage.framing import HEADER_SIZE, TYPE_DATA
from storage.segmented_log import RECOVERY_CHECKPOINT, SegmentedLog, segment_name
from tests.damage_support import flip_byte

NO_CHECKPOINT = 1 << 40  # keep the recovery checkpoint out of tests that crash by hand


def segment_files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.isdigit())


def test_append_read_iterate_across_rolls(tmp_path):
    with SegmentedLog.open(str(tmp_path), segment_size=256) as log:
        payloads = [bytes([i % 251]) * (i % 40) for i in range(200)]
        offsets = log.append_batch(payloads[:50]) + [log.append(p) for p in payloads[50:]]
        assert offsets == sorted(offsets)
        assert len(segment_files(str(tmp_path))) > 10  # it really rolled
        assert [log.read(o).payload for o in offsets] == payloads
        records = list(log.iter_from(0))
        assert [r.offset for r in records] == offsets
        assert [r.payload for r in records] == payloads
        # next_offset chains the records, across END_OF_SEGMENT markers too
        assert next(log.iter_from(records[77].next_offset)) == records[78]
    # segment files are named by the logical offset of their first byte
    names = segment_files(str(tmp_path))
    assert names[0] == segment_name(0)
    assert all(len(n) == 20 for n in names)


def test_segment_file_names_match_their_base_offsets(tmp_path):
    with SegmentedLog.open(str(tmp_path), segment_size=128) as log:
        offsets = log.append_batch([b"x" * 30] * 20)
    bases = [int(n) for n in segment_files(str(tmp_path))]
    # every record's offset falls in the segment whose name is the greatest base <= it
    for offset in offsets:
        base = max(b for b in bases if b <= offset)
        with open(os.path.join(tmp_path, segment_name(base)), "rb") as f:
            f.seek(offset - base)
            length = int.from_bytes(f.read(4), "little")
        assert length == 30


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("append"), st.binary(max_size=90)),
            st.tuples(st.just("batch"), st.lists(st.binary(max_size=60), max_size=8)),
            st.tuples(st.just("flush"), st.none()),
            st.tuples(st.just("reopen"), st.none()),
        ),
        max_size=40,
    ),
    segment_size=st.sampled_from([128, 300, 4096]),
)
def test_any_appends_rolls_and_reopens_read_back_exactly(tmp_path_factory, ops, segment_size):
    directory = str(tmp_path_factory.mktemp("log"))
    model: list[tuple[int, bytes]] = []
    log = SegmentedLog.open(directory, segment_size=segment_size)
    try:
        for op, arg in ops:
            if op == "append":
                model.append((log.append(arg), arg))
            elif op == "batch":
                model.extend(zip(log.append_batch(arg), arg, strict=True))
            elif op == "flush":
                assert log.flush() == log.end_offset
            else:
                log.close()
                log = SegmentedLog.open(directory, segment_size=segment_size)
        assert [(r.offset, r.payload) for r in log.iter_from(0)] == model
        assert all(log.read(o).payload == p for o, p in model)
        offsets = [o for o, _ in model]
        assert offsets == sorted(set(offsets))
    finally:
        log.close()


def write_crashed_log(directory: str, count: int, segment_size: int) -> list[tuple[int, bytes]]:
    """A flushed log left open, as a killed process leaves it (no close, no checkpoint)."""
    log = SegmentedLog.open(
        directory, segment_size=segment_size, checkpoint_every_bytes=NO_CHECKPOINT
    )
    payloads = [f"record-{i:04d}".encode() * (1 + i % 3) for i in range(count)]
    offsets = log.append_batch(payloads)
    log.flush()
    return list(zip(offsets, payloads, strict=True))


def test_crash_at_every_byte_of_the_tail(tmp_path):
    source = str(tmp_path / "source")
    written = write_crashed_log(source, 40, segment_size=400)
    names = segment_files(source)
    assert len(names) >= 3
    last_base = int(names[-1])
    end = last_base + os.path.getsize(os.path.join(source, names[-1]))
    # cut every byte position of the last segment and the last records before it
    first_cut = max(written[-8][0], last_base - 60)
    for cut in range(first_cut, end + 1):
        victim = str(tmp_path / f"cut{cut}")
        shutil.copytree(source, victim)
        for name in segment_files(victim):
            base = int(name)
            path = os.path.join(victim, name)
            if base >= cut and base != int(segment_files(victim)[0]):
                os.unlink(path)
            elif base < cut <= base + os.path.getsize(path):
                os.truncate(path, cut - base)
        with SegmentedLog.open(victim, segment_size=400) as log:
            survivors = [(r.offset, r.payload) for r in log.iter_from(0)]
            expected = [(o, p) for o, p in written if o + HEADER_SIZE + len(p) <= cut]
            assert survivors == expected, f"cut at {cut}"
            # the log keeps working where the cut left it
            new_offset = log.append(b"after-the-cut")
            assert log.read(new_offset).payload == b"after-the-cut"
        shutil.rmtree(victim)


def test_zero_filled_tail_is_cut_quietly(tmp_path):
    directory = str(tmp_path)
    written = write_crashed_log(directory, 10, segment_size=4096)
    last = os.path.join(directory, segment_files(directory)[-1])
    with open(last, "ab") as f:
        f.write(b"\0" * 3000)  # what ext4 can leave after a crash extended the file
    with SegmentedLog.open(directory) as log:
        assert [(r.offset, r.payload) for r in log.iter_from(0)] == written
        assert log.recovery.truncated_bytes == 3000


def test_flipped_byte_mid_log_is_reported_not_truncated(tmp_path):
    directory = str(tmp_path)
    log = SegmentedLog.open(
        directory,
        segment_size=1 << 20,
        max_unsynced_bytes=512,
        checkpoint_every_bytes=NO_CHECKPOINT,
    )
    offsets = log.append_batch([b"payload-%03d" % i for i in range(300)])
    log.flush()
    path = os.path.join(directory, segment_files(directory)[0])
    size_before = os.path.getsize(path)
    victim = offsets[20]
    flip_byte(path, victim + HEADER_SIZE + 3, mask=0x40)
    with pytest.raises(CorruptionError) as caught:
        SegmentedLog.open(directory, max_unsynced_bytes=512)
    assert caught.value.path == path
    assert caught.value.offset == victim
    assert caught.value.length == HEADER_SIZE + len(b"payload-020")
    assert os.path.getsize(path) == size_before  # nothing was truncated
    log.close()


def test_corruption_below_the_recovery_checkpoint_is_reported_on_read(tmp_path):
    directory = str(tmp_path)
    with SegmentedLog.open(directory, checkpoint_every_bytes=1) as log:
        offsets = log.append_batch([b"payload-%03d" % i for i in range(100)])
    assert os.path.exists(os.path.join(directory, RECOVERY_CHECKPOINT))
    path = os.path.join(directory, segment_files(directory)[0])
    flip_byte(path, offsets[50] + HEADER_SIZE, mask=0x40)
    with SegmentedLog.open(directory) as log:  # not scanned: below the checkpoint
        assert log.read(offsets[49]).payload == b"payload-049"
        with pytest.raises(CorruptionError) as on_read:
            log.read(offsets[50])
        assert (on_read.value.path, on_read.value.offset) == (path, offsets[50])
        with pytest.raises(CorruptionError) as on_scan:
            list(log.iter_from(0))
        assert (on_scan.value.path, on_scan.value.offset) == (path, offsets[50])


def test_bad_record_inside_the_unsynced_window_is_a_torn_tail(tmp_path):
    directory = str(tmp_path)
    written = write_crashed_log(directory, 30, segment_size=1 << 20)
    path = os.path.join(directory, segment_files(directory)[0])
    flip_byte(path, written[27][0] + HEADER_SIZE, mask=0x40)  # a power loss can leave this
    with SegmentedLog.open(directory) as log:
        assert [(r.offset, r.payload) for r in log.iter_from(0)] == written[:27]
        assert log.recovery.truncated_at == written[27][0]


def test_a_record_is_never_split_and_oversize_records_are_refused(tmp_path):
    with SegmentedLog.open(str(tmp_path), segment_size=100) as log:
        with pytest.raises(RecordTooLargeError, match="does not fit"):
            log.append_batch([b"ok", b"x" * 200])
        assert log.end_offset == 0  # the batch was refused whole
        with pytest.raises(ValueError, match="reserved"):
            log.append(b"x", rtype=1)
        offsets = [log.append(b"y" * 70) for _ in range(3)]
        assert [int(n) for n in segment_files(str(tmp_path))] == offsets
        assert [r.type for r in log.iter_from(0)] == [TYPE_DATA] * 3


def test_tailing_resumes_where_the_scan_stopped(tmp_path):
    with SegmentedLog.open(str(tmp_path), segment_size=200) as log:
        log.append_batch([b"a" * 30] * 5)
        seen = list(log.iter_from(0))
        resume_at = seen[-1].next_offset
        later = log.append_batch([b"b" * 30] * 9)
        assert [r.offset for r in log.iter_from(resume_at)] == later
        assert [r.offset for r in log.iter_from(0, until=later[3])] == [
            r.offset for r in seen
        ] + later[:3]


def test_retention_deletes_whole_segments_below_an_offset(tmp_path):
    with SegmentedLog.open(str(tmp_path), segment_size=200) as log:
        offsets = log.append_batch([b"r" * 40] * 30)
        before = segment_files(str(tmp_path))
        deleted = log.delete_before(offsets[17])
        after = segment_files(str(tmp_path))
        assert deleted == len(before) - len(after) > 0
        assert log.min_offset == int(after[0]) <= offsets[17]
        assert [r.offset for r in log.iter_from(log.min_offset)][-13:] == offsets[17:]
        assert log.delete_before(log.end_offset + 1000) == len(after) - 1  # keeps the last
    with SegmentedLog.open(str(tmp_path), segment_size=200) as log:
        assert log.min_offset == int(segment_files(str(tmp_path))[0])


def test_reopen_scans_only_from_the_recovery_checkpoint(tmp_path):
    directory = str(tmp_path)
    with SegmentedLog.open(directory, checkpoint_every_bytes=4096) as log:
        log.append_batch([b"z" * 100] * 1000)
        log.flush()
        log.append_batch([b"t" * 100] * 5)
    with SegmentedLog.open(directory) as log:
        assert log.recovery.scanned_from > 0
        assert log.recovery.scanned_bytes == 0  # close() checkpointed the very end
        assert log.durable_offset == log.end_offset


def test_closed_log_refuses_use(tmp_path):
    log = SegmentedLog.open(str(tmp_path))
    log.close()
    with pytest.raises(LogClosedError):
        log.append(b"x")
    with pytest.raises(LogClosedError):
        log.read(0)


@pytest.mark.parametrize("damage", ["empty_first_segment", "missing_middle_segment"])
def test_missing_records_below_the_checkpoint_are_reported_not_spun_on(tmp_path, damage):
    directory = str(tmp_path)
    with SegmentedLog.open(
        directory, segment_size=4096, max_unsynced_bytes=3000, checkpoint_every_bytes=2048
    ) as log:
        for _ in range(12):
            log.append(b"r" * 1000)
            log.flush()
    names = segment_files(directory)
    if damage == "empty_first_segment":
        os.truncate(os.path.join(directory, names[0]), 0)
    else:
        os.unlink(os.path.join(directory, names[1]))
    # a regression here would hang rather than fail: bound it
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("iter_from spun instead of raising"))
    signal.alarm(10)
    try:
        log = SegmentedLog.open(directory, segment_size=4096, max_unsynced_bytes=3000)
        with log, pytest.raises(CorruptionError, match="log continues"):
            list(log.iter_from(log.min_offset))
    finally:
        signal.alarm(0)
