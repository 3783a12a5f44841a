"""Raw framed bytes: read a chunk, append it at an expected offset, truncate to a record
boundary — the storage primitives replication copies logs with — on SegmentedLog and
RecordFile, and at every crash point of a raw append and a truncate."""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from storage.crashfs import MODES, CrashSimFileSystem, crash_points, run_to_crash
from storage.errors import RawAppendRefused
from storage.framing import encode_record
from storage.raw_frames import pieces, walk_frames
from storage.record_file import RecordFile
from storage.scan import BadFrame
from storage.segmented_log import SegmentedLog

SMALL = {"segment_size": 4096, "max_unsynced_bytes": 3000, "checkpoint_every_bytes": 2048}


def payloads(seed: int, count: int) -> list[bytes]:
    rng = random.Random(seed)
    return [i.to_bytes(4, "little") + rng.randbytes(rng.randint(0, 900)) for i in range(count)]


def copy_all(source: SegmentedLog | RecordFile, copy: SegmentedLog | RecordFile, chunk: int) -> int:
    """Copy ``source`` to ``copy`` raw, ``chunk`` bytes at a time; returns the reads made."""
    reads = 0
    while True:
        data = source.read_raw(copy.end_offset, chunk)
        if not data:
            return reads
        reads += 1
        copy.append_raw(copy.end_offset, data)


def files_of(directory: Path) -> dict[str, bytes]:
    return {
        name: (directory / name).read_bytes()
        for name in sorted(os.listdir(directory))
        if name.isdigit()
    }


def test_walk_finds_whole_frames_and_segment_markers() -> None:
    one, two = encode_record(b"one"), encode_record(b"two!")
    marker = encode_record(b"", 1)
    data = one + two + marker + one[:5]
    walk = walk_frames(data, "x", 0)
    assert walk.complete == len(one + two + marker)
    assert walk.ends == [len(one), len(one + two), len(one + two + marker)]
    assert walk.segment_ends == [len(one + two + marker)]
    assert pieces(walk, 1000) == [walk.complete]
    assert pieces(walk, len(one) + 1) == [len(one), len(one + two), walk.complete]
    damaged = bytearray(one + two)
    damaged[len(one) + 10] ^= 1
    with pytest.raises(BadFrame, match="crc mismatch") as bad:
        walk_frames(damaged, "x", 100)
    assert bad.value.position == 100 + len(one)


def test_segmented_log_copies_byte_identical_across_rolls(tmp_path: Path) -> None:
    source = SegmentedLog.open(str(tmp_path / "a"), **SMALL)
    # The copy's own segment size differs: the source's markers decide where it rolls.
    copy = SegmentedLog.open(str(tmp_path / "b"), **{**SMALL, "segment_size": 1 << 20})
    with source, copy:
        source.append_batch(payloads(1, 40))
        source.flush()
        reads = copy_all(source, copy, 1500)
        assert reads > len(os.listdir(tmp_path / "a"))  # chunks smaller than segments
        source.append_batch(payloads(2, 10))
        copy_all(source, copy, 1 << 20)
        assert copy.end_offset == source.end_offset
        assert copy.flush() == copy.end_offset
        copied = [r.payload for r in copy.iter_from(0)]
        assert copied == [r.payload for r in source.iter_from(0)]
    assert len(files_of(tmp_path / "a")) > 3
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b")
    with SegmentedLog.open(str(tmp_path / "b"), **SMALL) as reopened:
        assert reopened.end_offset == copy.end_offset


def test_read_raw_returns_a_record_longer_than_max_bytes_whole(tmp_path: Path) -> None:
    with RecordFile.open(str(tmp_path / "f")) as file:
        file.append_batch([b"x" * 500, b"y"])
        first = file.read_raw(0, 10)
        assert first == encode_record(b"x" * 500)
        assert file.read_raw(len(first), 10) == encode_record(b"y")
        assert file.read_raw(file.end_offset, 10) == b""
        with pytest.raises(ValueError, match="outside"):
            file.read_raw(file.end_offset + 1, 10)


@pytest.mark.parametrize("kind", ["segmented", "record_file"])
def test_append_raw_refuses_wrong_offset_and_bad_bytes(tmp_path: Path, kind: str) -> None:
    store = (
        SegmentedLog.open(str(tmp_path / "log"), **SMALL)
        if kind == "segmented"
        else RecordFile.open(str(tmp_path / "file"))
    )
    with store:
        store.append(b"first")
        end = store.end_offset
        good = encode_record(b"second")
        with pytest.raises(RawAppendRefused, match=f"ends at {end}"):
            store.append_raw(end + 1, good)
        with pytest.raises(RawAppendRefused, match="partial record"):
            store.append_raw(end, good + good[:4])
        bad = bytearray(good + good)
        bad[-1] ^= 0xFF
        with pytest.raises(RawAppendRefused, match="crc mismatch"):
            store.append_raw(end, bytes(bad))
        assert store.end_offset == end  # nothing of a refused chunk was written
        assert store.append_raw(end, good) == end + len(good)
        assert store.read(end).payload == b"second"


def test_record_file_refuses_a_segment_marker(tmp_path: Path) -> None:
    with RecordFile.open(str(tmp_path / "f")) as file:
        with pytest.raises(RawAppendRefused, match="end-of-segment marker"):
            file.append_raw(0, encode_record(b"a") + encode_record(b"", 1))
        assert file.end_offset == 0


def test_segmented_log_truncates_to_a_boundary_durably(tmp_path: Path) -> None:
    directory = str(tmp_path / "log")
    with SegmentedLog.open(directory, **SMALL) as log:
        offsets = log.append_batch(payloads(3, 40))
        log.flush()
        segments_before = len(files_of(Path(directory)))
        cut = offsets[5]
        with pytest.raises(ValueError, match="not a record boundary"):
            log.truncate(cut + 1)
        with pytest.raises(ValueError, match="cannot truncate"):
            log.truncate(log.end_offset + 1)
        log.truncate(cut)
        assert log.end_offset == log.durable_offset == cut
        assert len(files_of(Path(directory))) < segments_before
        assert [r.offset for r in log.iter_from(0)] == offsets[:5]
        again = log.append(b"after the cut")
        assert again == cut
    with SegmentedLog.open(directory, **SMALL) as reopened:
        assert reopened.recovery.truncated_bytes == 0
        assert [r.payload for r in reopened.iter_from(0)][-1] == b"after the cut"


def test_segmented_log_truncates_to_a_segment_start(tmp_path: Path) -> None:
    directory = str(tmp_path / "log")
    with SegmentedLog.open(directory, **SMALL) as log:
        log.append_batch(payloads(4, 30))
        second = sorted(files_of(Path(directory)))[1]
        log.truncate(int(second))
        assert log.end_offset == int(second)
        assert log.append(b"next") == int(second)
    with SegmentedLog.open(directory, **SMALL) as reopened:
        assert reopened.read(int(second)).payload == b"next"


def test_record_file_truncate_refuses_a_non_boundary(tmp_path: Path) -> None:
    with RecordFile.open(str(tmp_path / "f")) as file:
        offsets = file.append_batch([b"aaaa", b"bbbb", b"cccc"])
        with pytest.raises(ValueError, match="not a record boundary"):
            file.truncate(offsets[1] + 3)
        file.truncate(offsets[1])
        assert file.end_offset == offsets[1]
        assert [r.payload for r in file.iter_from(0)] == [b"aaaa"]


# ---------------------------------------------------------------- power loss

LOG_DIR = "/data/log"


def source_stream(seed: int, count: int, prefix: bytes = b"") -> bytes:
    """The raw bytes of a log with small segments: records and segment markers."""
    fs = CrashSimFileSystem()
    with SegmentedLog.open("/source", fs=fs, **SMALL) as log:
        log.append_batch([prefix + p for p in payloads(seed, count)])
        return read_all(log)


def read_all(log: SegmentedLog) -> bytes:
    parts, offset = [], log.min_offset
    while chunk := log.read_raw(offset, 1 << 20):
        parts.append(chunk)
        offset += len(chunk)
    return b"".join(parts)


STREAM_A = source_stream(5, 30)
STREAM_B = source_stream(6, 12, b"B")


@dataclass
class Progress:
    """How far the workload got: the oracle for what recovery may return."""

    acked_a: int = 0  # bytes of A durable (a flush returned)
    cut: int | None = None  # a truncate to this offset began
    cut_done: bool = False
    acked_b: int = 0  # bytes of B after the cut durable


def assert_recovered(got: bytes, progress: Progress, before: bytes, after: bytes) -> None:
    """What recovery may return after the workload wrote ``before``, cut it back and
    wrote ``after`` past the cut, as far as ``progress`` says it got."""
    if not progress.cut_done:
        # Before the cut returned: a prefix of ``before``, at least what was flushed (or
        # the cut).
        assert before.startswith(got), "bytes that were never appended"
        floor = progress.acked_a if progress.cut is None else progress.cut
        assert len(got) >= floor, f"lost durable bytes: {len(got)} < {floor}"
    else:
        assert got[: progress.cut] == before[: progress.cut], "the kept prefix changed"
        assert after.startswith(got[progress.cut :]), "bytes past the cut not appended"
        assert len(got) >= progress.cut + progress.acked_b, "lost durable bytes after the cut"


def raw_workload(progress: Progress) -> Callable[[CrashSimFileSystem], None]:
    """Copy stream A raw in chunks (flushing now and then), cut back to a record
    boundary inside what was flushed, copy stream B after the cut: a follower that
    followed an old leader, was told to truncate, and follows the new one."""

    def run(fs: CrashSimFileSystem) -> None:
        fs.mkdir("/data")
        fs.fsync_dir("/")
        source = walk_frames(STREAM_A, "a", 0).ends
        log = SegmentedLog.open(LOG_DIR, fs=fs, **SMALL)
        position = 0
        for step, end in enumerate(source[2::3]):
            log.append_raw(position, STREAM_A[position:end])
            position = end
            if step % 2:
                log.flush()
                progress.acked_a = position
        progress.cut = source[len(source) // 3]
        log.truncate(progress.cut)
        progress.cut_done = True
        b_end = walk_frames(STREAM_B, "b", 0).ends[3]
        log.append_raw(progress.cut, STREAM_B[:b_end])
        log.flush()
        progress.acked_b = log.end_offset - progress.cut
        log.close()

    return run


def check_raw_recovered(root: Path, progress: Progress) -> None:
    with SegmentedLog.open(str(root) + LOG_DIR, **SMALL) as log:
        got = read_all(log)
    assert_recovered(got, progress, STREAM_A, STREAM_B)


def test_raw_workload_covers_flushes_and_the_cut() -> None:
    progress = Progress()
    fs = CrashSimFileSystem()
    raw_workload(progress)(fs)
    assert progress.cut_done
    assert 0 < progress.cut < progress.acked_a
    assert walk_frames(STREAM_A, "a", 0).segment_ends  # the copy rolls segments
    assert fs.ops > 40


def power_loss_failures(
    workload: Callable[[Progress], Callable[[CrashSimFileSystem], None]],
    check: Callable[[Path, Progress], None],
    mode: str,
    tmp_path: Path,
) -> dict[int, str]:
    """Cut the power at every crash point of ``workload`` and ``check`` what the disk
    holds then; the failures, by crash point."""
    failures: dict[int, str] = {}
    for k in range(crash_points(workload(Progress())) + 1):
        progress = Progress()
        fs = run_to_crash(workload(progress), k, 512)
        root = tmp_path / f"k{k}"
        fs.materialize(str(root), mode, random.Random(f"{k}:{mode}"))
        try:
            check(root, progress)
        except Exception as exc:
            failures[k] = f"{type(exc).__name__}: {exc}"
        else:
            shutil.rmtree(root)
    return failures


@pytest.mark.parametrize("mode", MODES)
def test_power_loss_during_raw_append_and_truncate(mode: str, tmp_path: Path) -> None:
    failures = power_loss_failures(raw_workload, check_raw_recovered, mode, tmp_path)
    assert not failures, f"failed at crash points {sorted(failures)}: {list(failures.values())[:3]}"


FILE_PATH = "/data/bucket"
FILE_STREAM = b"".join(encode_record(p) for p in payloads(7, 24))


def file_workload(progress: Progress) -> Callable[[CrashSimFileSystem], None]:
    """raw_workload for a RecordFile (a dispatch_log bucket): copy, cut, copy other."""

    def run(fs: CrashSimFileSystem) -> None:
        fs.mkdir("/data")
        fs.fsync_dir("/")
        ends = walk_frames(FILE_STREAM, "f", 0).ends
        file = RecordFile.open(FILE_PATH, fs=fs, max_unsynced_bytes=3000)
        for step, end in enumerate(ends[1::4]):
            file.append_raw(file.end_offset, FILE_STREAM[file.end_offset : end])
            if step % 2:
                progress.acked_a = file.flush()
        progress.cut = ends[len(ends) // 3]
        file.truncate(progress.cut)
        progress.cut_done = True
        file.append_raw(progress.cut, FILE_OTHER)
        file.flush()
        progress.acked_b = len(FILE_OTHER)
        file.close()

    return run


FILE_OTHER = encode_record(b"B" * 700) * 3


def check_file_recovered(root: Path, progress: Progress) -> None:
    if not (root / "data" / "bucket").exists():
        assert progress.acked_a == 0, "a flushed file vanished"
        return
    with RecordFile.open(str(root) + FILE_PATH) as file:
        got = file.read_raw(0, 1 << 20) if file.end_offset else b""
        assert len(got) == file.end_offset  # whole records, nothing else
    assert_recovered(got, progress, FILE_STREAM, FILE_OTHER)


@pytest.mark.parametrize("mode", MODES)
def test_power_loss_during_a_record_files_raw_append_and_truncate(
    mode: str, tmp_path: Path
) -> None:
    failures = power_loss_failures(file_workload, check_file_recovered, mode, tmp_path)
    assert not failures, f"failed at crash points {sorted(failures)}: {list(failures.values())[:3]}"
