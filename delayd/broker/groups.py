"""Consumer groups: membership with heartbeats, and the queue assignment.

A member is a ``consumer_id`` in a (group, subject). It joins with JOIN_GROUP and stays
while it sends HEARTBEAT or PULL at least every ``timeout_ms``, and while the connection
it last spoke on is open. Each member gets the queues :func:`allocate_averagely` gives
it; every member computes nothing itself — the broker tells it in each JOIN/HEARTBEAT
answer. Pure logic: ``now_ms`` is an argument, nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

GroupKey = tuple[str, str]  # (group, subject)


def allocate_averagely(queues: Sequence[int], members: Sequence[str], member: str) -> list[int]:
    """The queues ``member`` consumes, as RocketMQ's AllocateMessageQueueAveragely.

    Both lists are sorted first, so every party computes the same answer: member ``i``
    of ``n`` gets a contiguous run of ``len(queues) // n`` queues, the first
    ``len(queues) % n`` members one more; with more members than queues the last
    members get none. ``[]`` when ``member`` is not among ``members``.
    """
    ordered_queues = sorted(queues)
    ordered_members = sorted(members)
    if member not in ordered_members or not ordered_queues:
        return []
    index = ordered_members.index(member)
    q, n = len(ordered_queues), len(ordered_members)
    mod = q % n
    # RocketMQ: averageSize = q <= n ? 1 : (mod > 0 && index < mod ? q / n + 1 : q / n)
    size = 1 if q <= n else (q // n + 1 if index < mod else q // n)
    start = index * size if index < mod else index * size + mod
    count = min(size, q - start)
    return [ordered_queues[start + i] for i in range(max(0, count))]


@dataclass(slots=True)
class _Member:
    last_seen_ms: int
    connection: Hashable


@dataclass(slots=True)
class _Group:
    queue_count: int
    members: dict[str, _Member] = field(default_factory=dict)
    assignment: dict[str, tuple[int, ...]] = field(default_factory=dict)
    owner: dict[int, str] = field(default_factory=dict)  # queue -> member

    def rebalance(self) -> None:
        ids = sorted(self.members)
        queues = range(self.queue_count)
        self.assignment = {m: tuple(allocate_averagely(queues, ids, m)) for m in ids}
        self.owner = {q: m for m, qs in self.assignment.items() for q in qs}


class GroupRegistry:
    """Every (group, subject)'s members and their queues.

    Methods that change membership return the (group, subject) keys whose assignment
    may have changed, so the broker can reset delivery cursors and wake held PULLs.
    """

    def __init__(self, timeout_ms: int) -> None:
        if timeout_ms <= 0:
            raise ValueError(f"timeout_ms must be positive, got {timeout_ms}")
        self.timeout_ms = timeout_ms
        self._groups: dict[GroupKey, _Group] = {}

    def join(
        self,
        group: str,
        subject: str,
        consumer_id: str,
        queue_count: int,
        connection: Hashable,
        now_ms: int,
    ) -> tuple[tuple[int, ...], bool]:
        """Add (or refresh) a member; returns (its queues, whether the assignment changed).

        A member that joins again from another connection (a reconnect) is bound to the
        new one.
        """
        key = (group, subject)
        state = self._groups.get(key)
        if state is None:
            state = self._groups[key] = _Group(queue_count)
        member = state.members.get(consumer_id)
        changed = member is None or state.queue_count != queue_count
        state.members[consumer_id] = _Member(now_ms, connection)
        state.queue_count = queue_count
        if changed:
            state.rebalance()
        return state.assignment[consumer_id], changed

    def touch(
        self, group: str, subject: str, consumer_id: str, connection: Hashable, now_ms: int
    ) -> tuple[int, ...] | None:
        """A heartbeat (or a PULL): the member's queues, or None when it is not a member
        (never joined, timed out, or its connection closed)."""
        state = self._groups.get((group, subject))
        member = None if state is None else state.members.get(consumer_id)
        if member is None:
            return None
        member.last_seen_ms = now_ms
        member.connection = connection
        return state.assignment[consumer_id]

    def assignment(self, group: str, subject: str, consumer_id: str) -> tuple[int, ...] | None:
        state = self._groups.get((group, subject))
        if state is None or consumer_id not in state.members:
            return None
        return state.assignment[consumer_id]

    def owner(self, group: str, subject: str, queue: int) -> str | None:
        """The member that consumes ``queue`` now, or None."""
        state = self._groups.get((group, subject))
        return None if state is None else state.owner.get(queue)

    def leave_connection(self, connection: Hashable) -> set[GroupKey]:
        """Drop every member bound to ``connection`` (it closed)."""
        return self._drop(lambda m: m.connection == connection)

    def expire(self, now_ms: int) -> set[GroupKey]:
        """Drop members silent for ``timeout_ms`` or more."""
        limit = now_ms - self.timeout_ms
        return self._drop(lambda m: m.last_seen_ms <= limit)

    def next_expiry_ms(self) -> int | None:
        """When the next member times out if nothing is heard from it, or None."""
        times = [m.last_seen_ms for g in self._groups.values() for m in g.members.values()]
        return min(times) + self.timeout_ms if times else None

    def members(self, group: str, subject: str) -> list[str]:
        state = self._groups.get((group, subject))
        return sorted(state.members) if state is not None else []

    def keys(self) -> list[GroupKey]:
        return list(self._groups)

    def _drop(self, doomed) -> set[GroupKey]:  # a predicate on _Member
        changed: set[GroupKey] = set()
        for key, state in self._groups.items():
            gone = [cid for cid, m in state.members.items() if doomed(m)]
            for cid in gone:
                del state.members[cid]
            if gone:
                state.rebalance()
                changed.add(key)
        return changed
