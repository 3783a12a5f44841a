"""Retention in a real ``delayd serve``: over a data directory whose buckets are hours
old (written in-process on trio's clock, two hours in the past), the server deletes
what was delivered, delivers what was not and then deletes it too, survives kill -9
— also in the middle of a pass — and delivers a past-due message sent afterwards.
Nothing is lost, nothing is delivered twice."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest
import trio
import trio.testing

import delayd
from delayd.logs import layout, message_log, schedule_log
from delayd.logs.bucket_files import BucketFiles
from delayd.logs.buckets import bucket_name, bucket_of
from delayd.logs.dispatch_files import DispatchFiles
from delayd.logs.dispatch_log import EntryKind
from delayd.logs.message_log import MessageRecord
from delayd.replay.state import ensure_segment_scale
from delayd.server.receiver import IntakeLimits
from storage.fs import REAL_FS
from tests.delivery_pipeline import Pipeline, RecordingTarget
from tests.delivery_support import (
    SUBJECT,
    broker_stats,
    consume,
    exactly_once,
    hostport,
    poll,
)
from tests.intake_support import write_config

pytestmark = pytest.mark.slow
MINUTE = 60_000
CONFIG = (
    "[message_log]\nsegment_bytes = 4096\n"
    "[intake]\nmax_record_bytes = 1024\n"
    "[replay]\ncheckpoint_interval_ms = 100\n"
    "[retention]\ninterval_ms = 100\nbucket_ms = 0\nmessage_log_ms = 0\n"
)


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def names(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.isdigit())


def old_history(data: Path, origin_ms: int) -> dict[str, list[str]]:
    """Write, on trio's clock from ``origin_ms`` (hours ago): messages delivered at
    origin + 1 min; messages due at origin + 10 min, never delivered (their only broker
    group was down); messages due a few seconds from the real now. Their ids."""
    target = RecordingTarget("local")
    with Pipeline(
        str(data),
        [target],
        message_log_segment_bytes=4096,
        limits=IntakeLimits(max_record_bytes=1024),
    ) as pipeline:
        pipeline.delivery.ticker.origin_ms = origin_ms
        ids: dict[str, list[str]] = {}

        async def main() -> None:
            ids["delivered"] = pipeline.schedule([origin_ms + MINUTE + i for i in range(80)])
            ids["undelivered"] = pipeline.schedule([origin_ms + 10 * MINUTE + i for i in range(40)])
            ids["future"] = pipeline.schedule([wall_ms() + 4000 + i for i in range(20)])
            async with pipeline.running():
                await trio.sleep(5 * 60)
                target.unavailable = True
                await trio.sleep(5 * 60 + 30)  # past the undelivered ones' due time
                await pipeline.stop()

        # Jumps soon: retries against the dead group wake the sender often, and lateness
        # does not matter here.
        trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0.002))
    assert sorted(r.message.message_id for r in target.received) == sorted(ids["delivered"])
    return ids


def test_served_retention_deletes_delivers_and_restarts(procs, tmp_path):
    data = tmp_path / "data"
    origin = bucket_of(wall_ms() - 2 * 60 * MINUTE, 1)
    ids = old_history(data, origin)
    delivered_bucket = bucket_name(origin + MINUTE)
    undelivered_bucket = bucket_name(origin + 10 * MINUTE)
    schedule_dir = layout.schedule_log_dir(str(data))
    dispatch_dir = layout.dispatch_log_dir(str(data))
    assert {delivered_bucket, undelivered_bucket} <= set(names(schedule_dir))
    segments_before = names(layout.message_log_dir(str(data)))
    assert len(segments_before) >= 3

    config = write_config(tmp_path / "c.toml", CONFIG)
    server = procs.serve(data, "--config", config)
    # The undelivered and the future messages reach the broker, once; the delivered
    # bucket's are not sent again.
    pending = ids["undelivered"] + ids["future"]
    received = exactly_once(consume(server.broker_address, len(pending), timeout_s=60))
    assert sorted(received) == sorted(pending)
    # Then both old buckets are complete, below the loading bucket and old: deleted,
    # with message_log up to the segment being written.
    poll(
        lambda: not {delivered_bucket, undelivered_bucket} & set(names(schedule_dir)),
        30,
        "old buckets deleted",
    )
    # dispatch_log's files go second (after schedule_log's unlink is durable).
    poll(
        lambda: not {delivered_bucket, undelivered_bucket} & set(names(dispatch_dir)),
        30,
        "their dispatch_log files deleted",
    )
    poll(
        lambda: len(names(layout.message_log_dir(str(data)))) == 1,
        30,
        "replayed segments deleted",
    )
    deleted = 'delayd_retention_deleted_files_total{{log="{}"}}'.format
    # The counts follow the unlinks (a worker thread's): wait for them, then assert.
    poll(
        lambda: (
            min(server.metrics().get(deleted(log), 0) for log in ("schedule_log", "dispatch_log"))
            >= 2
            and server.metrics().get(deleted("message_log"), 0) >= len(segments_before) - 1
        ),
        10,
        "the deletions counted",
    )
    values = server.metrics()
    deleted_segments = values[deleted("message_log")]
    assert deleted_segments == len(segments_before) - 1
    assert values['delayd_retention_deleted_bytes_total{log="schedule_log"}'] > 0
    assert "retention: deleted" in server.log_path.read_text()
    # The pending count forgot the deleted buckets, and counts nothing left (it reads
    # dispatch_log every second).
    poll(
        lambda: (
            sum(v for k, v in server.metrics().items() if k.startswith("delayd_pending_messages{"))
            == 0
        ),
        10,
        "nothing pending",
    )

    # kill -9 and restart over what retention left: nothing is sent again.
    server.kill()
    server.close()
    server = procs.serve(data, "--config", config)
    time.sleep(1)
    assert broker_stats(server.broker_address)["broker.duplicates_total"] == 0
    again = exactly_once(consume(server.broker_address, len(pending), group="after-restart"))
    assert sorted(again) == sorted(pending)

    # A message due long ago, in a bucket retention deleted, is delivered (at once).
    with delayd.Producer(hostport(server.address)) as producer:
        producer.send(SUBJECT, b"late", at_ms=origin + MINUTE + 5, message_id="late")
    final = exactly_once(consume(server.broker_address, len(pending) + 1, group="final"))
    assert sorted(final) == sorted([*pending, "late"])
    assert broker_stats(server.broker_address)["broker.duplicates_total"] == 0


def write_delivered_buckets(data: Path, origin_ms: int, count: int) -> list[str]:
    """``count`` old buckets from ``origin_ms``, each with one record and a dispatch_log
    saying it was delivered and is complete, written straight into the files."""
    ensure_segment_scale(REAL_FS, str(data), 1)
    schedule = BucketFiles(layout.schedule_log_dir(str(data)))
    dispatch = DispatchFiles(layout.dispatch_log_dir(str(data)))
    out = []
    for i in range(count):
        start = origin_ms + i * MINUTE
        record = MessageRecord(start, i + 1, start, f"old-{i}", SUBJECT, body=b"x")
        payload = schedule_log.encode_scheduled(0, message_log.encode_record(record))
        schedule.append_batch(start, [payload], schedule_log.TYPE_SCHEDULED)
        dispatch.record(start, EntryKind.DISPATCHED, [0], start, b"local")
        dispatch.mark_complete(start, schedule.get(start).end_offset, start)
        out.append(bucket_name(start))
    schedule.close()
    dispatch.close()
    return out


ROUNDS = 6


def server_log(tmp_path: Path) -> str:
    path = tmp_path / "data-serve.log"
    return path.read_text() if path.exists() else ""


def test_kill_9_in_the_middle_of_retention_starts_cleanly(procs, tmp_path):
    """Many delivered buckets for the first passes to delete, 64 per batch; the server
    is killed at random moments while it does. Every restart must start, no
    bucket may be left with a schedule_log file and no dispatch_log file (its records
    would be sent again), none the other way round after a start, and in the end all
    are gone (but the one the wheel loaded last) — without a single message sent."""
    data = tmp_path / "data"
    origin = bucket_of(wall_ms() - 2 * 1500 * MINUTE, 1)
    written = write_delivered_buckets(data, origin, 1500)
    schedule_dir = layout.schedule_log_dir(str(data))
    dispatch_dir = layout.dispatch_log_dir(str(data))
    fast = CONFIG.replace("interval_ms = 100\n", "interval_ms = 10\n")
    config = write_config(tmp_path / "c.toml", fast)
    rng = random.Random(20261122)
    partial = 0
    for _ in range(ROUNDS):
        done = server_log(tmp_path).count("retention: deleted")
        server = procs.serve(data, "--config", config)
        if set(names(schedule_dir)) != {written[-1]}:
            # The loader reads every old bucket first; kill once deleting has begun.
            poll(
                lambda done=done: server_log(tmp_path).count("retention: deleted") > done,
                30,
                "a deletion",
            )
            time.sleep(rng.uniform(0, 0.1))
        server.kill()
        server.close()
        schedule, dispatch = set(names(schedule_dir)), set(names(dispatch_dir))
        assert schedule <= dispatch, f"schedule_log without dispatch_log: {schedule - dispatch}"
        if 0 < len(schedule) < len(written):
            partial += 1
    server = procs.serve(data, "--config", config)
    # All but the newest: the bucket the wheel loaded last stays (docs/operations.md).
    poll(
        lambda: set(names(schedule_dir)) == set(names(dispatch_dir)) == {written[-1]},
        60,
        "the old buckets deleted",
    )
    stats = broker_stats(server.broker_address)
    assert stats["broker.messages_stored_total"] == 0  # nothing was sent again
    assert partial >= 1, "no kill landed while buckets were being deleted"
