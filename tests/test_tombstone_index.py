"""delayd.replay.tombstone_index and the replayer's use of it: the offsets of every
tombstone of message_log — noted by replay above where it began, found below it by one
scan that runs while replay goes on, dropped with the segments retention deletes — and
the records read back at them."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import pytest
import trio

from delayd.logs import layout, message_log, tombstone
from delayd.logs.message_log import MessageRecord
from delayd.replay import Replayer, open_replayer
from delayd.replay import replayer as replayer_module
from delayd.replay.tombstone_index import read_tombstones, read_tombstones_at
from storage.errors import CorruptionError
from storage.fs import REAL_FS
from storage.segmented_log import SegmentedLog

T = 1_795_341_600_000


def write_log(data: str, records: int) -> SegmentedLog:
    """message_log of ``records`` records over many segments, one in five a cancel or
    a reschedule of an earlier message."""
    log = SegmentedLog.open(layout.message_log_dir(data), segment_size=4096)
    rng = random.Random(7)
    for n in range(records):
        if n and rng.random() < 0.2:
            due_ms = None if rng.random() < 0.5 else T + 120_000
            stone = tombstone.Tombstone(f"m-{rng.randrange(n)}", T, due_ms, True)
            log.append_batch([tombstone.encode(stone)], stone.rtype)
        else:
            record = MessageRecord(T + 60_000, n + 1, T, f"m-{n}", "orders", body=b"x" * 60)
            log.append_batch([message_log.encode_record(record)], message_log.TYPE_MESSAGE)
    log.flush()
    return log


def replay_some(data: str, log: SegmentedLog, records: int) -> int:
    """Replay ``records`` records or a few more as a follower, checkpoint, close: a
    process that stops there. Returns its position."""
    replayer = open_replayer(data, log, segment_scale=1)
    replayed = 0
    while replayed < records:
        replayed += replayer.replay_available(records - replayed)
    replayer.checkpoint()
    replayer.close()
    return replayer.position


def every_tombstone(replayer: Replayer) -> list[tuple[int, int, bytes]]:
    return read_tombstones(REAL_FS, replayer.data_dir, replayer.log.min_offset, replayer.position)


async def test_tombstones_below_the_checkpoint_and_replayed_during_the_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = str(tmp_path)
    with write_log(data, 400) as log:
        checkpoint = replay_some(data, log, 200)
        replayer = open_replayer(data, log, segment_scale=1)
        assert replayer.tombstones.replay_start == checkpoint
        scanning, go_on = threading.Event(), threading.Event()
        scan_offsets = replayer_module.scan_offsets

        def held_scan(*args):
            scanning.set()
            go_on.wait(10)
            return scan_offsets(*args)

        monkeypatch.setattr(replayer_module, "scan_offsets", held_scan)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(replayer.scan_tombstones)
                await trio.to_thread.run_sync(scanning.wait)
                while replayer.replay_available(7):
                    pass  # the rest, while the scan runs
                assert replayer.position == log.end_offset
                noted = replayer.tombstones_between(checkpoint, replayer.position)
                assert noted == [r for r in every_tombstone(replayer) if r[0] >= checkpoint]
                with pytest.raises(RuntimeError, match="scan_tombstones"):
                    replayer.tombstones_between(0, replayer.position)
                go_on.set()
            assert replayer.tombstones.complete
            everything = every_tombstone(replayer)
            assert len(everything) > 60
            assert any(offset < checkpoint for offset, _, _ in everything)
            assert replayer.tombstones_between(0, replayer.position) == everything
            assert len(replayer.tombstones) == len(everything)
            await replayer.scan_tombstones()  # once is enough
            assert len(replayer.tombstones) == len(everything)
        finally:
            replayer.close()


async def test_retention_drops_the_offsets_of_deleted_segments(tmp_path: Path) -> None:
    data = str(tmp_path)
    with write_log(data, 300) as log:
        replayer = open_replayer(data, log, segment_scale=1)
        try:
            while replayer.replay_available():
                pass
            replayer.checkpoint()
            await replayer.scan_tombstones()
            before = len(replayer.tombstones)
            cut = log.end_offset // 2
            assert await replayer.without_log_reads(lambda: log.delete_before(cut))
            assert 0 < log.min_offset <= cut
            assert 0 < len(replayer.tombstones) < before
            everything = every_tombstone(replayer)
            assert replayer.tombstones.between(0, replayer.position) == [r[0] for r in everything]
            assert replayer.tombstones_between(0, replayer.position) == everything
        finally:
            replayer.close()


def test_an_offset_that_is_no_tombstone_is_corruption(tmp_path: Path) -> None:
    data = str(tmp_path)
    with write_log(data, 50) as log:
        stones = read_tombstones(REAL_FS, data, 0, log.end_offset)
        offsets = [offset for offset, _, _ in stones]
        assert read_tombstones_at(REAL_FS, data, offsets) == stones
        message = next(r.offset for r in log.iter_from(0) if r.type == message_log.TYPE_MESSAGE)
        with pytest.raises(CorruptionError, match="lists a record of type 2"):
            read_tombstones_at(REAL_FS, data, [message])
        with pytest.raises(CorruptionError, match="past message_log's files"):
            read_tombstones_at(REAL_FS, data, [log.end_offset + 10])
