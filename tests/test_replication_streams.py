"""The streams of a delay data directory, and the property replication relies on: a
member derives the same schedule_log from the same message_log (dispatch_log entries
name schedule_log offsets, so a follower's derived files must match the leader's)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from delayd.broker.broker import Broker
from delayd.broker.replica import BrokerReplica
from delayd.logs import layout, message_log
from delayd.logs.dispatch_files import DispatchFiles
from delayd.logs.dispatch_log import EntryKind
from delayd.logs.message_log import MessageRecord
from delayd.replay import open_replayer
from delayd.replication.streams import (
    MESSAGE_LOG,
    BrokerStreams,
    DelayStreams,
    JoinedStreams,
    check_stream_name,
    dispatch_stream,
)
from storage.segmented_log import SegmentedLog

T = 1_795_341_600_000  # 2026-11-22T10:00:00Z


def test_streams_list_message_log_then_buckets_in_time_order(tmp_path: Path) -> None:
    streams = DelayStreams(str(tmp_path))
    try:
        assert streams.names() == [MESSAGE_LOG]
        streams.get(dispatch_stream("202611221531")).append(b"x" * 32)
        streams.get(dispatch_stream("202611221530"))
        os.makedirs(layout.dispatch_log_dir(str(tmp_path)), exist_ok=True)
        Path(layout.dispatch_log_dir(str(tmp_path)), "junk.tmp").write_bytes(b"")
        assert streams.names() == [
            MESSAGE_LOG,
            dispatch_stream("202611221530"),
            dispatch_stream("202611221531"),
        ]
        assert streams.ends()[dispatch_stream("202611221531")] == 41
        assert streams.flush_all() == {dispatch_stream("202611221531"): 41}
    finally:
        streams.close()
    reopened = DelayStreams(str(tmp_path))  # a bucket on disk is listed before any get
    try:
        assert reopened.ends() == {
            MESSAGE_LOG: 0,
            dispatch_stream("202611221530"): 0,
            dispatch_stream("202611221531"): 41,
        }
    finally:
        reopened.close()


def test_a_follower_copies_no_more_of_a_bucket_its_replay_retired(tmp_path: Path) -> None:
    """A retirement's replay closes the follower's copy of the bucket's dispatch_log
    stream before its file goes; records of it still in flight (the leader deletes it
    at its own replay of the record) are not copied into a new file of that name."""
    streams = DelayStreams(str(tmp_path))
    joined = JoinedStreams({"": streams})
    try:
        retired, kept = dispatch_stream("202611221530"), dispatch_stream("202611221531")
        for name in (retired, kept):
            streams.get(name).append(b"x" * 32)
        streams.flush_all()
        assert joined.copies(retired) and joined.copies(kept)
        streams.retire_dispatch(["202611221530"])
        os.unlink(os.path.join(layout.dispatch_log_dir(str(tmp_path)), "202611221530"))
        assert not joined.copies(retired) and joined.copies(kept)
        assert streams.names() == [MESSAGE_LOG, kept]
        assert streams.flush_all() == {}  # the closed copy is no longer among the open
    finally:
        joined.close()


def test_joined_streams_name_the_brokers_under_its_prefix(tmp_path: Path) -> None:
    """A delay member's set with its embedded broker's: one list, each name routed to
    its part by prefix, flushed together; a name of neither is refused."""
    broker = Broker.open(str(tmp_path))
    delay = DelayStreams(str(tmp_path))
    joined = JoinedStreams(
        {"": delay, "broker/": BrokerStreams(BrokerReplica(broker).commitlog, broker.offsets)}
    )
    try:
        broker.offsets.set("g", "orders", 0, 3)
        bucket = dispatch_stream("202611221530")
        joined.get(bucket).append(b"x" * 32)
        assert joined.names() == [
            MESSAGE_LOG,
            bucket,
            "broker/commitlog",
            "broker/offsets/" + "0" * 20,
        ]
        assert joined.get("broker/commitlog").end_offset == broker.store.commitlog.end_offset
        assert joined.find("broker/offsets/" + "0" * 19 + "7") is None
        assert set(joined.flush_all()) == {bucket, "broker/offsets/" + "0" * 20}
        with pytest.raises(ValueError, match="not a stream of a broker data directory"):
            joined.get("broker/schedule_log")
        with pytest.raises(ValueError, match="not a stream of a delay data directory"):
            joined.get("commitlog")
        with pytest.raises(ValueError, match="prefixes end with"):
            JoinedStreams({"broker": delay})
    finally:
        joined.close()
        broker.close()


def test_a_leader_sends_the_servers_dispatch_log_only_as_far_as_it_is_durable(
    tmp_path: Path,
) -> None:
    """Shared with the server's writer: its open file, bounded by what it flushed (a
    follower must never hold an entry the leader could lose); a closed file whole."""
    data_dir = str(tmp_path)
    dispatch = DispatchFiles(layout.dispatch_log_dir(data_dir), max_open=1)
    streams = DelayStreams(data_dir)
    try:
        streams.share_dispatch(lambda: dispatch.files)
        name = dispatch_stream("202611221000")  # T's bucket
        dispatch.record(T, EntryKind.DISPATCHED, [0, 41], T, b"")
        assert streams.names() == [MESSAGE_LOG, name]
        bucket = streams.find(name)
        assert bucket is not None
        assert bucket.end_offset == 0 and bucket.read_raw(0, 1 << 20) == b""  # not flushed
        dispatch.flush()
        written = dispatch.files.get(T).read_raw(0, 1 << 20)
        assert bucket.end_offset == len(written) > 0
        assert bucket.read_raw(0, 1 << 20) == written
        dispatch.record(T + 60_000, EntryKind.CANCELLED, [0], T, b"")  # evicts T's file
        assert not dispatch.files.is_open(T)
        assert bucket.read_raw(0, 1 << 20) == written
        assert streams.find(dispatch_stream("202611221545")) is None  # no such file
    finally:
        streams.close()
        dispatch.close()


@pytest.mark.parametrize("name", ["schedule_log/202611221530", "dispatch_log/2026", "../x"])
def test_only_delay_streams_are_named(name: str) -> None:
    with pytest.raises(ValueError, match="is not a stream of a delay data directory"):
        check_stream_name(name)


async def test_growth_wakes_a_waiter_at_once(tmp_path: Path) -> None:
    streams = DelayStreams(str(tmp_path))
    try:
        seen = streams.version
        async with trio.open_nursery() as nursery:
            woken = trio.Event()

            async def wait() -> None:
                await streams.wait_growth(seen)
                woken.set()

            nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            assert not woken.is_set()
            streams.grew()
            await woken.wait()
        assert await streams.wait_growth(seen) == seen + 1  # already moved: no wait
    finally:
        streams.close()


def messages(count: int) -> list[bytes]:
    """MESSAGE payloads due over several minutes (several buckets), out of due order."""
    payloads = []
    for sequence in range(1, count + 1):
        due_ms = T + (sequence * 7919) % (6 * 60_000)
        record = MessageRecord(
            due_ms=due_ms,
            sequence=sequence,
            receive_ms=T - 1000,
            message_id=f"m{sequence}",
            subject="orders",
            key=None,
            properties={"n": str(sequence)},
            body=b"b" * (sequence % 50),
        )
        payloads.append(message_log.encode_record(record))
    return payloads


def schedule_files(data_dir: str) -> dict[str, bytes]:
    directory = layout.schedule_log_dir(data_dir)
    return {name: Path(directory, name).read_bytes() for name in sorted(os.listdir(directory))}


def test_replay_derives_byte_identical_schedule_logs(tmp_path: Path) -> None:
    """The leader replays as intake feeds it (offered records, big steps); the follower
    gets the same message_log bytes raw and replays them its own way (small steps,
    read back from disk, a restart half way). Their schedule_log files are identical."""
    leader_dir, follower_dir = str(tmp_path / "leader"), str(tmp_path / "follower")
    payloads = messages(300)
    leader_log = SegmentedLog.open(layout.message_log_dir(leader_dir), segment_size=8192)
    replayer = open_replayer(leader_dir, leader_log, segment_scale=1)
    for start in range(0, len(payloads), 50):
        batch = payloads[start : start + 50]
        offsets = leader_log.append_batch(batch, message_log.TYPE_MESSAGE)
        replayer.offer(offsets, batch)
        leader_log.flush()
        while replayer.replay_available():  # a segment roll ends a step early
            pass
    assert replayer.position == leader_log.end_offset
    replayer.checkpoint()
    replayer.close()

    follower_log = SegmentedLog.open(layout.message_log_dir(follower_dir), segment_size=1 << 20)
    while data := leader_log.read_raw(follower_log.end_offset, 3000):
        follower_log.append_raw(follower_log.end_offset, data)
    follower_log.flush()
    leader_log.close()
    replayer = open_replayer(follower_dir, follower_log, segment_scale=1)
    for _ in range(20):
        replayer.replay_available(max_records=7)
    replayer.checkpoint()
    replayer.close()
    follower_log.close()
    follower_log = SegmentedLog.open(layout.message_log_dir(follower_dir))
    replayer = open_replayer(follower_dir, follower_log, segment_scale=1)  # a restart
    while replayer.replay_available(max_records=11):
        pass
    assert replayer.position == follower_log.end_offset
    replayer.checkpoint()
    replayer.close()
    follower_log.close()

    leader_files = schedule_files(leader_dir)
    assert len(leader_files) >= 6  # several buckets
    assert schedule_files(follower_dir) == leader_files
