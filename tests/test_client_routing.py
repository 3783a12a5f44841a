"""Routing by message id over a cluster's delay groups, sans-I/O (delayd/client/_routing.py):
rendezvous owners are stable, even, and move only as little as a change of the active
set needs; a lookup asks the owner first, every other group that may hold the id on
UNKNOWN, and answers UNKNOWN only when all did."""

from __future__ import annotations

from collections import Counter

import pytest

import delayd
from delayd.client._cluster_view import ClusterView
from delayd.client._routing import DelayGroups, Lookup, owner
from delayd.client.cancel_receipt import CancelReceipt
from delayd.cluster.registry import GroupKind, GroupStatus, Registration
from delayd.errors import DelaydTimeout, UnreachableError
from delayd.group_address import parse_group_address
from delayd.protocol import CancelOutcome
from tests.etcd_support import dead_url

IDS = [f"order-{i}" for i in range(6000)]


def registry(**groups: tuple[GroupKind, GroupStatus]) -> dict[str, Registration]:
    return {name: Registration(name, kind, status, 1, 1) for name, (kind, status) in groups.items()}


ACTIVE = (GroupKind.DELAY, GroupStatus.ACTIVE)
DRAINING = (GroupKind.DELAY, GroupStatus.DRAINING)
RETIRED = (GroupKind.DELAY, GroupStatus.RETIRED)
BROKER = (GroupKind.BROKER, GroupStatus.ACTIVE)


def test_only_active_delay_groups_take_ids_and_draining_ones_are_still_asked():
    groups = DelayGroups.from_registry(
        registry(d1=ACTIVE, d2=DRAINING, d3=RETIRED, b1=BROKER, d0=ACTIVE)
    )
    assert groups.active == ("d0", "d1")
    assert groups.lookup == ("d0", "d1", "d2")
    assert {groups.owner(i) for i in IDS} == {"d0", "d1"}


def test_owners_are_even_and_do_not_depend_on_the_order_of_the_groups():
    counts = Counter(owner(i, ["a", "b"]) for i in IDS)
    assert abs(counts["a"] - counts["b"]) < 0.1 * len(IDS), counts
    assert all(owner(i, ["a", "b"]) == owner(i, ["b", "a"]) for i in IDS[:500])


def test_adding_a_group_moves_only_the_ids_it_wins_and_draining_only_its_own():
    before = {i: owner(i, ["a", "b"]) for i in IDS}
    after = {i: owner(i, ["a", "b", "c"]) for i in IDS}
    moved = [i for i in IDS if before[i] != after[i]]
    assert all(after[i] == "c" for i in moved)
    assert 0.25 * len(IDS) < len(moved) < 0.42 * len(IDS)  # about a third
    drained = {i: owner(i, ["a", "c"]) for i in IDS}
    assert all(drained[i] == after[i] for i in IDS if after[i] != "b")


def test_split_keeps_the_callers_order_per_group():
    groups = DelayGroups(active=("a", "b"), lookup=("a", "b"))
    parts = groups.split(IDS[:50])
    assert sorted(i for indexes in parts.values() for i in indexes) == list(range(50))
    assert all(indexes == sorted(indexes) for indexes in parts.values())
    assert all(groups.owner(IDS[i]) == g for g, indexes in parts.items() for i in indexes)


def test_no_active_group_is_an_error_that_says_what_to_do():
    groups = DelayGroups.from_registry(registry(d1=DRAINING))
    with pytest.raises(UnreachableError, match=r"no active delay group.*activate"):
        groups.owner("x")
    with pytest.raises(UnreachableError, match="no delay group"):
        Lookup(["x"], DelayGroups((), ()))


def test_a_lookup_asks_the_owner_then_the_others_until_one_knows():
    groups = DelayGroups(active=("a", "b"), lookup=("a", "b", "old"))
    holds = {"x": groups.owner("x"), "y": "old"}  # z: held by nobody
    ids = ["x", "y", "z"]
    lookup: Lookup[CancelReceipt] = Lookup(ids, groups)
    asked: dict[str, list[str]] = {i: [] for i in ids}
    while asks := lookup.next_round():
        for group, indexes in asks.items():
            receipts = []
            for index in indexes:
                asked[ids[index]].append(group)
                known = holds.get(ids[index]) == group
                outcome = CancelOutcome.CANCELLED if known else CancelOutcome.UNKNOWN
                receipts.append(CancelReceipt(ids[index], outcome))
            lookup.answered(indexes, receipts)
    assert asked["x"] == [groups.owner("x")]
    assert asked["y"] == groups.ask_order("y") and asked["y"][-1] == "old"
    assert sorted(asked["z"]) == ["a", "b", "old"] and asked["z"][0] == groups.owner("z")
    assert [r.outcome for r in lookup.receipts()] == [
        CancelOutcome.CANCELLED,
        CancelOutcome.CANCELLED,
        CancelOutcome.UNKNOWN,
    ]


def test_a_view_keeps_the_last_registry_when_etcd_cannot_be_read():
    view = ClusterView(parse_group_address("etcd://127.0.0.1:2379/prod/*"))
    assert view.group_address("d1") == "etcd://127.0.0.1:2379/prod/d1"
    with pytest.raises(UnreachableError, match=r"prod/\*.*Is etcd running"):
        view.read_failed(OSError("refused"))
    groups = view.read(DelayGroups(("a",), ("a",)), now_s=10.0)
    assert not view.due(11.0) and view.due(12.5)
    assert view.read_failed(OSError("refused")) is groups
    view.stale()
    assert view.due(11.0)


def dead_cluster() -> str:
    return f"etcd://{dead_url().removeprefix('http://')}/prod/*"


def test_a_producer_over_a_cluster_whose_etcd_is_down_says_so():
    address = dead_cluster()
    producer = delayd.Producer(address, timeout_s=1.5, retry_first_connect=False)
    with pytest.raises(UnreachableError, match=r"cannot read the groups of .*prod/\*"):
        producer.connect()
    with pytest.raises(DelaydTimeout, match=r"prod/\*.*for 1.5 s"):
        delayd.Producer(address, timeout_s=1.5).connect()


async def test_the_async_producer_over_a_cluster_whose_etcd_is_down_says_so():
    with pytest.raises(UnreachableError, match=r"cannot read the groups of .*prod/\*"):
        async with delayd.open_producer(dead_cluster(), retry_first_connect=False):
            pass
    with pytest.raises(DelaydTimeout, match=r"could not read the groups of .*prod/\* within"):
        async with delayd.open_producer(dead_cluster(), timeout_s=1.5):
            pass
