"""Replay under power loss and kill -9 at every crash point (storage/crashfs.py).

A seeded workload appends messages to message_log (acknowledging them by flushes),
replays them into schedule_log in uneven steps with few open bucket files (from the
records intake offered, or read back), and writes replay checkpoints. It is run once
per crash point with the power cut there; every mode of the simulator materialises
what the disk could hold; the data directory is then recovered and replayed on the
real file system. Whatever the crash left, schedule_log
must hold every message_log record exactly once (tests.intake_support.check_exactly_once),
and message_log every acknowledged message. A second test kills the process instead
(the page cache survives), recovers on the simulator, and cuts the power during that
recovery too.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from delayd.logs import layout, message_log
from delayd.logs.message_log import MessageRecord
from delayd.replay import open_replayer
from storage.crashfs import MODES, CrashSimFileSystem, crash_points, run_to_crash
from storage.fs import FileSystem
from storage.segmented_log import SegmentedLog
from tests.crash_support import (
    assert_no_failures,
    check_crash_point,
    power_loss_at_every_crash_point,
)
from tests.intake_support import NO_SYNC_FS, check_exactly_once, read_message_log

DATA = "/data"
T = 1_795_341_600_000
LOG_OPTIONS = {"segment_size": 2048, "max_unsynced_bytes": 1500, "checkpoint_every_bytes": 1024}
REPLAY_OPTIONS = {"max_open_buckets": 2, "bucket_max_unsynced_bytes": 1200}
SEEDS = (1, 2)
STEPS = 40


@dataclass
class Journal:
    """What the workload was told as it ran: the oracle after a crash."""

    seed: int
    payloads: dict[str, bytes] = field(default_factory=dict)  # id -> payload appended
    appended: list[str] = field(default_factory=list)
    acked: int = 0  # appended[:acked] were flushed before a flush() returned
    checkpoints: int = 0
    from_tail: int = 0  # records the replayer took from what was offered
    read_back: int = 0  # records it read from message_log


def prepare(fs: FileSystem) -> None:
    """A data directory whose own entry is durable, as an installed server has."""
    fs.mkdir(DATA)
    fs.fsync_dir("/")


def open_data(fs: FileSystem, root: str = DATA):
    log = SegmentedLog.open(layout.message_log_dir(root), fs=fs, **LOG_OPTIONS)
    replayer = open_replayer(root, log, segment_scale=1, fs=fs, **REPLAY_OPTIONS)
    return log, replayer


def workload(journal: Journal) -> Callable[[CrashSimFileSystem], None]:
    def run(fs: CrashSimFileSystem) -> None:
        rng = random.Random(journal.seed)
        prepare(fs)
        log, replayer = open_data(fs)
        sequence = 0
        for _ in range(STEPS):
            action = rng.random()
            if action < 0.4:
                batch = []
                for _ in range(rng.randint(1, 4)):
                    sequence += 1
                    record = MessageRecord(
                        due_ms=T + rng.randrange(5) * 60_000 + rng.randrange(60_000),
                        sequence=sequence,
                        receive_ms=T,
                        message_id=f"{journal.seed}-{sequence}",
                        subject="orders",
                        body=rng.randbytes(rng.choice((3, 40, 200))),
                    )
                    payload = message_log.encode_record(record)
                    journal.payloads[record.message_id] = payload
                    journal.appended.append(record.message_id)
                    batch.append(payload)
                offsets = log.append_batch(batch, message_log.TYPE_MESSAGE)
                if rng.random() < 0.7:  # as intake does; the rest is read back
                    replayer.offer(offsets, batch)
            elif action < 0.6:
                pending = len(journal.appended)
                log.flush()
                journal.acked = pending
            elif action < 0.85:
                replayer.replay_available(rng.randint(1, 6))
            else:
                replayer.checkpoint()
                journal.checkpoints += 1
        journal.from_tail = replayer.replayed_from_tail
        journal.read_back = replayer.replayed_total - replayer.replayed_from_tail
        replayer.close()
        log.close()

    return run


def recover_and_check(root: Path, journal: Journal) -> None:
    """Restart on the real file system, replay everything, hold it to the journal."""
    log, replayer = open_data(NO_SYNC_FS, str(root))
    try:
        replayer.replay_available()
        replayer.checkpoint()
    finally:
        replayer.close()
        log.close()
    scheduled = check_exactly_once(root, 1)
    logged = {record.message_id: record for _, record in read_message_log(root)}
    lost = [i for i in journal.appended[: journal.acked] if i not in logged]
    assert not lost, f"acknowledged messages lost: {lost}"
    for message_id, record in logged.items():
        assert message_log.encode_record(record) == journal.payloads[message_id]
    assert set(scheduled) == set(logged)


@pytest.fixture
def scratch(tmp_path: Path):
    """Where crashed trees are materialised: memory when /dev/shm exists (hundreds of
    small trees are written and removed per test), else the test's tmp_path."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path
        return
    root = Path(tempfile.mkdtemp(prefix="delayd-replay-crash-", dir=shm))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_workload_covers_the_interesting_cases():
    """A change that made the workload trivial would make the crash tests pass without
    testing anything."""
    for seed in SEEDS:
        journal = Journal(seed)
        fs = CrashSimFileSystem()
        workload(journal)(fs)
        assert 120 <= fs.ops <= 400
        assert journal.checkpoints >= 3
        assert len(journal.appended) >= 30
        assert journal.from_tail >= 5 and journal.read_back >= 5  # both paths
        buckets = fs.listdir(layout.schedule_log_dir(DATA))
        assert len(buckets) == 5  # more than max_open_buckets: files closed and reopened
        assert len(fs.listdir(layout.message_log_dir(DATA))) >= 3  # segments rolled


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", SEEDS)
def test_power_loss_at_every_crash_point(seed: int, mode: str, scratch: Path) -> None:
    power_loss_at_every_crash_point(
        lambda: Journal(seed),
        workload,
        lambda root, journal: recover_and_check(root / DATA.strip("/"), journal),
        scratch,
        mode,
        seed_prefix=f"{seed}:",
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_kill_then_power_loss_during_recovery(seed: int, scratch: Path) -> None:
    """kill -9 at every crash point; the restarted process recovers and replays on the
    simulator. For crash points where recovery has something to cut, the power is also
    cut at every step of that recovery; the next restart must still end exactly once."""
    failures: dict[int, str] = {}
    nested = 0
    for k in range(crash_points(workload(Journal(seed))) + 1):
        journal = Journal(seed)
        fs = run_to_crash(workload(journal), k)
        fs.restart()
        start = fs.ops
        log, replayer = open_data(fs)
        cuts = bool(replayer.recovery.cut_bytes)
        replayer.replay_available()
        replayer.checkpoint()
        replayer.close()
        log.close()
        recovery_ops = fs.ops - start
        base = scratch / f"k{k}"
        points = [recovery_ops]  # the power lost after the restarted process finished
        if cuts and nested < 4:
            nested += 1
            points = range(recovery_ops + 1)
        for j in points:
            journal_copy = Journal(seed)
            again = run_to_crash(workload(journal_copy), k)
            again.restart()
            again.crash_after(again.ops + j)
            try:
                log, replayer = open_data(again)
                replayer.replay_available()
                replayer.checkpoint()
                replayer.close()
                log.close()
            except BaseException as exc:  # SimulatedCrash is a BaseException
                if type(exc).__name__ != "SimulatedCrash":
                    failures[k] = f"recovery itself failed: {type(exc).__name__}: {exc}"
                    break
            root = base / f"j{j}"
            again.materialize(str(root), "drop", random.Random(j))
            passed = check_crash_point(
                failures,
                k,
                root,
                lambda: recover_and_check(root / DATA.strip("/"), journal_copy),  # noqa: B023
                f"power cut {j} ops into recovery: ",
            )
            if not passed:
                break
    assert nested == 4, "no crash point left anything for recovery to cut"
    assert_no_failures(failures)
