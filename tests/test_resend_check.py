"""A resend of an id after the cluster's active delay groups changed is answered by the
group that may hold it (delayd/client/_routing.py, ``possible_owners``, ResendCheck;
docs/cluster.md, "A resend of the same id after the active set changed"), sans-I/O:

- the candidate rule against an explicit simulation of random status histories: every
  group that owned an id at some time in the window is a candidate (sound), and every
  candidate is the owner in a history that leaves the same registry (exact);
- the producers (async and blocking) ask the candidates before they send, answer an id
  one of them holds DUPLICATE with its due time and send it nowhere, and fail, sending
  nothing, when a candidate cannot be asked. The groups are fakes here; the real path
  (processes, etcd) is in tests/test_cluster_routing.py.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

import delayd
from delayd.client._blocking_cluster_producer import ClusterProducer
from delayd.client._cluster_producer import AsyncClusterProducer
from delayd.client._routing import (
    CHANGE_MARGIN_MS,
    DelayGroups,
    ResendCheck,
    owner,
    possible_owners,
)
from delayd.client.receipt import Receipt
from delayd.cluster.registry import GroupKind, GroupStatus, Registration
from delayd.errors import DelaydTimeout
from delayd.group_address import parse_group_address
from delayd.protocol import Message, ResultCode
from delayd.timestamps import wall_ms

NOW = 1_000


@dataclass
class History:
    """Each group's status changes: (time, status) in time order, the first its
    registration (active); no status before it."""

    changes: dict[str, list[tuple[float, str]]]

    def status(self, group: str, at: float) -> str | None:
        found = None
        for time, status in self.changes[group]:
            if time <= at:
                found = status
        return found

    def active_at(self, at: float) -> list[str]:
        return [g for g in self.changes if self.status(g, at) == "active"]

    def registry(self) -> dict[str, Registration]:
        """What the registry holds now: each group's status, its registration and its
        last change."""
        return {
            g: Registration(
                g, GroupKind.DELAY, GroupStatus(steps[-1][1]), steps[0][0], steps[-1][0]
            )  # type: ignore[arg-type]
            for g, steps in self.changes.items()
        }


def random_history(rng: random.Random) -> History:
    changes: dict[str, list[tuple[float, str]]] = {}
    for index in range(rng.randint(1, 6)):
        time = rng.randint(0, NOW)
        steps: list[tuple[float, str]] = [(time, "active")]
        status = "active"
        for _ in range(rng.randint(0, 4)):
            time = rng.randint(time, NOW)
            status = rng.choice(
                ["active", "draining"] + (["retired"] if status == "draining" else [])
            )
            steps.append((time, status))
        changes[f"g{index}"] = steps
    return History(changes)


def candidates(message_id: str, registry: dict[str, Registration], since: int) -> list[str]:
    entries = [e for e in registry.values() if e.status is not GroupStatus.RETIRED]
    return possible_owners(message_id, entries, since)


def test_every_owner_of_an_id_in_the_window_is_a_candidate():
    rng = random.Random(21)
    checked = 0
    for _ in range(400):
        history = random_history(rng)
        registry = history.registry()
        since = rng.randint(0, NOW)
        for message_id in (f"id-{rng.random()}" for _ in range(8)):
            found = candidates(message_id, registry, since)
            for at in range(since, NOW + 1, 7):
                active = history.active_at(at)
                if not active:
                    continue
                first = owner(message_id, active)
                if registry[first].status is not GroupStatus.RETIRED:
                    assert first in found, (history, since, at, message_id)
                    checked += 1
    assert checked > 10_000


def test_every_candidate_owned_the_id_in_a_history_with_the_same_registry():
    rng = random.Random(42)
    witnessed = 0
    for _ in range(600):
        registry = random_history(rng).registry()
        since = rng.randint(0, NOW)
        message_id = f"id-{rng.random()}"
        found = candidates(message_id, registry, since)
        for group in found:
            # The proof's witness: a free time s (after every active group above changed
            # last, not a registration time) at which the groups above drain and the
            # candidate is active; each group ends at its registry entry.
            above = [h for h in registry if h != group and owner(message_id, [h, group]) == h]
            entry = registry[group]
            at = max(since, entry.registered_ms) + 0.5
            witness = History({})
            for name, registered in registry.items():
                steps: list[tuple[float, str]] = [(registered.registered_ms, "active")]
                if registered.registered_ms < at < registered.changed_ms:
                    steps.append((at, "active" if name == group else "draining"))
                if name in above:
                    assert registered.status is not GroupStatus.ACTIVE or registered.changed_ms > at
                steps.append((registered.changed_ms, str(registered.status)))
                witness.changes[name] = steps
            assert witness.registry() == registry
            assert owner(message_id, witness.active_at(at)) == group
            witnessed += 1
    assert witnessed > 500


def cluster(**groups: tuple[str, int, int]) -> DelayGroups:
    """The delay groups of a registry: name=(status, registered_ms, changed_ms)."""
    return DelayGroups.from_registry(
        {
            name: Registration(name, GroupKind.DELAY, GroupStatus(status), registered, changed)
            for name, (status, registered, changed) in groups.items()
        }
    )


def test_nothing_is_asked_without_a_change_in_the_window():
    groups = cluster(a=("active", 0, 10), b=("active", 20, 20), old=("draining", 0, 30))
    assert not ResendCheck([f"x{i}" for i in range(100)], groups, since_ms=30).asks
    assert ResendCheck([f"x{i}" for i in range(100)], groups, since_ms=29).asks


def test_after_a_group_is_added_only_the_ids_it_won_ask_their_old_owner():
    ids = [f"order-{i}" for i in range(3000)]
    groups = cluster(a=("active", 0, 0), b=("active", 0, 0), c=("active", 500, 500))
    check = ResendCheck(ids, groups, since_ms=100)
    moved = {i for i, message_id in enumerate(ids) if groups.owner(message_id) == "c"}
    asked = {i: g for g, indexes in check.asks.items() for i in indexes}
    assert set(asked) == moved and "c" not in check.asks
    assert all(asked[i] == owner(ids[i], ["a", "b"]) for i in moved)
    assert 0.25 * len(ids) < len(moved) < 0.42 * len(ids)


def test_groups_registered_in_turn_ask_only_for_the_later_ones_ids():
    """A new cluster: b registered after a (both within the window). An id a wins was
    a's all along; an id b wins may have been a's before b registered."""
    ids = [f"order-{i}" for i in range(500)]
    groups = cluster(a=("active", 200, 200), b=("active", 300, 300))
    check = ResendCheck(ids, groups, since_ms=100)
    assert check.asks == {"a": [i for i, m in enumerate(ids) if groups.owner(m) == "b"]}


def test_after_a_drain_its_ids_ask_it_and_long_drained_groups_are_not_asked():
    ids = [f"order-{i}" for i in range(2000)]
    groups = cluster(
        a=("active", 0, 0), b=("active", 0, 0), d=("draining", 0, 500), old=("draining", 0, 50)
    )
    check = ResendCheck(ids, groups, since_ms=100)
    assert set(check.asks) == {"d"}
    assert check.asks["d"] == [i for i, m in enumerate(ids) if owner(m, ["a", "b", "d"]) == "d"]


def test_a_held_id_is_a_duplicate_with_the_best_ranked_holders_due_time():
    ids = ["x", "y", "z"]
    groups = cluster(a=("active", 0, 500), d1=("draining", 0, 500), d2=("draining", 0, 500))
    check = ResendCheck(ids, groups, since_ms=100)
    assert check.asks == {"d1": [0, 1, 2], "d2": [0, 1, 2]}
    first = groups.previous_owners("x", 100)[0]
    check.answered("d1", [0, 1, 2], [7, None, None])
    check.answered("d2", [0, 1, 2], [9, 11, None])
    receipts = check.receipts()
    assert receipts[0].code is ResultCode.DUPLICATE and receipts[0].ok
    assert receipts[0].due_ms == {"d1": 7, "d2": 9}[first] and first in receipts[0].reason
    assert receipts[1].due_ms == 11 and "d2" in receipts[1].reason
    assert check.parts() == {"a": [2]}


# --- the producers, over fake groups -------------------------------------------------

IDS = [f"order-{i}" for i in range(200)]
ADDRESS = "etcd://127.0.0.1:1/prod/*"


def added_c() -> DelayGroups:
    """a and b for ever, c added just now: c's ids may be held by a or b."""
    return cluster(a=("active", 0, 0), b=("active", 0, 0), c=("active", wall_ms(), wall_ms()))


class FakeGroup:
    """A group that holds some ids (id -> due time) and stores what is sent."""

    def __init__(self, name: str, holds: dict[str, int], *, down: bool = False) -> None:
        self.name, self.holds, self.down = name, holds, down
        self.sent: list[str] = []
        self.asked: list[list[str]] = []

    def answer_held(self, ids: Sequence[str]) -> list[int | None]:
        self.asked.append(list(ids))
        if self.down:
            raise DelaydTimeout(f"etcd://127.0.0.1:1/prod/{self.name} took over 10 s")
        return [self.holds.get(i) for i in ids]

    def store(self, messages: Sequence[Message]) -> list[Receipt]:
        self.sent += [m.message_id for m in messages]
        return [Receipt(m.message_id, due_ms=1) for m in messages]


class AsyncFake(FakeGroup):
    async def held(self, ids: Sequence[str]) -> list[int | None]:
        return self.answer_held(ids)

    async def send_batch(self, messages: Sequence[Message]) -> list[Receipt]:
        return self.store(messages)


class BlockingFake(FakeGroup):
    def held(self, ids: Sequence[str]) -> list[int | None]:
        return self.answer_held(ids)

    def send_batch(self, messages: Sequence[Message]) -> list[Receipt]:
        return self.store(messages)


def fakes(kind: type[FakeGroup], *, down: str = "") -> dict[str, FakeGroup]:
    """The groups after c was added: a and b hold the ids they owned before."""
    before = {i: owner(i, ["a", "b"]) for i in IDS}
    return {
        name: kind(name, {i: 5 for i in IDS if before[i] == name}, down=name == down)
        for name in ("a", "b", "c")
    }


def check_resent(groups: dict[str, FakeGroup], receipts: list[Receipt]) -> None:
    moved = {i for i in IDS if added_c().owner(i) == "c"}
    assert [r.message_id for r in receipts] == IDS
    assert {r.message_id for r in receipts if r.code is ResultCode.DUPLICATE} == moved
    assert all(r.due_ms == 5 for r in receipts if r.message_id in moved)
    assert groups["c"].sent == [] and groups["c"].asked == []
    # One HELD_IDS per asked group per batch, with only the ids that moved.
    assert all(len(groups[g].asked) == 1 for g in ("a", "b"))
    assert sorted(groups["a"].asked[0] + groups["b"].asked[0]) == sorted(moved)
    assert set(groups["a"].sent + groups["b"].sent) == set(IDS) - moved


def async_producer(groups: dict[str, FakeGroup], window_s: float) -> AsyncClusterProducer:
    producer = AsyncClusterProducer(
        parse_group_address(ADDRESS), task_group=None, timeout_s=1, busy_retries=0,  # type: ignore[arg-type]
        resend_window_s=window_s,
    )  # fmt: skip
    producer.view.read(added_c(), now_s=1e12)
    producer.group = groups.__getitem__  # type: ignore[assignment,method-assign]
    return producer


def blocking_producer(groups: dict[str, FakeGroup], window_s: float) -> ClusterProducer:
    producer = ClusterProducer(ADDRESS, timeout_s=1, resend_window_s=window_s)
    producer.view.read(added_c(), now_s=1e12)
    producer.group = groups.__getitem__  # type: ignore[assignment,method-assign]
    return producer


def batch() -> list[tuple[str, bytes] | dict[str, object]]:
    return [{"subject": "orders", "body": b"x", "message_id": i} for i in IDS]


async def test_the_async_producer_answers_what_an_old_owner_holds_and_sends_the_rest():
    groups = fakes(AsyncFake)
    check_resent(groups, await async_producer(groups, 3600).send_batch(batch()))


def test_the_blocking_producer_answers_what_an_old_owner_holds_and_sends_the_rest():
    groups = fakes(BlockingFake)
    check_resent(groups, blocking_producer(groups, 3600).send_batch(batch()))


async def test_an_old_owner_that_cannot_be_asked_fails_the_call_and_nothing_is_sent():
    groups = fakes(AsyncFake, down="b")
    with pytest.raises(DelaydTimeout, match="prod/b took over"):
        await async_producer(groups, 3600).send_batch(batch())
    assert all(not g.sent for g in groups.values())
    blocking = fakes(BlockingFake, down="b")
    with pytest.raises(DelaydTimeout, match="prod/b took over"):
        blocking_producer(blocking, 3600).send_batch(batch())
    assert all(not g.sent for g in blocking.values())


def test_a_window_of_zero_asks_nobody_and_a_negative_one_is_refused():
    groups = fakes(BlockingFake)
    receipts = blocking_producer(groups, 0).send_batch(batch())
    assert all(r.code is ResultCode.OK for r in receipts)
    assert all(not g.asked for g in groups.values()) and len(groups["c"].sent) > 0
    with pytest.raises(ValueError, match="resend_window_s must be 0 or more"):
        delayd.Producer(ADDRESS, resend_window_s=-1)


def test_a_change_older_than_the_window_and_its_margin_asks_nobody():
    groups = fakes(BlockingFake)
    producer = blocking_producer(groups, 60)
    added = wall_ms() - 121_000
    old = cluster(a=("active", 0, 0), b=("active", 0, 0), c=("active", added, added))
    producer.view.read(old, now_s=1e12)
    assert CHANGE_MARGIN_MS == 60_000
    producer.send_batch(batch())
    assert all(not g.asked for g in groups.values())


async def test_held_over_a_cluster_asks_every_group_once_and_takes_the_first_holder():
    moved = next(i for i in IDS if added_c().owner(i) == "c")
    expected = [9 if i == moved else 5 for i in IDS]  # held twice: its owner's answer
    groups = fakes(AsyncFake)
    groups["c"].holds = {moved: 9}
    assert await async_producer(groups, 3600).held(IDS) == expected
    assert all(len(g.asked) == 1 for g in groups.values())
    blocking = fakes(BlockingFake)
    blocking["c"].holds = {moved: 9}
    assert blocking_producer(blocking, 3600).held([*IDS, "never"]) == [*expected, None]
