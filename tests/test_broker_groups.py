"""Consumer groups as pure logic: RocketMQ's averaging allocation, membership with
heartbeats and connections, the two-step hand-over of a queue, time passed in as now_ms."""

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
    assert groups.owner("g", "s", 3) == "c1"  # until c1 lets go of it
    assert groups.confirm("g", "s", "c1", held=(0, 1), now_ms=120)
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
    assert groups.leave_connection("conn-3", now_ms=1350) == {("g", "s"), ("other", "s")}
    assert groups.assignment("g", "s", "c1") == (0, 1, 2, 3)
    assert groups.assignment("other", "s", "c3") is None
    # a rejoin from a new connection rebinds the member
    groups.join("g", "s", "c1", 4, "conn-9", now_ms=1400)
    assert groups.leave_connection("conn-1", now_ms=1450) == set()
    assert groups.members("g", "s") == ["c1"]


def test_registry_rejects_a_non_positive_timeout():
    with pytest.raises(ValueError, match="timeout_ms"):
        GroupRegistry(0)


def _serving(groups: GroupRegistry, *members: str) -> dict[str, tuple[int, ...]]:
    return {m: groups.serving("g", "s", m) for m in members}


def test_a_joining_member_gets_a_queue_only_once_its_old_owner_let_go():
    groups = GroupRegistry(timeout_ms=1000)
    groups.join("g", "s", "a", 4, "conn-a", now_ms=0)
    assert groups.join("g", "s", "b", 4, "conn-b", now_ms=10) == ((2, 3), True)
    # b's target is (2, 3) but a still holds them: nobody reads them meanwhile
    assert _serving(groups, "a", "b") == {"a": (0, 1), "b": ()}
    assert groups.in_handover("g", "s") == {2: 10, 3: 10}
    # a PULL is no confirmation, and a heartbeat that still holds a queue keeps it
    assert groups.touch("g", "s", "a", "conn-a", now_ms=20) == (0, 1)
    assert not groups.confirm("g", "s", "a", held=(0, 1, 2, 3), now_ms=30)
    assert groups.confirm("g", "s", "a", held=(0, 1, 3), now_ms=40)
    assert _serving(groups, "a", "b") == {"a": (0, 1), "b": (2,)}
    assert groups.confirm("g", "s", "a", held=(0, 1), now_ms=250)
    assert _serving(groups, "a", "b") == {"a": (0, 1), "b": (2, 3)}
    assert groups.in_handover("g", "s") == {}
    assert (groups.handovers, groups.handover_wait_ms_total) == (2, 30 + 240)


def test_a_member_that_leaves_or_crashes_lets_go_at_once():
    groups = GroupRegistry(timeout_ms=1000)
    groups.join("g", "s", "a", 4, "conn-a", now_ms=0)
    groups.join("g", "s", "b", 4, "conn-b", now_ms=0)
    groups.confirm("g", "s", "a", held=(0, 1), now_ms=0)
    assert groups.leave_connection("conn-b", now_ms=50) == {("g", "s")}
    assert _serving(groups, "a") == {"a": (0, 1, 2, 3)}
    # a crash: b's queues come back to a after b's silence, not before
    groups.join("g", "s", "b", 4, "conn-b2", now_ms=100)
    groups.confirm("g", "s", "a", held=(0, 1), now_ms=100)
    groups.touch("g", "s", "a", "conn-a", now_ms=1050)
    assert groups.expire(now_ms=1099) == set()
    assert _serving(groups, "a", "b") == {"a": (0, 1), "b": (2, 3)}
    assert groups.expire(now_ms=1100) == {("g", "s")}
    assert _serving(groups, "a") == {"a": (0, 1, 2, 3)}


def test_an_old_owner_that_never_confirms_is_overruled_after_the_timeout():
    groups = GroupRegistry(timeout_ms=1000)
    groups.join("g", "s", "a", 2, "conn-a", now_ms=0)
    groups.join("g", "s", "b", 2, "conn-b", now_ms=500)
    assert groups.next_expiry_ms() == 1000  # a's silence first
    groups.touch("g", "s", "a", "conn-a", now_ms=900)
    groups.touch("g", "s", "b", "conn-b", now_ms=900)
    assert groups.next_expiry_ms() == 1500  # then the hand-over that began at 500
    assert groups.expire(now_ms=1499) == set()
    assert _serving(groups, "a", "b") == {"a": (0,), "b": ()}
    assert groups.expire(now_ms=1500) == {("g", "s")}
    assert _serving(groups, "a", "b") == {"a": (0,), "b": (1,)}
    assert groups.members("g", "s") == ["a", "b"]  # alive: only the queue moved
    assert (groups.handovers, groups.handover_wait_ms_total) == (1, 1000)


def test_a_chain_of_joins_hands_each_queue_over_from_whoever_holds_it():
    groups = GroupRegistry(timeout_ms=1000)
    groups.join("g", "s", "a", 6, "conn-a", now_ms=0)
    groups.join("g", "s", "b", 6, "conn-b", now_ms=1)  # a: 0-2, b: 3-5 (held by a)
    groups.join("g", "s", "c", 6, "conn-c", now_ms=2)  # a: 0-1, b: 2-3, c: 4-5
    assert _serving(groups, "a", "b", "c") == {"a": (0, 1), "b": (), "c": ()}
    groups.confirm("g", "s", "a", held=(0, 1), now_ms=3)
    assert _serving(groups, "a", "b", "c") == {"a": (0, 1), "b": (2, 3), "c": (4, 5)}
    # d joins and leaves again before b let go: b keeps its queues, nothing is lost
    groups.join("g", "s", "d", 6, "conn-d", now_ms=4)  # a: 0-1, b: 2-3, c: 4, d: 5
    assert _serving(groups, "c", "d") == {"c": (4,), "d": ()}
    groups.leave_connection("conn-d", now_ms=5)
    assert _serving(groups, "a", "b", "c") == {"a": (0, 1), "b": (2, 3), "c": (4, 5)}
    assert groups.in_handover("g", "s") == {}


def test_a_member_that_cannot_confirm_lets_go_at_once():
    # An HTTP consumer keeps no prefetch and has no way to say what it holds.
    groups = GroupRegistry(timeout_ms=1000)
    groups.join("g", "s", "web", 4, "conn-w", now_ms=0, confirms=False)
    groups.join("g", "s", "bin", 4, "conn-b", now_ms=10)
    assert _serving(groups, "bin", "web") == {"bin": (0, 1), "web": (2, 3)}
    assert groups.in_handover("g", "s") == {}


def promoted_with(groups: GroupRegistry, now_ms: int) -> None:
    """The broker begins to lead with committed offsets of consumer group g on s."""
    groups.promoted({("g", "s")}, now_ms)


def test_after_a_promotion_a_rejoining_holder_gets_the_queues_it_declares_back():
    groups = GroupRegistry(timeout_ms=1000)
    groups.join("g", "s", "a", 4, "old-a", now_ms=0)
    promoted_with(groups, now_ms=5000)
    assert groups.members("g", "s") == []  # the members of the old leadership join again
    # b comes back first: it had 2 and 3 in hand and gets them back; a's 0 and 1 are
    # held for a, though b is their target now.
    assert groups.join("g", "s", "b", 4, "conn-b", now_ms=5100, held=(2, 3)) == (
        (0, 1, 2, 3),
        True,
    )
    assert _serving(groups, "b") == {"b": (2, 3)}
    assert groups.unclaimed("g", "s") == {0, 1}
    groups.join("g", "s", "a", 4, "conn-a", now_ms=5300, held=(0, 1))
    assert _serving(groups, "a", "b") == {"a": (0, 1), "b": (2, 3)}
    assert groups.unclaimed("g", "s") == set()
    assert (groups.claim_holds, groups.claim_hold_ms_total) == (4, 2 * 100 + 2 * 300)
    assert groups.unclaimed_given == 0
    assert groups.next_expiry_ms() == 5100 + 1000  # b's silence; no claim is awaited


def test_a_queue_no_one_declares_is_held_until_the_heartbeat_timeout():
    groups = GroupRegistry(timeout_ms=1000)
    promoted_with(groups, now_ms=0)
    groups.join("g", "s", "a", 4, "conn-a", now_ms=10, held=(0,))
    groups.join("g", "s", "b", 4, "conn-b", now_ms=20)  # a new member: it holds nothing
    assert _serving(groups, "a", "b") == {"a": (0,), "b": ()}
    assert groups.next_expiry_ms() == 1000  # the claims end
    groups.touch("g", "s", "a", "conn-a", now_ms=990)
    groups.touch("g", "s", "b", "conn-b", now_ms=990)
    assert groups.expire(now_ms=999) == set()
    assert groups.expire(now_ms=1000) == {("g", "s")}
    assert _serving(groups, "a", "b") == {"a": (0, 1), "b": (2, 3)}
    assert groups.unclaimed_given == 3
    assert (groups.claim_holds, groups.claim_hold_ms_total) == (4, 10 + 3 * 1000)
    # Claims end with the period: who holds what is this broker's to know again; c's
    # JOIN takes nothing from a, and 2 and 3 move to c once a let go of them.
    groups.leave_connection("conn-b", now_ms=1100)
    groups.join("g", "s", "c", 4, "conn-c", now_ms=1200, held=(0, 1))
    assert _serving(groups, "a", "c") == {"a": (0, 1), "c": ()}
    assert groups.in_handover("g", "s") == {2: 1200, 3: 1200}


def test_a_group_without_committed_offsets_is_not_held_after_a_promotion():
    groups = GroupRegistry(timeout_ms=1000)
    promoted_with(groups, now_ms=0)
    groups.join("new", "s", "a", 4, "conn-a", now_ms=10)
    assert groups.serving("new", "s", "a") == (0, 1, 2, 3)
    groups.promoted(set(), now_ms=20)
    assert groups.next_expiry_ms() is None


def test_a_queue_two_members_declare_is_served_once_all_but_one_let_go():
    # a held queue 1; b's claim is stale (the old leader was handing it over to b, or
    # had taken it from b): neither is served it until the one not its target lets go.
    groups = GroupRegistry(timeout_ms=1000)
    promoted_with(groups, now_ms=0)
    groups.join("g", "s", "a", 2, "conn-a", now_ms=10, held=(0, 1))
    assert _serving(groups, "a") == {"a": (0, 1)}
    groups.join("g", "s", "b", 2, "conn-b", now_ms=20, held=(1,))
    assert _serving(groups, "a", "b") == {"a": (0,), "b": ()}
    assert groups.in_handover("g", "s") == {1: 20}
    assert not groups.confirm("g", "s", "a", held=(0, 1), now_ms=30)  # b's target: kept
    assert groups.confirm("g", "s", "a", held=(0,), now_ms=40)
    assert _serving(groups, "a", "b") == {"a": (0,), "b": (1,)}  # b holds it alone
    assert groups.in_handover("g", "s") == {}
    # The other way round: the target lets go of nothing; the stale claimant is
    # overruled after timeout_ms when it never lets go.
    groups = GroupRegistry(timeout_ms=1000)
    promoted_with(groups, now_ms=0)
    groups.join("g", "s", "a", 2, "conn-a", now_ms=10, held=(1,))
    groups.join("g", "s", "b", 2, "conn-b", now_ms=20, held=(1,))
    assert _serving(groups, "a", "b") == {"a": (), "b": ()}
    for now_ms in (500, 1000):
        groups.touch("g", "s", "a", "conn-a", now_ms)
        groups.touch("g", "s", "b", "conn-b", now_ms)
    assert groups.expire(now_ms=1019) == {("g", "s")}  # the claims ended: queue 0 is a's
    assert _serving(groups, "a", "b") == {"a": (0,), "b": ()}
    groups.expire(now_ms=1020)
    assert _serving(groups, "a", "b") == {"a": (0,), "b": (1,)}


def test_a_claimant_that_leaves_lets_go_at_once():
    groups = GroupRegistry(timeout_ms=1000)
    promoted_with(groups, now_ms=0)
    groups.join("g", "s", "a", 2, "conn-a", now_ms=10, held=(0, 1))
    groups.join("g", "s", "b", 2, "conn-b", now_ms=20, held=(1,))
    groups.leave_connection("conn-a", now_ms=30)
    assert _serving(groups, "b") == {"b": (0, 1)}


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["join", "claim", "leave", "confirm", "expire", "promote"]),
            st.sampled_from("abcd"),
        ),
        max_size=30,
    )
)
def test_no_queue_is_ever_read_by_two_members(steps):
    groups = GroupRegistry(timeout_ms=100)
    now_ms = 0
    for action, member in steps:
        now_ms += 30
        if action == "join":
            groups.join("g", "s", member, 5, f"conn-{member}", now_ms)
        elif action == "claim":
            held = groups.assignment("g", "s", member) or (1, 2, 3)
            groups.join("g", "s", member, 5, f"conn-{member}", now_ms, held=held)
        elif action == "promote":
            promoted_with(groups, now_ms)
        elif action == "leave":
            groups.leave_connection(f"conn-{member}", now_ms)
        elif action == "confirm":
            mine = groups.assignment("g", "s", member)
            if mine is not None:
                groups.touch("g", "s", member, f"conn-{member}", now_ms)
                groups.confirm("g", "s", member, mine, now_ms)
        else:
            groups.expire(now_ms)
        served = [q for m in "abcd" for q in groups.serving("g", "s", m)]
        assert len(served) == len(set(served))
        for m in "abcd":
            assert set(groups.serving("g", "s", m)) <= set(groups.assignment("g", "s", m) or ())
        for queue in range(5):
            holder = groups.owner("g", "s", queue)
            assert holder is None or holder in groups.members("g", "s")
