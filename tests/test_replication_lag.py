"""delayd.replication.lag: records between offsets (END_OF_SEGMENT markers not counted,
over rolled segments), counted once and remembered; the time the leader first had more
than a follower has."""

from __future__ import annotations

from pathlib import Path

import pytest

from delayd.cli.cluster import add_lag, render
from delayd.cli.cluster_lag import lags_in
from delayd.replication.lag import GrowthClock, RecordCounter, count_records
from delayd.top.scrape import Snapshot
from storage.segmented_log import SegmentedLog


@pytest.fixture
def log(tmp_path: Path):
    with SegmentedLog.open(str(tmp_path / "log"), segment_size=1024) as opened:
        yield opened


def append(log: SegmentedLog, count: int) -> list[int]:
    """Offsets of ``count`` new records (each ~100 bytes: segments roll every ~9)."""
    offsets = log.append_batch([b"r" * 90] * count)
    log.flush()
    return offsets


def test_records_are_counted_across_segments_without_their_markers(log: SegmentedLog):
    offsets = append(log, 50)
    assert len(log.read_raw(0, 1 << 20)) < log.end_offset  # several segments
    assert count_records(log, 0, log.end_offset) == (50, log.end_offset)
    assert count_records(log, offsets[10], offsets[37])[0] == 27
    assert count_records(log, offsets[37], offsets[37]) == (0, 0)


def walked_bytes(log: SegmentedLog, monkeypatch) -> list[int]:
    """The bytes each read_raw of ``log`` returns from now on."""
    walked: list[int] = []
    real = log.read_raw

    def read_raw(offset: int, max_bytes: int) -> bytes:
        data = real(offset, max_bytes)
        walked.append(len(data))
        return data

    monkeypatch.setattr(log, "read_raw", read_raw)
    return walked


def test_the_counter_walks_the_cheaper_of_the_gap_and_what_moved(log, monkeypatch):
    offsets = append(log, 40)
    counter = RecordCounter()
    key = ("b", "message_log")
    assert counter.between(key, log, offsets[5], log.end_offset) == 35
    walked = walked_bytes(log, monkeypatch)
    old_end = log.end_offset
    more = append(log, 10)
    # The follower moved by one record, the leader grew by ten: only those are walked.
    assert counter.between(key, log, offsets[6], log.end_offset) == 44
    assert sum(walked) == (offsets[6] - offsets[5]) + (log.end_offset - old_end)
    walked.clear()
    # Caught up but for one record: the gap is cheaper than what moved.
    assert counter.between(key, log, more[-1], log.end_offset) == 1
    assert sum(walked) == log.end_offset - more[-1]
    assert not counter.estimated
    assert counter.between(key, log, offsets[2], offsets[2]) == 0


def test_past_its_budget_the_counter_estimates(log: SegmentedLog):
    append(log, 200)  # records of the same size: the estimate is exact but for rounding
    counter = RecordCounter(budget_bytes=2048)
    estimate = counter.between(("b", "message_log"), log, 0, log.end_offset)
    assert counter.estimated
    assert abs(estimate - 200) <= 4  # END_OF_SEGMENT markers are in the bytes, not counted
    assert RecordCounter().between(("b", "message_log"), log, 0, log.end_offset) == 200


def test_a_start_the_log_no_longer_holds_is_refused(log: SegmentedLog):
    append(log, 40)
    assert log.delete_before(log.end_offset) > 0
    with pytest.raises(ValueError, match="outside the log"):
        RecordCounter().between(("b", "log"), log, 0, log.end_offset)


def test_lag_in_time_is_the_age_of_the_oldest_record_lacked():
    clock = GrowthClock()
    clock.grew("s", 100, now_ms=1_000)  # what the leader held when it took over
    clock.grew("s", 250, now_ms=2_000)
    clock.grew("s", 250, now_ms=2_500)  # no growth: no sample
    clock.grew("s", 400, now_ms=3_000)
    assert clock.lag_ms("s", 400, now_ms=9_000) == 0
    assert clock.lag_ms("s", 250, now_ms=9_000) == 6_000  # lacks what came at 3,000
    assert clock.lag_ms("s", 120, now_ms=9_000) == 7_000
    assert clock.lag_ms("s", 0, now_ms=9_000) == 8_000  # a lower bound: older than the leader
    assert clock.lag_ms("other", 0, now_ms=9_000) == 0
    clock.removed("s")
    assert clock.lag_ms("s", 0, now_ms=9_000) == 0


def test_thinned_samples_still_span_the_whole_history():
    clock = GrowthClock(max_samples=8)
    for i in range(1, 101):
        clock.grew("s", i * 10, now_ms=i * 1_000)
    assert clock.lag_ms("s", 0, now_ms=200_000) >= 190_000  # the oldest kept is early
    assert clock.lag_ms("s", 995, now_ms=200_000) == 100_000  # the newest is exact
    assert clock.lag_ms("s", 1_000, now_ms=200_000) == 0


LEADER_PAGE = """\
# TYPE delayd_replication_follower_lag_bytes gauge
delayd_replication_follower_lag_bytes{member="b-1"} 300.0
delayd_replication_follower_lag_bytes{member="c-1"} 9000.0
# TYPE delayd_replication_follower_lag_records gauge
delayd_replication_follower_lag_records{member="b-1"} 2.0
# TYPE delayd_replication_follower_deleted_lag_bytes gauge
delayd_replication_follower_deleted_lag_bytes{member="e-1"} 8192.0
# TYPE delayd_replication_follower_lag_seconds gauge
delayd_replication_follower_lag_seconds{member="b-1"} 0.25
delayd_replication_follower_lag_seconds{member="c-1"} 40.0
"""


def test_cluster_status_shows_what_the_leader_measured(monkeypatch):
    import delayd.cli.cluster_lag as cluster_lag

    monkeypatch.setattr(cluster_lag, "fetch", lambda url, timeout_s: LEADER_PAGE)
    lags = lags_in(Snapshot.parse(LEADER_PAGE))
    assert lags["b-1"].records == 2 and lags["b-1"].ms == 250 and lags["b-1"].bytes == 300
    assert lags["c-1"].records is None  # not counted (yet)
    assert lags["e-1"].lacks_deleted and lags["e-1"].ms is None
    member = {"in_sync": True, "intake": "", "broker": "", "replication": "", "metrics": ""}
    group = {
        "group": "g1",
        "kind": "delay",
        "status": "active",
        "leader": "a-1",
        "epoch": 7,
        "in_sync": ["a-1", "b-1"],
        "members": [
            {**member, "member_id": "a-1", "role": "leader", "metrics": "127.0.0.1:1"},
            {**member, "member_id": "b-1", "role": "follower"},
            {**member, "member_id": "c-1", "role": "follower", "in_sync": False},
            {**member, "member_id": "d-1", "role": "follower", "in_sync": False},
            {**member, "member_id": "e-1", "role": "follower", "in_sync": False},
        ],
    }
    add_lag(group)
    assert group["lag_error"] is None
    shown = {m["member_id"]: (m["lag_records"], m["lag_ms"]) for m in group["members"]}
    assert shown == {
        "a-1": (None, None),
        "b-1": (2, 250),
        "c-1": (None, 40_000),
        "d-1": (None, None),
        "e-1": (None, None),
    }
    lines = render([group]).splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["member"])
    assert lines[header].split()[:5] == ["member", "role", "in_sync", "lag_records", "lag_ms"]
    rows = {line.split()[0]: line.split()[:5] for line in lines[header + 1 :] if line.strip()}
    assert rows["b-1"] == ["b-1", "follower", "yes", "2", "250"]
    assert rows["c-1"] == ["c-1", "follower", "no", "?", "40000"]
    assert rows["e-1"] == ["e-1", "follower", "no", "deleted", "?"]


def test_cluster_status_says_why_it_has_no_lag():
    group = {
        "group": "g1",
        "kind": "delay",
        "status": "active",
        "leader": "a-1",
        "epoch": 7,
        "in_sync": ["a-1"],
        "members": [
            {
                "member_id": "a-1",
                "role": "leader",
                "in_sync": True,
                "intake": "",
                "broker": "",
                "replication": "",
                "metrics": "",
            }
        ],
    }
    add_lag(group)
    assert "no /metrics" in group["lag_error"]
    assert "lag unknown: the leader serves no /metrics" in render([group])
