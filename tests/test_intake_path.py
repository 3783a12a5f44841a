"""The intake path in process (delayd.server.intake, delayd.server.app): acks only after
durability, group commit, BUSY from the live load figures, and a DelayServer run in
process with the public async producer."""

from __future__ import annotations

import random
from pathlib import Path

import trio

import delayd
from delayd.logs import layout
from delayd.protocol import Message, ResultCode
from delayd.replay import open_replayer
from delayd.server import DelayServer, ServeConfig
from delayd.server.intake import IntakePath
from delayd.server.receiver import IntakeLimits, Receiver
from storage.crashfs import CrashSimFileSystem
from storage.flusher import FlushMode, FlushPolicy, LogWriter
from storage.fs import REAL_FS, FileSystem
from storage.segmented_log import SegmentedLog
from tests.intake_support import check_exactly_once, read_message_log
from tests.trio_support import running

NOW = 1_795_341_600_000


def make_intake(data: str, fs: FileSystem, limits: IntakeLimits | None = None) -> IntakePath:
    log = SegmentedLog.open(layout.message_log_dir(data), fs=fs)
    replayer = open_replayer(data, log, segment_scale=1, fs=fs)
    receiver = Receiver(limits or IntakeLimits(), replayer.recovery.next_sequence)
    return IntakePath(receiver, LogWriter(log), replayer, clock=lambda: NOW)


def batch(prefix: str, count: int) -> list[Message]:
    return [Message(f"{prefix}-{i}", "orders", body=b"x" * 100, delay_ms=i) for i in range(count)]


async def test_an_ack_means_the_message_survives_power_loss(tmp_path):
    fs = CrashSimFileSystem()
    fs.mkdir("/data")
    fs.fsync_dir("/")
    intake = make_intake("/data", fs)
    async with running(intake.writer.run):
        results = await intake.send_batch(batch("acked", 50))
        assert [r.code for r in results] == [ResultCode.OK] * 50
        assert intake.pending_acks == 0
        unacked = intake.append(batch("unacked", 5))  # appended, its ack not awaited
        fs.materialize(str(tmp_path / "after"), "drop", random.Random(0))
    ids = {r.message_id for _, r in read_message_log(tmp_path / "after" / "data")}
    assert ids == {f"acked-{i}" for i in range(50)}  # the unacked five were not durable
    assert len(unacked.payloads) == 5


async def test_concurrent_batches_share_fsyncs(tmp_path):
    intake = make_intake(str(tmp_path), REAL_FS)
    async with running(intake.writer.run), trio.open_nursery() as senders:
        for n in range(40):
            senders.start_soon(intake.send_batch, batch(f"c{n}", 10))
    assert intake.receiver.accepted_total == 400
    assert intake.writer.fsyncs < 40  # group commit: far fewer fsyncs than batches
    intake.replayer.replay_available()
    intake.replayer.checkpoint()
    intake.replayer.close()
    intake.log.close()
    assert len(check_exactly_once(tmp_path, 1)) == 400


async def test_busy_from_pending_acks_and_from_replay_lag(tmp_path):
    limits = IntakeLimits(max_pending_acks=10, max_replay_lag_records=100)
    intake = make_intake(str(tmp_path), REAL_FS, limits)
    async with running(intake.writer.run):
        first = intake.append(batch("a", 10))  # 10 waiting for their fsync
        second = intake.append(batch("b", 3))
        assert [r.code for r in intake.receiver.acknowledge(second)] == [ResultCode.BUSY] * 3
        await intake.acknowledge(first)
        assert intake.pending_acks == 0
        # The replayer is not running: 90 more accepted records put it 100 behind.
        await intake.send_batch(batch("c", 90))
        assert intake.replayer.lag_records == 100
        busy = await intake.send_batch(batch("d", 2))
        assert [r.code for r in busy] == [ResultCode.BUSY] * 2
        assert "max_replay_lag_records" in busy[0].reason
        intake.replayer.replay_available()
        assert intake.replayer.lag_records == 0
        again = await intake.send_batch(batch("d", 2))
        assert [r.code for r in again] == [ResultCode.OK] * 2
    intake.replayer.close()
    intake.log.close()


def intake_only() -> ServeConfig:
    """A DelayServer for tests run in process: intake only, on a free port, async flush."""
    return ServeConfig(
        listen=("127.0.0.1", 0),
        broker_listen=None,
        metrics_listen=None,
        http_listen=None,
        flush=FlushPolicy(FlushMode.ASYNC, interval_ms=20),
    )


async def test_delay_server_in_process_with_the_public_producer(tmp_path):
    """DelayServer.run under trio, the async client on it, async flush, shutdown."""
    server = await trio.to_thread.run_sync(DelayServer.open, str(tmp_path), intake_only())
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(server.run)
        assert bound.broker is None and bound.metrics is None
        async with delayd.open_producer("{}:{}".format(*bound.intake)) as producer:
            receipt = await producer.send("orders", b"hello", delay_ms=60_000, key="k")
            receipts = await producer.send_batch(
                [{"subject": "orders", "body": b"%d" % i, "at_ms": 1} for i in range(20)]
            )
        assert receipt.ok and receipt.due_ms is not None
        assert receipt.queue_offset == 1  # the sequence (docs/protocol.md, SEND_BATCH results)
        assert [r.queue_offset for r in receipts] == list(range(2, 22))
        assert all(r.ok for r in receipts)
        server.request_stop()
    assert server.replayer.checkpointed_position == server.message_log.end_offset > 0
    scheduled = check_exactly_once(Path(tmp_path), 1)
    assert scheduled[receipt.message_id].message.due_ms == receipt.due_ms
    assert scheduled[receipt.message_id].message.key == "k"
