"""The pure parts of replication: the wire frames, the epoch history, the in-sync rule."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delayd.replication.epochs import EpochHistory, EpochHistoryError
from delayd.replication.in_sync import InSyncTracker
from delayd.replication.wire import (
    Durable,
    Fenced,
    Follow,
    Records,
    Retained,
    Snapshot,
    SnapshotChunk,
    SnapshotEnd,
    TruncateTo,
    WireDecoder,
    WireError,
    encode,
)
from storage.crashfs import CrashSimFileSystem, crash_points, run_to_crash
from storage.framing import encode_record

EVENTS = [
    Follow("g1", "b", 7, {"message_log": 120, "dispatch_log/202611221530": 41}),
    TruncateTo(9, {"message_log": 100}),
    Records(9, "message_log", 100, encode_record(b"x" * 300), {"message_log": 80}),
    Records(9, "dispatch_log/202611221530", 0, b"", {}),
    Durable({"message_log": 400, "dispatch_log/202611221530": 82}),
    Fenced(11),
    Retained({"message_log": 4096}),
    Snapshot(9, {"format": 1, "files": [{"name": "checkpoint/replay", "size": 33}], "meta": {}}),
    SnapshotChunk(9, 0, 4096, b"y" * 100),
    SnapshotChunk(9, 3, 0, b""),
    SnapshotEnd(9),
]


def test_every_event_round_trips_whole_and_byte_by_byte() -> None:
    stream = b"".join(encode(event) for event in EVENTS)
    whole = WireDecoder()
    whole.feed(stream)
    assert [whole.next_event() for _ in EVENTS] == EVENTS
    assert whole.next_event() is None
    trickle, got = WireDecoder(), []
    for byte in stream:
        trickle.feed(bytes([byte]))
        while (event := trickle.next_event()) is not None:
            got.append(event)
    assert got == EVENTS


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (encode_record(b'{"magic": "http", "version": 1}', 2), "not a delayd follower"),
        (
            encode_record(b'{"magic": "delayd-replication", "version": 99}', 2),
            "run the same delayd version",
        ),
        (encode_record(b"not json", 3), "TRUNCATE_TO frame body is not JSON"),
        (encode_record(b'{"epoch": 1, "offsets": {"a": -4}}', 3), "must be >= 0"),
        (encode_record(b"\x01\x00\x00", 5), "DURABLE frame is cut short"),
        (encode_record(b"\x00" * 9, 6), "FENCED frame has 1 trailing bytes"),
        (encode_record(b"", 77), "unknown replication frame type 77"),
        (
            encode_record(b'{"magic": "delayd-replication", "version": 2}', 2),
            "FOLLOW of replication version 2; this member speaks version 3",
        ),
        (encode_record(b'{"epoch": 1, "manifest": []}', 8), "'manifest' must be a dict"),
        (encode_record(b"\x01" * 12, 9), "SNAPSHOT_CHUNK frame is cut short"),
        (encode_record(b"\x01" * 9, 10), "SNAPSHOT_END frame has 1 trailing bytes"),
    ],
)
def test_bad_frames_are_refused_with_a_reason(frame: bytes, message: str) -> None:
    decoder = WireDecoder()
    decoder.feed(frame)
    with pytest.raises(WireError, match=message):
        decoder.next_event()


def test_crc_and_size_are_checked_before_decoding() -> None:
    damaged = bytearray(encode(Fenced(3)))
    damaged[-1] ^= 1
    decoder = WireDecoder()
    decoder.feed(damaged)
    with pytest.raises(WireError, match="fails its CRC"):
        decoder.next_event()
    small = WireDecoder(max_frame_size=64)
    small.feed(encode(Records(1, "message_log", 0, b"x" * 100)))
    with pytest.raises(WireError, match="exceeds the limit of 64"):
        small.next_event()


@given(st.binary(max_size=300), st.integers(1, 50))
def test_random_bytes_decode_or_raise_wire_error(data: bytes, step: int) -> None:
    decoder = WireDecoder(max_frame_size=1 << 16)
    try:
        for at in range(0, len(data), step):
            decoder.feed(data[at : at + step])
            while decoder.next_event() is not None:
                pass
    except WireError:
        pass


# ---------------------------------------------------------------- epoch history


def test_epoch_history_answers_the_end_of_an_epoch(tmp_path: Path) -> None:
    path = str(tmp_path / "epochs")
    history = EpochHistory.open(path)
    assert history.last_epoch() == 0
    history.begin(5, {"message_log": 0})
    history.begin(9, {"message_log": 700, "dispatch_log/202611221530": 41})
    with pytest.raises(EpochHistoryError, match="epochs only grow"):
        history.begin(9, {})
    history.close()
    reopened = EpochHistory.open(path)
    assert reopened.last_epoch() == 9
    assert reopened.end_of(3) == {"message_log": 0}
    assert reopened.end_of(5) == {"message_log": 700, "dispatch_log/202611221530": 41}
    assert reopened.end_of(7) == reopened.end_of(5)  # an epoch this member never saw
    assert reopened.end_of(9) is None  # current: it ends at the streams' ends
    reopened.close()


def test_epoch_history_refuses_an_entry_it_did_not_write(tmp_path: Path) -> None:
    from storage.record_file import RecordFile

    with RecordFile.open(str(tmp_path / "epochs")) as file:
        file.append(b'{"epoch": "x"}')
        file.flush()
    with pytest.raises(EpochHistoryError, match="at byte 0 is not an epoch start"):
        EpochHistory.open(str(tmp_path / "epochs"))


def test_epoch_history_survives_power_loss_at_every_point(tmp_path: Path) -> None:
    """An epoch begun is there after any power loss; one being begun is whole or absent."""

    def workload(begun: list[int]):
        def run(fs: CrashSimFileSystem) -> None:
            fs.mkdir("/d")
            fs.fsync_dir("/")
            history = EpochHistory.open("/d/r/epochs", fs)
            for epoch in (3, 4, 8):
                history.begin(epoch, {"message_log": epoch * 100})
                begun.append(epoch)
            history.close()

        return run

    for k in range(crash_points(workload([])) + 1):
        begun: list[int] = []
        fs = run_to_crash(workload(begun), k, 64)
        root = tmp_path / f"k{k}"
        fs.materialize(str(root), "torn", random.Random(k))
        if not (root / "d" / "r" / "epochs").exists():
            assert not begun, f"crash point {k}: epochs {begun} lost with the file"
            continue
        history = EpochHistory.open(str(root / "d" / "r" / "epochs"))
        epochs = [entry.epoch for entry in history.entries]
        assert epochs[: len(begun)] == begun, f"crash point {k}: {epochs} lacks {begun}"
        assert epochs == [3, 4, 8][: len(epochs)]
        history.close()


# ---------------------------------------------------------------- in-sync rule


def test_a_follower_is_in_sync_while_it_has_what_the_leader_had_lag_ago() -> None:
    tracker = InSyncTracker(1000, 1, {"message_log": 100})
    tracker.follower_reset("b", {"message_log": 0})
    assert tracker.proposed(0) == frozenset()  # lacks what the leader had at start
    tracker.follower_durable("b", {"message_log": 100})
    assert tracker.proposed(0) == {"b"}
    tracker.leader_grew("message_log", 200, 10)
    assert tracker.proposed(500) == {"b"}  # behind, but by less than the lag
    tracker.apply(frozenset({"b"}))
    assert tracker.next_change_ms(500) == 1010
    assert tracker.proposed(1009) == {"b"}
    assert tracker.proposed(1010) == frozenset()  # lacks what the leader had at 10
    tracker.follower_durable("b", {"message_log": 200})
    assert tracker.proposed(1010) == {"b"}
    assert tracker.next_change_ms(1010) is None


@given(st.randoms(use_true_random=False))
def test_when_a_follower_falls_out_is_the_oldest_growth_it_lacks(rng: random.Random) -> None:
    """next_change_ms walks only the tail of each stream a follower lacks; it must
    answer what a walk of all the leader's growth in time order answers: the time of
    the first growth it lacks, plus the lag."""
    streams = ["message_log", "dispatch_log/202611221530", "broker/commitlog"]
    tracker = InSyncTracker(1000, 1, dict.fromkeys(streams, 0))
    tracker.apply(frozenset({"b", "c"}))
    growth: list[tuple[int, str, int]] = []  # every leader_grew, in time order
    ends = dict.fromkeys(streams, 0)
    now = 0
    for _ in range(rng.randrange(1, 60)):
        now += rng.randrange(0, 80)
        stream = rng.choice(streams)
        ends[stream] += rng.randrange(1, 500)
        tracker.leader_grew(stream, ends[stream], now)
        growth.append((now, stream, ends[stream]))
        member = rng.choice(["b", "c"])
        tracker.follower_durable(member, {s: rng.randrange(0, ends[s] + 1) for s in streams})
        now += rng.randrange(0, 80)
        expected = None
        for durable in (tracker.durable.get(m, {}) for m in ("b", "c")):
            lacked = [t for t, s, end in growth if t > now - 1000 and durable.get(s, 0) < end]
            if lacked:
                due = lacked[0] + 1000
                expected = due if expected is None else min(expected, due)
        assert tracker.next_change_ms(now) == expected


def test_a_new_stream_counts_once_the_lag_has_passed() -> None:
    tracker = InSyncTracker(1000, 1, {"message_log": 0})
    tracker.follower_reset("b", {"message_log": 0})
    tracker.leader_grew("dispatch_log/202611221530", 41, 0)
    assert tracker.proposed(999) == {"b"}
    assert tracker.proposed(1000) == frozenset()


def test_a_stream_the_leader_deleted_holds_nobody_back() -> None:
    """A compacted offsets generation: a follower that joined after it was superseded
    never gets it, and is in sync all the same once the leader says it is gone."""
    old, new = "offsets/00000000000000000001", "offsets/00000000000000000002"
    tracker = InSyncTracker(1000, 1, {"commitlog": 10, old: 300})
    tracker.leader_grew(new, 80, 0)
    tracker.follower_reset("b", {"commitlog": 10, new: 80})
    assert tracker.proposed(1000) == frozenset()
    tracker.leader_removed(old)
    assert tracker.proposed(1000) == {"b"}


def test_acks_need_every_in_sync_follower_and_min_in_sync() -> None:
    tracker = InSyncTracker(1000, 1, {"message_log": 0})
    tracker.follower_reset("b", {"message_log": 0})
    tracker.follower_reset("c", {"message_log": 0})
    assert tracker.acknowledged("message_log", 500) == 0  # no follower counts yet
    tracker.apply(frozenset({"b", "c"}))
    tracker.follower_durable("b", {"message_log": 500})
    tracker.follower_durable("c", {"message_log": 300})
    assert tracker.acknowledged("message_log", 400) == 300  # the slowest follower
    tracker.follower_durable("c", {"message_log": 200})  # a late report never lowers
    tracker.follower_durable("c", {"message_log": 600})
    assert tracker.acknowledged("message_log", 400) == 400  # the leader's durable end
    tracker.apply(frozenset())
    assert tracker.acknowledged("message_log", 900) == 400  # held, never moved back


def test_zero_min_in_sync_acks_on_the_leader_alone() -> None:
    tracker = InSyncTracker(1000, 0, {})
    assert tracker.acknowledged("message_log", 70) == 70
    with pytest.raises(ValueError, match="replica_lag_ms must be positive"):
        InSyncTracker(0, 1, {})


def test_a_persisted_member_keeps_its_place_until_the_lag_has_passed() -> None:
    """A new leader starts with the set the group persisted; a member of it that has
    not connected yet counts (acks wait for it) for lag_ms, then leaves."""
    tracker = InSyncTracker(1000, 1, {"message_log": 50})
    tracker.start(frozenset({"b"}), 100)
    assert tracker.acknowledged("message_log", 50) == 0  # waits for b
    assert tracker.proposed(1099) == {"b"}
    assert tracker.next_change_ms(1099) == 1100
    assert tracker.proposed(1100) == frozenset()
    tracker.follower_reset("b", {"message_log": 50})
    assert tracker.proposed(1100) == {"b"}
