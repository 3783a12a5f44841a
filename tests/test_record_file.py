"""RecordFile: the single-file log behind schedule_log and dispatch_log buckets."""

from __future__ import annotations

import os
import shutil

import pytest

from storage.errors import CorruptionError, RecordTooLargeError
from storage.framing import HEADER_SIZE
from storage.record_file import RecordFile


def fill(path: str, count: int, **options: int) -> list[tuple[int, bytes]]:
    with RecordFile.open(path, **options) as rf:
        payloads = [b"entry-%05d" % i * (1 + i % 4) for i in range(count)]
        return list(zip(rf.append_batch(payloads), payloads, strict=True))


def test_append_read_iterate_and_reopen(tmp_path):
    path = str(tmp_path / "bucket" / "202611221530")
    written = fill(path, 50)
    with RecordFile.open(path) as rf:
        assert [(r.offset, r.payload) for r in rf.iter_from()] == written
        assert rf.read(written[7][0]).payload == written[7][1]
        assert [r.payload for r in rf.iter_from(written[40][0])] == [p for _, p in written[40:]]
        assert rf.end_offset == rf.durable_offset == os.path.getsize(path)
        more = rf.append(b"later")
        assert rf.read(more).payload == b"later"


def test_torn_tail_cut_at_every_byte(tmp_path):
    source = str(tmp_path / "source")
    written = fill(source, 12)
    size = os.path.getsize(source)
    for cut in range(written[-4][0], size + 1):
        victim = str(tmp_path / f"cut{cut}")
        shutil.copyfile(source, victim)
        os.truncate(victim, cut)
        with RecordFile.open(victim) as rf:
            expected = [(o, p) for o, p in written if o + HEADER_SIZE + len(p) <= cut]
            assert [(r.offset, r.payload) for r in rf.iter_from()] == expected
            assert rf.truncated_bytes == cut - rf.end_offset
        os.unlink(victim)


def test_damage_outside_the_unsynced_window_is_corruption(tmp_path):
    path = str(tmp_path / "b")
    written = fill(path, 200)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(written[3][0] + HEADER_SIZE)
        f.write(b"X")
    with pytest.raises(CorruptionError) as caught:
        RecordFile.open(path, max_unsynced_bytes=256)
    assert (caught.value.path, caught.value.offset) == (path, written[3][0])
    assert os.path.getsize(path) == size  # nothing truncated
    # a caller that knows the damaged part was durable says so with trusted_end:
    # the scan starts there and reads report the damage instead
    with RecordFile.open(path, trusted_end=written[10][0], max_unsynced_bytes=256) as rf:
        with pytest.raises(CorruptionError):
            rf.read(written[3][0])
        assert rf.read(written[4][0]).payload == written[4][1]


def test_file_shorter_than_its_trusted_end_is_refused(tmp_path):
    path = str(tmp_path / "b")
    fill(path, 5)
    with pytest.raises(CorruptionError, match="shorter than its durable length"):
        RecordFile.open(path, trusted_end=os.path.getsize(path) + 1)


def test_unsynced_window_is_bounded_and_oversize_refused(tmp_path):
    with RecordFile.open(str(tmp_path / "b"), max_unsynced_bytes=200) as rf:
        with pytest.raises(RecordTooLargeError):
            rf.append(b"x" * 200)
        assert rf.end_offset == 0
        rf.append_batch([b"y" * 50] * 10)
        assert rf.unsynced_bytes <= 200
        assert rf.durable_offset > 0  # the window forced flushes on the way


def test_truncate_drops_a_suffix_durably(tmp_path):
    path = str(tmp_path / "b")
    written = fill(path, 10)
    with RecordFile.open(path) as rf:
        rf.truncate(written[6][0])
        assert [p for _, p in written[:6]] == [r.payload for r in rf.iter_from()]
        with pytest.raises(ValueError):
            rf.truncate(rf.end_offset + 1)
    assert os.path.getsize(path) == written[6][0]
