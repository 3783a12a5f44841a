"""The committed offsets' log (delayd/broker/offsets.py): commits appended, durable on
flush, compacted into a new generation, an older ``offsets.json`` migrated; a power
loss at every crash point of compaction and migration keeps the table; a follower's
copy applies what it receives in stream order."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from delayd.broker.broker import Broker
from delayd.broker.offsets import LEGACY_FILE, OffsetStore, generation_name
from storage.crashfs import MODES, CrashSimFileSystem, crash_points, run_to_crash
from storage.errors import CorruptionError

TABLE = {("g1", "orders", 0): 12, ("g1", "orders", 1): 3, ("g2", "pay.in", 0): 40}


def legacy_json(table: dict[tuple[str, str, int], int]) -> bytes:
    nested: dict = {}
    for (group, subject, queue), offset in table.items():
        nested.setdefault(group, {}).setdefault(subject, {})[str(queue)] = offset
    return json.dumps({"version": 1, "offsets": nested}).encode()


def commit_all(store: OffsetStore, table: dict[tuple[str, str, int], int]) -> None:
    for (group, subject, queue), offset in table.items():
        store.set(group, subject, queue, offset)


def test_commits_survive_a_reopen_and_flush_is_what_a_power_loss_keeps(tmp_path: Path) -> None:
    fs = CrashSimFileSystem()
    store = OffsetStore.open("/broker", fs=fs)
    commit_all(store, TABLE)
    store.flush(store.version)
    assert store.saved_version == store.version and not store.dirty
    store.set("g1", "orders", 0, 13)  # written, never flushed
    fs.materialize(str(tmp_path / "lost"), "drop", random.Random(1))
    assert dict(OffsetStore.open(str(tmp_path / "lost/broker")).items()) == TABLE
    fs.restart()  # kill -9: the page cache keeps the unflushed commit
    assert dict(OffsetStore.open("/broker", fs=fs).items()) == {**TABLE, ("g1", "orders", 0): 13}


def test_compaction_starts_a_generation_with_the_table_and_drops_the_old(tmp_path: Path) -> None:
    store = OffsetStore.open(str(tmp_path), compact_bytes=300)
    for offset in range(40):
        store.set("g", "s", offset % 3, offset)
    assert store.needs_compaction()
    table = dict(store.items())
    store.compact()
    assert store.generations() == [1]
    assert not store.needs_compaction()
    store.set("g", "s", 7, 1)  # goes to the new generation
    store.close()
    assert os.listdir(tmp_path / "offsets") == [generation_name(1)]
    assert dict(OffsetStore.open(str(tmp_path)).items()) == {**table, ("g", "s", 7): 1}


def compaction_workload(fs: CrashSimFileSystem) -> None:
    store = OffsetStore.open("/broker", fs=fs, compact_bytes=100)
    commit_all(store, TABLE)
    store.flush()
    store.compact()
    store.close()


@pytest.mark.parametrize("mode", MODES)
def test_a_power_loss_during_compaction_keeps_the_table(tmp_path: Path, mode: str) -> None:
    points = crash_points(compaction_workload)
    # The table is durable once flush returned: from there on, every crash keeps it.
    flushed = crash_points(lambda fs: _flushed_only(fs))
    for k in range(flushed, points + 1):
        fs = run_to_crash(compaction_workload, k, page_size=64)
        dest = tmp_path / f"{mode}-{k}"
        fs.materialize(str(dest), mode, random.Random(k))
        assert dict(OffsetStore.open(str(dest / "broker")).items()) == TABLE, k


def _flushed_only(fs: CrashSimFileSystem) -> None:
    store = OffsetStore.open("/broker", fs=fs, compact_bytes=100)
    commit_all(store, TABLE)
    store.flush()


def write_legacy(fs: CrashSimFileSystem) -> None:
    fs.mkdir("/broker")
    fd = fs.open(f"/broker/{LEGACY_FILE}", os.O_RDWR | os.O_CREAT)
    fs.pwrite(fd, legacy_json(TABLE), 0)
    fs.fsync(fd)
    fs.close(fd)
    fs.fsync_dir("/broker")
    fs.fsync_dir("/")


def migration_workload(fs: CrashSimFileSystem) -> None:
    write_legacy(fs)
    OffsetStore.open("/broker", fs=fs).close()


@pytest.mark.parametrize("mode", MODES)
def test_an_old_offsets_json_is_migrated_and_a_crash_during_it_loses_nothing(
    tmp_path: Path, mode: str
) -> None:
    fs = CrashSimFileSystem()
    migration_workload(fs)
    assert fs.listdir("/broker/offsets") == [generation_name(0)]
    assert LEGACY_FILE not in fs.listdir("/broker"), "migrated, then removed"
    for k in range(crash_points(write_legacy), crash_points(migration_workload) + 1):
        crashed = run_to_crash(migration_workload, k, page_size=64)
        dest = tmp_path / f"{mode}-{k}"
        crashed.materialize(str(dest), mode, random.Random(k))
        reopened = OffsetStore.open(str(dest / "broker"))
        assert dict(reopened.items()) == TABLE, k
        assert not os.path.exists(dest / "broker" / LEGACY_FILE)


def test_an_existing_data_dir_with_offsets_json_opens_in_the_broker(tmp_path: Path) -> None:
    (tmp_path / "broker").mkdir()
    (tmp_path / "broker" / LEGACY_FILE).write_bytes(legacy_json(TABLE))
    broker = Broker.open(str(tmp_path))
    try:
        assert dict(broker.offsets.items()) == TABLE
        assert broker.lags()  # the committed offsets are the broker's
    finally:
        broker.close()
    assert not (tmp_path / "broker" / LEGACY_FILE).exists()


def test_a_bad_legacy_file_or_record_is_corruption(tmp_path: Path) -> None:
    (tmp_path / LEGACY_FILE).write_bytes(b'{"version": 7, "offsets": {}}')
    with pytest.raises(CorruptionError, match="version 7"):
        OffsetStore.open(str(tmp_path))


def test_a_follower_applies_what_it_receives_in_stream_order(tmp_path: Path) -> None:
    """The leader compacts while the follower still lacks the end of the older
    generation; the leader sends the new generation first. The older one's late
    commits must not undo the newer snapshot."""
    leader = OffsetStore.open(str(tmp_path / "a"), compact_bytes=10)
    follower = OffsetStore.open(str(tmp_path / "b"))
    follower.following = True
    leader.set("g", "s", 0, 5)
    half = leader.file(0).end_offset
    leader.set("g", "s", 0, 9)
    leader.set("g", "s", 1, 2)
    old = leader.file(0).read_raw(0, 1 << 20)
    append(follower, 0, 0, old[:half])
    leader.compact()  # generation 1: {s/0: 9, s/1: 2}; generation 0 deleted
    assert leader.generations() == [1]
    leader.set("g", "s", 1, 4)
    append(follower, 1, 0, leader.file(1).read_raw(0, 1 << 20))  # the new generation first
    assert follower.apply_appended()
    append(follower, 0, half, old[half:])  # then the old one's rest
    follower.apply_appended()
    assert dict(follower.items()) == dict(leader.items()) == {("g", "s", 0): 9, ("g", "s", 1): 4}
    follower.reload()  # what a restart or a truncation rebuilds agrees
    assert dict(follower.items()) == dict(leader.items())
    with pytest.raises(RuntimeError, match="replication"):
        follower.set("g", "s", 0, 1)


def append(target: OffsetStore, generation: int, offset: int, data: bytes) -> None:
    """What a follower does with a RECORDS frame: append raw, flush."""
    target.file(generation).append_raw(offset, data)
    target.file(generation).flush()
