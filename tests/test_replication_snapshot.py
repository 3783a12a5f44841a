"""A member that lacks records retention deleted resyncs from a snapshot of the leader's
derived state (docs/replication.md, "Resync from a snapshot"): a leader pipeline (real
message_log, replayer, schedule_log, id index) whose retention deleted message_log
segments, a new member following it over real TCP on 127.0.0.1, and the crash
simulator for a member that loses power while it receives or installs a snapshot."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import trio
import trio.testing

from delayd.logs import layout
from delayd.replay import open_replayer
from delayd.replication import MESSAGE_LOG, DelayStreams, EpochHistory, Follower, Leader
from delayd.replication.metrics import ReplicationCollector
from delayd.replication.snapshot import SnapshotError, SnapshotReceiver, read_manifest
from delayd.server.receiver import IntakeLimits
from delayd.server.snapshot import DelaySnapshots, SnapshotReceived, install_received_snapshot
from storage.crashfs import CrashSimFileSystem, SimulatedCrash
from storage.fs import O_WRITE, REAL_FS, FileSystem
from storage.segmented_log import SegmentedLog
from tests.delivery_pipeline import T0, Pipeline, RecordingTarget
from tests.test_replay_determinism import files_of, lookups

GROUP = "g1"
SEGMENT_BYTES = 4096  # a few dozen messages a segment: retention has segments to delete
SMALL_SEGMENTS = {
    "message_log_segment_bytes": SEGMENT_BYTES,
    "limits": IntakeLimits(max_record_bytes=1024),
}
MINUTE = 60_000


@pytest.fixture
def clock():
    """Real time while members talk over TCP (a snapshot taken in a worker thread
    must not let the clock jump to a timeout); a test switches to autojump for
    delivery (``autojump``)."""
    return trio.testing.MockClock(rate=1.0)


def autojump(clock: trio.testing.MockClock) -> None:
    """No sockets from here on: minutes of delivery at once."""
    clock.rate = 0.0
    clock.autojump_threshold = 0.0


class Retained:
    """A leader's data directory (the Pipeline's) whose retention deleted message_log
    segments below its replay checkpoint P, with records past P replayed into
    schedule_log (not yet checkpointed) and records past those not replayed yet."""

    def __init__(self, data: str) -> None:
        self.data = data
        self.pipeline = Pipeline(data, [RecordingTarget("old")], **SMALL_SEGMENTS)
        self.dues: dict[str, int] = {}
        self.schedule([T0 + MINUTE + i * 700 for i in range(150)])
        self.replay()
        replayer = self.pipeline.replayer
        replayer.checkpoint()
        self.position = replayer.checkpointed_position
        assert self.pipeline.log.delete_before(self.position) >= 2
        self.start = self.pipeline.log.min_offset
        self.schedule([T0 + 2 * MINUTE + i * 300 for i in range(30)])  # replayed, past P
        self.replay()
        self.schedule([T0 + 90_000 + i * 50 for i in range(20)])  # not replayed yet
        assert replayer.checkpointed_position == self.position

    def schedule(self, dues: list[int]) -> None:
        ids = self.pipeline.schedule(dues)
        self.dues.update(zip(ids, dues, strict=True))

    def replay(self) -> None:
        while self.pipeline.replayer.replay_available(None):
            pass

    def leader(self, epoch: int = 5) -> Leader:
        streams = DelayStreams(self.data, message_log=self.pipeline.log)
        history = EpochHistory.open_in(self.data)
        return Leader(
            streams,
            history,
            epoch,
            group=GROUP,
            snapshots=DelaySnapshots(self.data),
            chunk_bytes=1500,  # files go in several chunks
        )


class NewMember:
    """A member's data directory with its streams and epoch history open."""

    def __init__(self, data: str, fs: FileSystem = REAL_FS) -> None:
        self.data = data
        self.fs = fs
        self.streams = DelayStreams(data, fs=fs, segment_size=SEGMENT_BYTES)
        self.history = EpochHistory.open_in(data, fs)

    def follower(self, leader: Leader) -> Follower:
        async def on_snapshot(manifest: dict) -> None:
            raise SnapshotReceived(self.data, manifest)  # as the server does: it restarts

        return Follower(
            self.streams,
            self.history,
            group=GROUP,
            member="b",
            leader=leader.addresses[0],
            min_backoff_ms=10,
            max_backoff_ms=50,
            snapshots=SnapshotReceiver(layout.received_snapshot_dir(self.data), self.fs),
            on_snapshot=on_snapshot,
        )

    def close(self) -> None:
        self.streams.close()
        self.history.close()


async def receive_snapshot(member: NewMember, leader: Leader) -> SnapshotReceived:
    with trio.fail_after(30), pytest.RaisesGroup(SnapshotReceived, flatten_subgroups=True) as got:
        await member.follower(leader).run()
    member.close()
    return got.value.exceptions[0]


async def follow_until_caught_up(member: NewMember, leader: Leader, source: Retained) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(member.follower(leader).run)
        with trio.fail_after(30):
            while member.streams.message_log.durable_offset != source.pipeline.log.end_offset:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    member.close()


def replay_all(data: str) -> None:
    log = SegmentedLog.open(layout.message_log_dir(data), segment_size=SEGMENT_BYTES)
    replayer = open_replayer(data, log, segment_scale=1)
    while replayer.replay_available(None):
        pass
    replayer.checkpoint()
    replayer.close()
    log.close()


def segments(data: str) -> dict[str, bytes]:
    files = files_of(layout.message_log_dir(data))
    return {name: data for name, data in files.items() if name.isdigit()}


def metric(leader: Leader, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in ReplicationCollector(lambda: leader).collect()
        for sample in family.samples
        if sample.name == name
    }


async def test_a_new_member_resyncs_from_a_snapshot_and_delivers_every_message(
    tmp_path: Path, clock
) -> None:
    """b (an empty directory) follows a whose retention deleted message_log segments:
    a sends a snapshot as of its replay checkpoint, b installs it, copies message_log
    from there, and derives the same schedule_log and id index byte for byte. Opened
    as a server (a promoted member) b delivers every message once, none early."""
    a = Retained(str(tmp_path / "a"))
    b_dir = str(tmp_path / "b")
    leader = a.leader()
    async with trio.open_nursery() as nursery:
        await nursery.start(leader.run, "127.0.0.1", 0)
        received = await receive_snapshot(NewMember(b_dir), leader)
        meta = received.manifest["meta"]
        assert meta == {"position": a.position, "message_log_start": a.start}
        assert leader.lacking == {"b": {MESSAGE_LOG: 0}}  # cluster status: deleted
        assert os.listdir(layout.outgoing_snapshots_dir(a.data)) == []  # links released
        assert install_received_snapshot(b_dir) == received.manifest
        assert not os.listdir(layout.received_snapshot_dir(b_dir))  # installed: gone
        a.schedule([T0 + 3 * MINUTE + i for i in range(10)])  # more after the snapshot
        a.pipeline.log.flush()
        await follow_until_caught_up(NewMember(b_dir), leader, a)
        assert leader.snapshots_sent == 1
        assert "b" not in leader.lacking  # it follows: `deleted` no longer shown
        assert metric(leader, "delayd_replication_snapshots_total") == {(("outcome", "sent"),): 1}
        nursery.cancel_scope.cancel()
    leader.streams.close()
    leader.history.close()
    a.replay()
    a.pipeline.replayer.checkpoint()
    a.pipeline.close()
    replay_all(b_dir)

    b_segments = segments(b_dir)
    assert min(map(int, b_segments)) == a.start  # b's message_log begins where a's does
    assert b_segments == segments(a.data)
    b_buckets = files_of(layout.schedule_log_dir(b_dir))
    assert b_buckets == files_of(layout.schedule_log_dir(a.data))
    assert lookups(b_dir, list(a.dues)) == lookups(a.data, list(a.dues))

    target = RecordingTarget("b")
    autojump(clock)
    with Pipeline(b_dir, [target], **SMALL_SEGMENTS) as promoted:
        last = max(a.dues.values())
        await promoted.run_until(last + 1000, done=lambda: len(target.received) >= len(a.dues))
    got = [r.message.message_id for r in target.received]
    assert sorted(got) == sorted(a.dues)  # every message, once
    assert all(r.at_ms >= a.dues[r.message.message_id] for r in target.received)  # none early


def copy_into(fs: CrashSimFileSystem, source: str, root: str) -> None:
    """Write the real tree ``source`` under ``root`` of ``fs``, every file and entry
    durable."""
    fs.mkdir(root)
    for directory, subdirs, names in os.walk(source):
        here = os.path.join(root, os.path.relpath(directory, source)).rstrip("/.")
        for sub in subdirs:
            fs.mkdir(os.path.join(here, sub))
        for name in names:
            fd = fs.open(os.path.join(here, name), O_WRITE)
            with open(os.path.join(directory, name), "rb") as file:
                fs.pwrite(fd, file.read(), 0)
            fs.fsync(fd)
            fs.close(fd)
        fs.fsync_dir(here)
    fs.fsync_dir(os.path.dirname(root) or "/")


def derived_state(data: str) -> dict[str, dict[str, bytes]]:
    return {
        "message_log": segments(data),
        "schedule_log": files_of(layout.schedule_log_dir(data)),
        "checkpoint": files_of(layout.checkpoint_dir(data)),
    }


async def test_a_crash_while_a_snapshot_arrives_or_installs_never_leaves_half_of_one(
    tmp_path: Path, clock
) -> None:
    """Power lost part way through receiving a snapshot: the start that follows
    discards it and the member, as it was, is sent one again. Power lost at any step
    of the install: the next start installs it again, to the same files as an install
    that ran through, and the member starts from it."""
    a = Retained(str(tmp_path / "a"))
    leader = a.leader()
    whole = str(tmp_path / "whole")
    async with trio.open_nursery() as nursery:
        await nursery.start(leader.run, "127.0.0.1", 0)
        # Receiving on the crash simulator, the power goes after a few chunks.
        fs = CrashSimFileSystem()
        fs.mkdir("/data")
        fs.fsync_dir("/")
        member = NewMember("/data", fs)
        follower = member.follower(leader)
        receiver = follower.snapshots
        assert receiver is not None
        begin, write = receiver.begin, receiver.write
        chunks: list[int] = []

        def begin_then_lose_power_soon(manifest: dict) -> None:
            begin(manifest)
            fs.crash_after(fs.ops + 6)  # a few chunks in, however long the way here was

        def counted_write(index: int, offset: int, data: bytes) -> None:
            write(index, offset, data)
            chunks.append(index)

        receiver.begin = begin_then_lose_power_soon  # type: ignore[method-assign]
        receiver.write = counted_write  # type: ignore[method-assign]
        with trio.fail_after(30), pytest.RaisesGroup(SimulatedCrash, flatten_subgroups=True):
            await follower.run()
        assert chunks  # the power went mid-receipt, after chunks were written
        crashed = str(tmp_path / "crashed")
        fs.materialize(crashed, "torn", random.Random(1))
        received = os.path.join(crashed, "data", "delay", "snapshot")
        assert "MANIFEST" not in os.listdir(received)  # never committed
        assert install_received_snapshot(os.path.join(crashed, "data")) is None
        assert not os.listdir(received)  # discarded: nothing of it installed
        assert not os.path.exists(layout.replay_checkpoint_path(os.path.join(crashed, "data")))
        # The member as the crash left it follows again and is sent a whole one,
        # installed on the simulator below.
        shutil.copytree(os.path.join(crashed, "data"), whole)
        await receive_snapshot(NewMember(whole), leader)
        nursery.cancel_scope.cancel()
    leader.streams.close()
    leader.history.close()
    a.pipeline.close()

    clean = str(tmp_path / "clean")
    shutil.copytree(whole, clean)
    install_received_snapshot(clean)
    expected = derived_state(clean)
    ids = list(a.dues)
    expected_lookups = lookups(clean, ids)

    def install(fs: CrashSimFileSystem) -> None:
        copy_into(fs, whole, "/data")
        install_received_snapshot("/data", fs)

    setup = CrashSimFileSystem()
    copy_into(setup, whole, "/data")
    first = setup.ops
    total = CrashSimFileSystem()
    install(total)
    points = range(first, total.ops, max(1, (total.ops - first) // 8))
    for k in points:
        fs = CrashSimFileSystem()
        fs.crash_after(k)
        with pytest.raises(SimulatedCrash):
            install(fs)
        after = str(tmp_path / f"after-{k}")
        fs.materialize(after, "torn", random.Random(k))
        data = os.path.join(after, "data")
        install_received_snapshot(data)  # the next start
        assert derived_state(data) == expected, f"crash point {k}"
        assert lookups(data, ids) == expected_lookups, f"crash point {k}"


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        ({"format": 1, "files": [{"name": "../../etc/passwd", "size": 3}]}, "leaves the data"),
        ({"format": 1, "files": [{"name": "/abs", "size": 3}]}, "leaves the data"),
        ({"format": 1, "files": [{"name": "x", "size": -1}]}, "want a name and a size"),
        ({"format": 2, "files": []}, "run the same delayd version"),
    ],
)
def test_a_manifest_that_would_leave_the_directory_is_refused(
    tmp_path: Path, manifest: dict, message: str
) -> None:
    with pytest.raises(SnapshotError, match=message):
        SnapshotReceiver(str(tmp_path / "in")).begin(manifest)


def test_chunks_out_of_place_and_files_cut_short_are_refused(tmp_path: Path) -> None:
    receiver = SnapshotReceiver(str(tmp_path / "in"))
    receiver.begin({"format": 1, "files": [{"name": "a", "size": 4}], "meta": {}})
    with pytest.raises(SnapshotError, match="0 of its 4 bytes arrived so far"):
        receiver.write(0, 2, b"xx")
    with pytest.raises(SnapshotError, match="file 1; the manifest has 1"):
        receiver.write(1, 0, b"x")
    receiver.write(0, 0, b"xyz")
    with pytest.raises(SnapshotError, match="ended with 3 of the 4 bytes of a"):
        receiver.finish()
    receiver.close()
    assert read_manifest(str(tmp_path / "in")) is None  # nothing whole to install


def test_a_received_snapshot_that_cannot_be_installed_says_what_to_do(tmp_path: Path) -> None:
    receiver = SnapshotReceiver(layout.received_snapshot_dir(str(tmp_path)))
    receiver.begin({"format": 1, "files": [{"name": "schedule_log/x", "size": 0}], "meta": {}})
    receiver.finish()
    with pytest.raises(SnapshotError, match=r"holds no replay checkpoint\): remove the directory"):
        install_received_snapshot(str(tmp_path))
