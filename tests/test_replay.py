"""The replayer (delayd.replay): message_log → schedule_log buckets, the hook, the
checkpoint order, recovery after crashes and torn tails, lag, the trio task."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest
import trio

from delayd.logs import layout, message_log, schedule_log
from delayd.logs.buckets import bucket_name, bucket_of
from delayd.logs.message_log import MessageRecord
from delayd.replay import SegmentScaleMismatchError, open_replayer
from delayd.replay.state import read_replay_checkpoint
from storage.crashfs import CrashSimFileSystem
from storage.errors import CorruptionError
from storage.framing import HEADER_SIZE
from storage.fs import REAL_FS, FileSystem
from storage.segmented_log import SegmentedLog
from tests.intake_support import check_exactly_once, read_schedule_log

T = 1_795_341_600_000  # 2026-11-22T10:00:00Z
MINUTE = 60_000


class World:
    """A data directory with message_log and a replayer, reopened like a restart."""

    def __init__(self, data: str, fs: FileSystem = REAL_FS, scale: int = 1, **options) -> None:
        self.data, self.fs, self.scale, self.options = data, fs, scale, options
        self.calls: list[tuple[int, int, int]] = []
        self.sequence = 0
        self.open()

    def open(self) -> None:
        self.log = SegmentedLog.open(
            layout.message_log_dir(self.data), fs=self.fs, segment_size=4096
        )
        self.replayer = open_replayer(
            self.data,
            self.log,
            segment_scale=self.scale,
            fs=self.fs,
            on_scheduled=self.record_calls,
            **self.options,
        )
        self.sequence = self.replayer.recovery.next_sequence - 1

    def record_calls(self, bucket: int, offsets: list[int], dues: list[int]) -> None:
        """The hook: one (bucket, offset, due_ms) per record it was told about."""
        assert offsets == sorted(offsets) and len(offsets) == len(dues)
        self.calls.extend((bucket, offset, due) for offset, due in zip(offsets, dues, strict=True))

    def append(self, dues: list[int], flush: bool = True, offer: bool = False) -> list[int]:
        """message_log records due at ``dues``, numbered on; returns their offsets.
        ``offer``: hand them to the replayer too, as intake does."""
        payloads = []
        for due in dues:
            self.sequence += 1
            record = MessageRecord(
                due_ms=due,
                sequence=self.sequence,
                receive_ms=T,
                message_id=f"m{self.sequence}",
                subject="orders",
                key="k" if self.sequence % 2 else None,
                properties={"n": str(self.sequence)},
                body=b"b" * (self.sequence % 97),
            )
            payloads.append(message_log.encode_record(record))
        offsets = self.log.append_batch(payloads, message_log.TYPE_MESSAGE)
        if offer:
            self.replayer.offer(offsets, payloads)
        if flush:
            self.log.flush()
        self.replayer.notify(self.sequence)
        return offsets

    def close(self) -> None:
        self.replayer.close()
        self.log.close()


def spread(count: int, buckets: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [T + rng.randrange(buckets) * MINUTE + rng.randrange(MINUTE) for _ in range(count)]


def test_records_land_in_the_bucket_of_their_due_time_and_reach_the_hook(tmp_path):
    world = World(str(tmp_path), scale=5)
    dues = spread(200, 30)
    offsets = world.append(dues)
    assert world.replayer.replay_available() == 200
    world.replayer.checkpoint()
    scheduled = read_schedule_log(tmp_path)
    assert sorted(s.message_log_offset for s in scheduled) == offsets
    for s in scheduled:
        assert s.bucket == bucket_of(s.message.due_ms, 5)
    names = sorted(os.listdir(layout.schedule_log_dir(str(tmp_path))))
    assert names == sorted({bucket_name(bucket_of(d, 5)) for d in dues})
    assert sorted(world.calls) == sorted((s.bucket, s.offset, s.message.due_ms) for s in scheduled)
    # within a bucket, records are in message_log order
    for bucket in {s.bucket for s in scheduled}:
        origins = [s.message_log_offset for s in scheduled if s.bucket == bucket]
        assert origins == sorted(origins)
    check_exactly_once(tmp_path, 5)
    world.close()


def test_only_durable_message_log_records_are_replayed(tmp_path):
    world = World(str(tmp_path))
    world.append([T] * 3, flush=False)
    assert world.replayer.replay_available() == 0
    assert world.replayer.lag_records == 3
    assert world.replayer.lag_bytes == world.log.end_offset > 0
    world.log.flush()
    assert world.replayer.replay_available(max_records=2) == 2
    assert world.replayer.lag_records == 1
    assert world.replayer.replay_available() == 1
    assert (world.replayer.lag_records, world.replayer.lag_bytes) == (0, 0)
    world.close()


def test_checkpoint_covers_only_what_is_durable_in_schedule_log(tmp_path):
    """Power off right after a checkpoint (only fsynced data survives): every record
    below the checkpoint's position is in schedule_log."""
    fs = CrashSimFileSystem()
    world = World("/data", fs=fs, max_open_buckets=2)
    world.append(spread(60, 6))
    world.replayer.replay_available()
    assert world.replayer.checkpoint()
    assert not world.replayer.checkpoint()  # nothing new: no second write
    fs.materialize(str(tmp_path), "drop", random.Random(0))
    data = tmp_path / "data"
    checkpoint = read_replay_checkpoint(REAL_FS, str(data))
    assert checkpoint.position == world.log.end_offset
    assert checkpoint.next_sequence == 61
    # the known lengths are those of the buckets open when it was written
    assert len(checkpoint.bucket_sizes) == 2
    check_exactly_once(data, 1)


def test_restart_after_a_crash_cuts_what_the_checkpoint_does_not_cover(tmp_path):
    world = World(str(tmp_path), max_open_buckets=3)
    world.append(spread(50, 8, seed=1))
    world.replayer.replay_available()
    world.replayer.checkpoint()
    world.append(spread(50, 8, seed=2))
    world.replayer.replay_available()  # replayed, not checkpointed: then the crash
    before = read_schedule_log(tmp_path)
    world.log.close()  # the process dies; the page cache keeps what it wrote
    world = World(str(tmp_path), max_open_buckets=3)
    report = world.replayer.recovery
    assert report.records_after_checkpoint == 50
    assert sum(report.cut_bytes.values()) > 0
    assert report.buckets_scanned >= 1  # some touched buckets were not open at checkpoint
    assert report.next_sequence == 101
    assert world.replayer.replay_available() == 50
    world.replayer.checkpoint()
    after = read_schedule_log(tmp_path)
    # re-appending writes the same bytes in the same order: same offsets as before
    assert {(s.bucket, s.offset, s.message_log_offset) for s in after} == {
        (s.bucket, s.offset, s.message_log_offset) for s in before
    }
    check_exactly_once(tmp_path, 1)
    world.close()


def test_torn_tail_of_a_bucket_is_cut_and_replay_fills_it_again(tmp_path):
    world = World(str(tmp_path))
    world.append([T + 1000 * i for i in range(10)])
    world.replayer.replay_available()
    world.replayer.checkpoint()
    known = read_replay_checkpoint(REAL_FS, str(tmp_path)).bucket_sizes[T]
    world.append([T + 20_000 + i for i in range(10)])
    world.replayer.replay_available()
    world.log.close()
    path = Path(layout.schedule_log_dir(str(tmp_path))) / bucket_name(T)
    whole = path.read_bytes()
    assert len(whole) > known
    with open(path, "r+b") as f:  # a torn write: the last record half there, then junk
        f.truncate(len(whole) - 30)
        f.seek(0, os.SEEK_END)
        f.write(b"\x00\x07junk")
    world = World(str(tmp_path))
    assert path.stat().st_size == known  # cut back to what the checkpoint covers
    assert world.replayer.recovery.cut_bytes[T] > 0
    assert world.replayer.recovery.buckets_scanned == 0  # its length was known
    assert world.replayer.replay_available() == 10
    world.replayer.checkpoint()
    assert path.read_bytes() == whole
    check_exactly_once(tmp_path, 1)
    world.close()


def test_torn_tail_of_message_log_is_cut_and_the_rest_replayed(tmp_path):
    world = World(str(tmp_path))
    world.append(spread(30, 3))
    world.replayer.replay_available()
    world.replayer.checkpoint()
    world.append(spread(5, 3, seed=9))
    world.log.close()
    segments = sorted(Path(layout.message_log_dir(str(tmp_path))).glob("0*"))
    with open(segments[-1], "ab") as f:  # a record whose write was cut short
        f.write(b"\x40\x00\x00\x00\x11\x22\x33\x44\x02" + b"half a record")
    world = World(str(tmp_path))
    assert world.log.recovery.truncated_bytes == HEADER_SIZE + 13
    assert world.replayer.recovery.records_after_checkpoint == 5
    assert world.replayer.replay_available() == 5
    world.replayer.checkpoint()
    assert len(check_exactly_once(tmp_path, 1)) == 35
    world.close()


def test_offered_records_are_replayed_from_memory_like_from_the_log(tmp_path):
    """Intake offers what it appends; replay takes it from memory when the offered tail
    starts at its position, and reads message_log across segment rolls, after the tail
    overflowed, and for records appended without an offer."""
    world = World(str(tmp_path), max_tail_bytes=6000)
    rng = random.Random(5)
    for round_no in range(60):
        dues = spread(rng.randint(1, 12), 4, seed=round_no)
        world.append(dues, flush=rng.random() < 0.7, offer=round_no % 9 != 4)
        if rng.random() < 0.5:
            world.replayer.replay_available(rng.randint(1, 20))
    world.log.flush()
    while world.replayer.replay_available(7):
        pass
    world.replayer.checkpoint()
    replayer = world.replayer
    assert 0 < replayer.replayed_from_tail < replayer.replayed_total
    assert replayer.tail_overflows > 0
    assert len(os.listdir(layout.message_log_dir(str(tmp_path)))) > 5  # segments rolled
    world.close()
    check_exactly_once(tmp_path, 1)  # byte for byte what message_log holds


def test_changing_segment_scale_is_refused_with_both_values(tmp_path):
    world = World(str(tmp_path), scale=1)
    world.append([T])
    world.replayer.replay_available()
    world.close()
    log = SegmentedLog.open(layout.message_log_dir(str(tmp_path)))
    with pytest.raises(SegmentScaleMismatchError) as caught:
        open_replayer(str(tmp_path), log, segment_scale=15)
    message = str(caught.value)
    assert "segment_scale = 1 minute" in message and "segment_scale = 15" in message
    assert (caught.value.stored, caught.value.requested) == (1, 15)
    with pytest.raises(ValueError, match=r"1\.\.60"):
        open_replayer(str(tmp_path), log, segment_scale=61)
    os.unlink(layout.meta_checkpoint_path(str(tmp_path)))
    with pytest.raises(CorruptionError, match="segment_scale it was written with is unknown"):
        open_replayer(str(tmp_path), log, segment_scale=1)
    log.close()


def test_open_bucket_files_stay_bounded(tmp_path):
    world = World(str(tmp_path), max_open_buckets=4, batch_records=7)
    world.append(spread(300, 40, seed=3))
    peak = 0
    while world.replayer.replay_available(7):
        peak = max(peak, world.replayer.buckets.open_count)
    assert peak == 8  # four in the LRU, four evicted waiting for the next flush
    assert world.replayer.buckets.opens > 40  # files were closed and opened again
    world.replayer.checkpoint()
    check_exactly_once(tmp_path, 1)
    world.close()


def test_a_checkpoint_past_the_end_of_message_log_is_corruption(tmp_path):
    world = World(str(tmp_path))
    world.append([T] * 5)
    world.replayer.replay_available()
    world.replayer.checkpoint()
    world.close()
    for segment in Path(layout.message_log_dir(str(tmp_path))).iterdir():
        segment.unlink()  # message_log lost, the checkpoint still says 5 records
    with pytest.raises(CorruptionError, match="records the replayer has not"):
        World(str(tmp_path))


def test_unknown_record_type_in_message_log_stops_replay(tmp_path):
    world = World(str(tmp_path))
    world.log.append(b"from a newer version", 9)  # 3 and 4 are tombstones since issue 8
    world.log.flush()
    with pytest.raises(message_log.RecordFormatError, match="unknown type 9"):
        world.replayer.replay_available()
    world.close()


async def test_run_loop_replays_on_notify_and_checkpoints_on_its_interval(tmp_path, autojump_clock):
    world = World(str(tmp_path), checkpoint_interval_s=5.0)
    replayer = world.replayer
    scheduled = trio.Event()

    def hook(bucket, offsets, dues):
        world.record_calls(bucket, offsets, dues)
        if len(world.calls) == 100:
            scheduled.set()

    replayer.on_scheduled = hook
    async with trio.open_nursery() as nursery:
        await nursery.start(replayer.run)
        started = trio.current_time()
        world.append(spread(100, 5))
        await scheduled.wait()
        assert trio.current_time() == started  # on notify, not on a timer
        assert replayer.checkpointed_position == 0  # not before the interval
        await replayer.wait_checkpointed(world.log.end_offset)
        assert trio.current_time() == pytest.approx(started + 5.0)
        assert replayer.checkpoints == 1
        world.append([T])
        await replayer.stop()  # replays the rest and checkpoints at once
        assert trio.current_time() == pytest.approx(started + 5.0)
    assert replayer.checkpoints == 2
    assert read_replay_checkpoint(REAL_FS, str(tmp_path)).next_sequence == 102
    check_exactly_once(tmp_path, 1)
    world.close()


async def test_run_loop_checkpoints_when_the_interval_rounds_down(tmp_path, autojump_clock):
    """Started at 0.7 s with a 0.1 s interval, the checkpoint is due at 0.7 + 0.1, and
    (0.7 + 0.1) - 0.7 < 0.1: the loop once decided "not yet" and waited 0 s there for
    ever, on trio's MockClock (it hung a CI run). A watchdog thread cancels a hung loop
    after 10 s of real time, so the test fails instead of hanging."""
    assert (0.7 + 0.1) - 0.7 < 0.1  # the rounding this is about
    autojump_clock.jump(0.7 - trio.current_time())
    world = World(str(tmp_path), checkpoint_interval_s=0.1)
    token = trio.lowlevel.current_trio_token()
    async with trio.open_nursery() as nursery:
        await nursery.start(world.replayer.run)
        watchdog = threading.Timer(10, token.run_sync_soon, (nursery.cancel_scope.cancel,))
        watchdog.start()
        try:
            world.append([T])
            await world.replayer.wait_checkpointed(world.log.end_offset)
            await world.replayer.stop()
        finally:
            watchdog.cancel()
    assert world.replayer.checkpoints == 1
    assert not nursery.cancel_scope.cancelled_caught
    world.close()


async def test_run_loop_polls_when_told_to(tmp_path, autojump_clock):
    """Under the async flush policy message_log becomes durable without a notify."""
    world = World(str(tmp_path), poll_interval_s=0.01)
    scheduled = trio.Event()
    world.replayer.on_scheduled = lambda *call: scheduled.set()
    async with trio.open_nursery() as nursery:
        await nursery.start(world.replayer.run)
        world.replayer.notify(0)  # wakes the loop; nothing durable yet
        world.append([T], flush=False)
        await trio.sleep(0.05)
        assert world.replayer.position == 0
        world.log.flush()  # durable, and nobody says so
        flushed = trio.current_time()
        await scheduled.wait()
        assert trio.current_time() - flushed < 0.0101  # found by the next poll
        await world.replayer.stop()
    assert world.replayer.position == world.log.end_offset
    world.close()


def test_schedule_records_carry_the_message_unchanged(tmp_path):
    world = World(str(tmp_path))
    world.append([T + 5])
    world.replayer.replay_available()
    world.replayer.checkpoint()
    path = Path(layout.schedule_log_dir(str(tmp_path))) / bucket_name(T)
    raw = path.read_bytes()[HEADER_SIZE:]
    with SegmentedLog.open(layout.message_log_dir(str(tmp_path))) as log:
        (record,) = log.iter_from(0)
    assert raw == schedule_log.encode_scheduled(record.offset, record.payload)
    world.close()
