"""Checkpoint files: atomic replace, damage reported, leftovers of a crash ignored."""

from __future__ import annotations

import os

import pytest

from storage.checkpoint import HEADER, TEMP_SUFFIX, read_checkpoint, write_checkpoint
from storage.errors import CorruptionError
from storage.fs import REAL_FS


def test_missing_checkpoint_reads_as_none(tmp_path):
    assert read_checkpoint(REAL_FS, str(tmp_path / "replay")) is None


def test_write_replaces_and_reads_back(tmp_path):
    path = str(tmp_path / "replay")
    write_checkpoint(REAL_FS, path, b"first, and longer than the second")
    write_checkpoint(REAL_FS, path, b"second")
    assert read_checkpoint(REAL_FS, path) == b"second"
    assert not os.path.exists(path + TEMP_SUFFIX)


def test_leftover_temp_file_of_a_crashed_write_is_harmless(tmp_path):
    path = str(tmp_path / "replay")
    write_checkpoint(REAL_FS, path, b"durable")
    with open(path + TEMP_SUFFIX, "wb") as f:
        f.write(b"half-written garbage that is longer than the next blob")
    assert read_checkpoint(REAL_FS, path) == b"durable"
    write_checkpoint(REAL_FS, path, b"next")
    assert read_checkpoint(REAL_FS, path) == b"next"


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[:-1],  # short data
        lambda raw: raw[: HEADER.size - 1],  # short header
        lambda raw: b"XXXX" + raw[4:],  # magic
        lambda raw: raw[:-1] + bytes([raw[-1] ^ 1]),  # a data bit
    ],
    ids=["short-data", "short-header", "magic", "flipped-bit"],
)
def test_damaged_checkpoint_is_corruption_naming_the_file(tmp_path, damage):
    path = str(tmp_path / "replay")
    write_checkpoint(REAL_FS, path, b"offset=123456")
    with open(path, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(damage(raw))
    with pytest.raises(CorruptionError) as caught:
        read_checkpoint(REAL_FS, path)
    assert caught.value.path == path
