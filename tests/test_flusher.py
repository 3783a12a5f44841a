"""LogWriter: sync (group commit) and async flush policies, tailing, kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import trio

from storage.errors import StorageError
from storage.flusher import FlushMode, FlushPolicy, LogWriter
from storage.segmented_log import SegmentedLog
from tests.helpers.sync_appender import payload
from tests.trio_support import running

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def test_sync_acks_only_durable_records_and_shares_fsyncs(tmp_path):
    with SegmentedLog.open(str(tmp_path)) as log:
        writer = LogWriter(log, FlushPolicy("sync"))
        acked_ends: list[tuple[int, int]] = []

        async def producer(lane: int) -> None:
            for round_ in range(20):
                offsets = await writer.append_batch([b"%d-%d" % (lane, round_)] * 10)
                # at the moment of the ack, the records are durable
                acked_ends.append((offsets[-1], log.durable_offset))

        async with running(writer.run), trio.open_nursery() as producers:
            for lane in range(16):
                producers.start_soon(producer, lane)
        assert len(acked_ends) == 16 * 20
        assert all(last < durable for last, durable in acked_ends)
        # group commit: 320 acknowledged batches needed far fewer fsyncs
        assert 0 < writer.fsyncs < 320 / 2


async def test_on_durable_runs_after_the_fsync_before_its_waiters_wake(tmp_path):
    with SegmentedLog.open(str(tmp_path)) as log:
        seen: list[tuple[int, int]] = []  # (durable offset, acks so far) at each call
        acks: list[int] = []
        writer = LogWriter(log, on_durable=lambda: seen.append((log.durable_offset, len(acks))))
        async with running(writer.run):
            offsets = await writer.append_batch([b"x" * 10] * 3)
            acks.append(offsets[-1])
            # Asked for without waiting: the flusher still syncs, and calls the hook.
            log.append_batch([b"y"])
            end = log.end_offset
            writer.request_flush()
            while log.durable_offset < end:
                await trio.sleep(0.001)
            while len(seen) < 2:  # durable before the hook runs, in the flusher's next step
                await trio.sleep(0.001)
        assert seen[0][0] > acks[0] and seen[0][1] == 0  # before the append's ack
        assert seen[-1][0] == end


async def test_a_failing_on_durable_stops_the_writer_and_fails_its_waiters(tmp_path):
    with SegmentedLog.open(str(tmp_path)) as log:

        def broken() -> None:
            raise RuntimeError("reput broke")

        writer = LogWriter(log, on_durable=broken)
        with pytest.RaisesGroup(pytest.RaisesExc(RuntimeError, match="reput broke")):
            async with trio.open_nursery() as nursery:
                await nursery.start(writer.run)
                with pytest.raises(StorageError, match="reput broke"):
                    await writer.append_batch([b"x"])


async def test_async_policy_acks_at_once_and_syncs_within_the_interval(tmp_path, autojump_clock):
    with SegmentedLog.open(str(tmp_path)) as log:
        writer = LogWriter(log, FlushPolicy(FlushMode.ASYNC, interval_ms=50))
        async with running(writer.run):
            start = trio.current_time()
            await writer.append_batch([b"a"] * 100)
            assert trio.current_time() == start  # no waiting for fsync
            assert log.durable_offset < log.end_offset
            await trio.sleep(0.049)
            assert log.durable_offset < log.end_offset  # not before the interval
            await trio.sleep(0.002)
            # sleep(0) keeps this task runnable, so the virtual clock stands still while the
            # real fsync finishes in its thread.
            while log.durable_offset < log.end_offset:
                await trio.sleep(0)
            assert trio.current_time() - start == pytest.approx(0.051)


async def test_async_policy_explicit_flush(tmp_path):
    with SegmentedLog.open(str(tmp_path)) as log:
        writer = LogWriter(log, FlushPolicy(FlushMode.ASYNC, interval_ms=60_000))
        async with running(writer.run):
            await writer.append_batch([b"b"] * 10)
            assert await writer.flush() == log.end_offset


async def test_append_before_run_is_refused(tmp_path):
    with SegmentedLog.open(str(tmp_path)) as log, pytest.raises(StorageError, match="not running"):
        await LogWriter(log).append_batch([b"x"])


def test_invalid_policy_is_refused():
    with pytest.raises(ValueError):
        FlushPolicy("sometimes")
    with pytest.raises(ValueError, match="interval_ms"):
        FlushPolicy("async", interval_ms=0)


async def test_reader_tails_while_a_writer_appends(tmp_path):
    with SegmentedLog.open(str(tmp_path), segment_size=2048) as log:
        writer = LogWriter(log)
        expected = [b"tail-%04d" % i for i in range(500)]
        seen: list[bytes] = []

        async def tail() -> None:
            offset = 0
            while len(seen) < len(expected):
                for record in log.iter_from(offset):
                    seen.append(record.payload)
                    offset = record.next_offset
                await trio.sleep(0)

        async with trio.open_nursery() as nursery:
            await nursery.start(writer.run)
            nursery.start_soon(tail)
            for i in range(0, 500, 5):
                await writer.append_batch(expected[i : i + 5])
            with trio.fail_after(10):
                while len(seen) < len(expected):
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
        assert seen == expected


@pytest.mark.slow
def test_kill_9_while_appending_in_sync_mode_loses_no_ack(tmp_path):
    for round_ in range(5):
        directory = str(tmp_path / f"round{round_}")
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.sync_appender", directory],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        acked: dict[int, int] = {}
        deadline = time.monotonic() + 20
        while len(acked) < 2000 + round_ * 1500 and time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            _, offset, index = line.split()
            acked[int(offset)] = int(index)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert len(acked) >= 2000, "the child did not get going"
        with SegmentedLog.open(directory, segment_size=64 * 1024) as log:
            stored = {r.offset: r.payload for r in log.iter_from(0)}
        for offset, index in acked.items():
            assert stored.get(offset) == payload(index)
