"""Consumer groups as pure logic: RocketMQ's averaging allocation, membership with
heartbeats and connections, time passed in as now_ms."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delayd.broker.groups import GroupRegistry, allocate_averagely


@pytest.mark.parametrize(
    ("queues", "members", "expected"),
    [
        (4, ["a"], {"a": [0, 1, 2, 3]}),
        (4, ["a", "b"], {"a": [0, 1], "b": [2, 3]}),
        (5, ["a", "b"], {"a": [0, 1, 2], "b": [3, 4]}),
        (8, ["a", "b", "c"], {"a": [0, 1, 2], "b": [3, 4, 5], "c": [6, 7]}),
        (2, ["a", "b", "c"], {"a": [0], "b": [1], "c": []}),
        (4, ["d", "c", "b", "a"], {"a": [0], "b": [1], "c": [2], "d": [3]}),
    ],
)
def test_allocate_averagely_matches_rocketmq(queues, members, expected):
    got = {m: allocate_averagely(range(queues), members, m) for m in members}
    assert got == expected


@given(st.integers(1, 40), st.sets(st.text(min_size=1, max_size=4), min_size=1, max_size=12))
def test_allocation_is_a_partition_in_contiguous_runs(queues, members):
    members = list(members)
    parts = [allocate_averagely(list(range(queues)), members, m) for m in sorted(members)]
    flat = [q for part in parts for q in part]
    assert flat == list(range(queues))  # every queue once, in member order
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert allocate_averagely(range(queues), members, "not-a-member") == []


def test_membership_join_timeout_and_connection_close():
    groups = GroupRegistry(timeout_ms=1000)
    assert groups.join("g", "s", "c1", 4, "conn-1", now_ms=0) == ((0, 1, 2, 3), True)
    assert groups.join("g", "s", "c2", 4, "conn-2", now_ms=100) == ((2, 3), True)
    assert groups.join("g", "s", "c2", 4, "conn-2", now_ms=150) == ((2, 3), False)
    assert groups.assignment("g", "s", "c1") == (0, 1)
    assert groups.owner("g", "s", 3) == "c2"
    assert groups.next_expiry_ms() == 1000
    # heartbeats keep c1 alive; c2 stays silent
    assert groups.touch("g", "s", "c1", "conn-1", now_ms=900) == (0, 1)
    assert groups.expire(now_ms=1149) == set()
    assert groups.expire(now_ms=1150) == {("g", "s")}
    assert groups.members("g", "s") == ["c1"]
    assert groups.touch("g", "s", "c2", "conn-2", now_ms=1200) is None
    assert groups.assignment("g", "s", "c1") == (0, 1, 2, 3)
    # a member bound to a closed connection leaves at once
    groups.join("g", "s", "c3", 4, "conn-3", now_ms=1300)
    groups.join("other", "s", "c3", 4, "conn-3", now_ms=1300)
    assert groups.leave_connection("conn-3") == {("g", "s"), ("other", "s")}
    assert groups.assignment("g", "s", "c1") == (0, 1, 2, 3)
    assert groups.assignment("other", "s", "c3") is None
    # a rejoin from a new connection rebinds the member
    groups.join("g", "s", "c1", 4, "conn-9", now_ms=1400)
    assert groups.leave_connection("conn-1") == set()
    assert groups.members("g", "s") == ["c1"]


def test_registry_rejects_a_non_positive_timeout():
    with pytest.raises(ValueError, match="timeout_ms"):
        GroupRegistry(0)
