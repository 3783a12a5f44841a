"""storage.scan.count_frames: the records of one type, counted by walking headers — the
same count a full scan gives, over chunk edges and records bigger than a chunk, and a
stop (with what was counted) where the walk cannot go on."""

from __future__ import annotations

import os
import random

import pytest

from storage import scan
from storage.fs import O_READ, REAL_FS
from storage.record_file import RecordFile
from storage.scan import count_frames, scan_frames

KINDS = (2, 3, 4)


@pytest.fixture
def mixed(tmp_path, monkeypatch):
    """A file of 2,000 records of types 2..4 and 10..3,000 bytes, one of 9,000 bytes;
    chunks of 8 KiB so that records straddle chunk edges and one exceeds a chunk."""
    monkeypatch.setattr(scan, "READ_CHUNK", 8192)
    path = str(tmp_path / "bucket")
    rng = random.Random(3)
    with RecordFile.open(path) as rf:
        for i in range(2_000):
            size = 9_000 if i == 700 else rng.randrange(10, 3_000)
            rf.append_batch([b"p" * size], rng.choice(KINDS))
    fd = os.open(path, O_READ)
    yield path, fd, os.path.getsize(path)
    os.close(fd)


@pytest.mark.parametrize("rtype", KINDS)
def test_counts_what_a_scan_counts(mixed, rtype):
    path, fd, size = mixed
    scanned = sum(r.type == rtype for r in scan_frames(REAL_FS, fd, path, 0, 0, size))
    assert scanned > 500
    assert count_frames(REAL_FS, fd, path, 0, size, rtype) == (scanned, None)


def test_a_record_cut_short_by_the_limit_stops_the_walk(mixed):
    path, fd, size = mixed
    records = list(scan_frames(REAL_FS, fd, path, 0, 0, size))
    last = records[-1]
    count, bad = count_frames(REAL_FS, fd, path, 0, size - 1, last.type)
    assert count == sum(r.type == last.type for r in records[:-1])
    assert bad is not None and bad.position == last.offset
    assert "runs past the end" in bad.reason


def test_a_zeroed_header_stops_the_walk_with_what_it_counted(tmp_path):
    path = str(tmp_path / "bucket")
    with RecordFile.open(path) as rf:
        offsets = rf.append_batch([b"a" * 50] * 10, 2)
    with open(path, "r+b") as damaged:
        damaged.seek(offsets[6])
        damaged.write(bytes(9))  # length 0, type 0
    fd = os.open(path, O_READ)
    try:
        count, bad = count_frames(REAL_FS, fd, path, 0, os.path.getsize(path), 2)
    finally:
        os.close(fd)
    assert count == 6
    assert bad is not None and bad.position == offsets[6] and "type 0" in bad.reason
