"""Power loss at every crash point of a log workload, in every mode of the simulator.

A seeded workload (appends of random sizes that roll segments, flushes as
acknowledgement points, checkpoint writes, retention deletes) runs on the crash
simulator; it is replayed once per crash point, the power is cut there, each mode of
:mod:`storage.crashfs` materialises what the disk could hold, and the log is reopened
on the real file system. Whatever the crash left, recovery must return every
acknowledged record, only records that were really appended, and the last completed
checkpoint (or a later one).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from storage.checkpoint import read_checkpoint, write_checkpoint
from storage.crashfs import MODES, CrashSimFileSystem, crash_points, run_to_crash
from storage.fs import REAL_FS, FileSystem
from storage.segmented_log import SegmentedLog
from tests.crash_support import (
    assert_no_failures,
    check_crash_point,
    power_loss_at_every_crash_point,
)

DATA_DIR = "/data"
LOG_DIR = "/data/log"
CHECKPOINT = "/data/app.checkpoint"
# Small segments and a small unsynced window so that a short workload rolls segments,
# hits the window (append flushes by itself) and writes recovery checkpoints.
LOG_OPTIONS = {"segment_size": 4096, "max_unsynced_bytes": 3000, "checkpoint_every_bytes": 2048}
# Pages much smaller than a segment, so that "pages" and "torn" can lose one page of a
# segment and keep the next.
PAGE_SIZE = 512
SEEDS = (1, 2)
STEPS = 70


def payload(seed: int, seq: int) -> bytes:
    """The seq-th record of a run: seq first, so a record read back names itself."""
    rng = random.Random(f"{seed}:{seq}")
    size = rng.randint(1000, 2900) if rng.random() < 0.2 else rng.randint(0, 300)
    return seq.to_bytes(4, "little") + rng.randbytes(size)


@dataclass
class Journal:
    """What the workload was told, as it ran: the oracle for the state after a crash."""

    seed: int
    next_seq: int = 0
    offsets: dict[int, int] = field(default_factory=dict)  # seq -> offset append returned
    acked: int = 0  # seqs below this were appended before a flush() that returned
    checkpoint_started: int = 0
    checkpoint_done: int = 0  # the value of the last write_checkpoint that returned
    retention_started: int = 0  # the highest offset passed to delete_before

    def append(self, log: SegmentedLog, count: int) -> None:
        seqs = range(self.next_seq, self.next_seq + count)
        self.next_seq += count  # before the call: a crash may leave any prefix on disk
        offsets = log.append_batch([payload(self.seed, s) for s in seqs])
        self.offsets.update(zip(seqs, offsets, strict=True))

    def flush(self, log: SegmentedLog) -> None:
        pending = self.next_seq
        log.flush()
        self.acked = pending

    def checkpoint(self, fs: FileSystem) -> None:
        self.checkpoint_started += 1
        write_checkpoint(fs, CHECKPOINT, str(self.checkpoint_started).encode())
        self.checkpoint_done = self.checkpoint_started


def prepare(fs: FileSystem) -> None:
    """A data directory whose entry is durable, as an installed server would have."""
    fs.mkdir(DATA_DIR)
    fs.fsync_dir("/")


def workload(journal: Journal) -> Callable[[CrashSimFileSystem], None]:
    def run(fs: CrashSimFileSystem) -> None:
        rng = random.Random(journal.seed)
        prepare(fs)
        log = SegmentedLog.open(LOG_DIR, fs=fs, **LOG_OPTIONS)
        for _ in range(STEPS):
            action = rng.random()
            if action < 0.45:
                journal.append(log, 1)
            elif action < 0.6:
                journal.append(log, rng.randint(2, 4))
            elif action < 0.82:
                journal.flush(log)
            elif action < 0.92:
                journal.checkpoint(fs)
            elif journal.acked:
                # Retention up to any acknowledged record.
                point = journal.offsets[rng.randrange(journal.acked)]
                journal.retention_started = max(journal.retention_started, point)
                log.delete_before(point)
        log.close()
        journal.acked = journal.next_seq

    return run


def check_recovered(root: Path, journal: Journal) -> None:
    """Reopen the materialised log with the real file system and hold it to the journal."""
    log = SegmentedLog.open(str(root) + LOG_DIR, **LOG_OPTIONS)
    try:
        records = list(log.iter_from(log.min_offset))
        seqs = [int.from_bytes(r.payload[:4], "little") for r in records]
        # Never a torn, corrupt or invented record: each one is exactly what was appended
        # under its seq, at the offset append returned for it, with no gaps between them.
        if seqs:
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"gap or reorder: {seqs}"
            assert seqs[-1] < journal.next_seq, f"record {seqs[-1]} was never appended"
        for seq, record in zip(seqs, records, strict=True):
            assert record.payload == payload(journal.seed, seq), f"payload of record {seq}"
            if seq in journal.offsets:
                assert record.offset == journal.offsets[seq], f"offset of record {seq}"
        # Every acknowledged record above the retention point is there and readable.
        must_have = [
            s for s in range(journal.acked) if journal.offsets[s] >= journal.retention_started
        ]
        missing = sorted(set(must_have) - set(seqs))
        assert not missing, f"acknowledged records lost: {missing} (recovered {seqs})"
        for seq in must_have:
            assert log.read(journal.offsets[seq]).payload == payload(journal.seed, seq)
        # The recovered log takes appends and makes them durable.
        offset = log.append(b"after recovery")
        log.flush()
        assert log.read(offset).payload == b"after recovery"
    finally:
        log.close()
    value = read_checkpoint(REAL_FS, str(root) + CHECKPOINT)
    if value is None:
        assert journal.checkpoint_done == 0, "a completed checkpoint was lost"
    else:
        assert journal.checkpoint_done <= int(value) <= journal.checkpoint_started


def test_workload_is_big_enough_to_cover_the_interesting_cases() -> None:
    """Guards the sizing below: a change that made the workload trivial would make the
    power-loss tests pass without testing anything."""
    for seed in SEEDS:
        journal = Journal(seed)
        fs = CrashSimFileSystem()
        workload(journal)(fs)
        assert 150 <= fs.ops <= 600
        assert max(journal.offsets.values()) > 4 * LOG_OPTIONS["segment_size"]  # rolls
        assert journal.checkpoint_done >= 2
        assert journal.retention_started > 0
        assert fs.listdir(LOG_DIR)[0] != "00000000000000000000"  # retention deleted one


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", SEEDS)
def test_power_loss_at_every_crash_point(seed: int, mode: str, tmp_path: Path) -> None:
    power_loss_at_every_crash_point(
        lambda: Journal(seed),
        workload,
        check_recovered,
        tmp_path,
        mode,
        seed_prefix=f"{seed}:",
        page_size=PAGE_SIZE,
    )


def test_log_directory_created_by_open_survives_power_loss(tmp_path: Path) -> None:
    """open() creates a missing log directory; once a flush has acknowledged records,
    the directory's own entry must be durable too, or a power loss takes the whole log."""
    fs = CrashSimFileSystem()
    prepare(fs)
    log = SegmentedLog.open(LOG_DIR, fs=fs, **LOG_OPTIONS)
    offset = log.append(b"acknowledged")
    log.flush()
    fs.materialize(str(tmp_path), "drop", random.Random(0))
    with SegmentedLog.open(str(tmp_path) + LOG_DIR, **LOG_OPTIONS) as reopened:
        assert reopened.read(offset).payload == b"acknowledged"


@pytest.mark.parametrize("seed", SEEDS)
def test_kill_then_power_loss(seed: int, tmp_path: Path) -> None:
    """kill -9 at every crash point (the page cache survives), restart, acknowledge more
    records, then lose power: records acknowledged by either process survive. Recovery
    must make durable whatever it adopts from the page cache, names included."""
    failures: dict[int, str] = {}
    for k in range(crash_points(workload(Journal(seed))) + 1):
        journal = Journal(seed)
        fs = run_to_crash(workload(journal), k, PAGE_SIZE)
        fs.restart()
        prepare(fs)  # the installer's step is not the log's job; redo it if it was cut
        log = SegmentedLog.open(LOG_DIR, fs=fs, **LOG_OPTIONS)
        # The new process adopts what the old one left in the page cache (recovery makes
        # it durable: durable_offset covers it) and numbers its records after it.
        journal.next_seq = 0
        for record in log.iter_from(log.min_offset):
            seq = int.from_bytes(record.payload[:4], "little")
            journal.offsets[seq] = record.offset
            journal.next_seq = seq + 1
        journal.append(log, 2)
        journal.flush(log)
        root = tmp_path / f"k{k}"
        fs.materialize(str(root), "drop", random.Random(k))
        check_crash_point(failures, k, root, lambda: check_recovered(root, journal))  # noqa: B023
    assert_no_failures(failures)
