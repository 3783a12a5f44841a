"""storage.scan.read_frames: the records at given positions, read a window at a time,
exactly as read_frame reads each one — including where read_frame refuses."""

from __future__ import annotations

import os
import random

import pytest

from storage import scan
from storage.framing import HEADER_SIZE
from storage.fs import O_READ, REAL_FS
from storage.record_file import RecordFile
from storage.scan import BadFrame, read_frame, read_frames


class CountingFs:
    """REAL_FS, counting preads."""

    def __init__(self) -> None:
        self.preads = 0

    def __getattr__(self, name):
        return getattr(REAL_FS, name)

    def pread(self, fd: int, size: int, position: int) -> bytes:
        self.preads += 1
        return REAL_FS.pread(fd, size, position)


@pytest.fixture
def log(tmp_path):
    """A bucket-like file of 3,000 records of 10..3,000 bytes; (path, offsets, fd)."""
    path = str(tmp_path / "bucket")
    rng = random.Random(7)
    with RecordFile.open(path) as rf:
        payloads = [bytes([i % 251]) * rng.randrange(10, 3_000) for i in range(3_000)]
        offsets = rf.append_batch(payloads)
    fd = os.open(path, O_READ)
    yield path, offsets, fd
    os.close(fd)


def test_records_equal_read_frame_in_the_order_asked(log):
    path, offsets, fd = log
    rng = random.Random(1)
    size = os.path.getsize(path)
    asked = rng.sample(offsets, 500) + offsets[-3:] + [offsets[0], offsets[0]]  # repeats too
    fs = CountingFs()
    got = read_frames(fs, fd, path, 100, asked, size)
    assert got == [read_frame(REAL_FS, fd, path, 100, p, size) for p in asked]
    # ~4.5 MB of file in 1 MiB windows: a handful of reads, not two per record
    # (a record that straddles a window's end is read alone).
    assert fs.preads < 40


def test_a_record_bigger_than_the_window_is_read_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(scan, "SPAN_READ", 64)
    monkeypatch.setattr(scan, "SPAN_SLACK", 16)
    path = str(tmp_path / "bucket")
    with RecordFile.open(path) as rf:
        offsets = rf.append_batch([b"a" * 5_000, b"b" * 3, b"c" * 70_000])
    fd = os.open(path, O_READ)
    try:
        got = read_frames(REAL_FS, fd, path, 0, offsets, os.path.getsize(path))
    finally:
        os.close(fd)
    assert [r.payload for r in got] == [b"a" * 5_000, b"b" * 3, b"c" * 70_000]


def test_refuses_what_read_frame_refuses(log):
    path, offsets, fd = log
    size = os.path.getsize(path)
    cases = {
        "not a record boundary": offsets[10] + 1,
        "past the end": size + 10,
        "cut by the limit": offsets[-1],
    }
    limit = {"cut by the limit": size - 1}
    for name, position in cases.items():
        with pytest.raises(BadFrame) as expected:
            read_frame(REAL_FS, fd, path, 0, position, limit.get(name, size))
        with pytest.raises(BadFrame) as got:
            read_frames(REAL_FS, fd, path, 0, [offsets[0], position], limit.get(name, size))
        assert (got.value.position, got.value.reason) == (
            expected.value.position,
            expected.value.reason,
        ), name


def test_a_flipped_byte_is_refused_with_its_position(log):
    path, offsets, fd = log
    with open(path, "r+b") as f:
        f.seek(offsets[200] + HEADER_SIZE + 2)
        byte = f.read(1)
        f.seek(offsets[200] + HEADER_SIZE + 2)
        f.write(bytes([byte[0] ^ 0x10]))
    size = os.path.getsize(path)
    assert read_frames(REAL_FS, fd, path, 0, offsets[190:200], size)
    with pytest.raises(BadFrame) as bad:
        read_frames(REAL_FS, fd, path, 0, offsets[190:210], size)
    assert bad.value.position == offsets[200]
