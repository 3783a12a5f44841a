"""Consumer groups: membership with heartbeats, and the queue assignment.

A member is a ``consumer_id`` in a (group, subject). It joins with JOIN_GROUP and stays
while it sends HEARTBEAT or PULL at least every ``timeout_ms``, and while the connection
it last spoke on is open. Each member gets the queues :func:`allocate_averagely` gives
it; every member computes nothing itself — the broker tells it in each JOIN/HEARTBEAT
answer. Pure logic: ``now_ms`` is an argument, nothing here reads a clock.

A queue moves in two steps (cooperative, as Kafka's CooperativeStickyAssignor): when
the target assignment moves it, its old owner keeps holding it and nobody is served
it; the old owner learns from its next HEARTBEAT answer that the queue is gone, drops
what it prefetched of it, lets what its application holds be committed, and confirms
by leaving the queue out of the queues it says it still holds (:meth:`confirm`). Only
then does the new owner read it, from the committed offset — so nothing the old owner
handed out comes again. A member that leaves or crashes lets go at once, and one that
does not confirm within ``timeout_ms`` is overruled (:meth:`expire`); what it handed
out without committing is then delivered again (at-least-once).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
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
    confirms: bool = True  # False: it cannot say what it holds, so it lets go at once


@dataclass(slots=True)
class _Group:
    """One (group, subject): its members, the target assignment, and who holds what.

    ``assignment``/``owner`` are the target (:func:`allocate_averagely`); ``holder`` is
    the member that actually consumes a queue now. They differ while a queue is in
    hand-over: the old owner was told it lost the queue and has not yet confirmed
    (``revoked_ms``: since when), so nobody is served the queue meanwhile.
    """

    queue_count: int
    members: dict[str, _Member] = field(default_factory=dict)
    assignment: dict[str, tuple[int, ...]] = field(default_factory=dict)
    owner: dict[int, str] = field(default_factory=dict)  # queue -> target member
    holder: dict[int, str] = field(default_factory=dict)  # queue -> member consuming it
    revoked_ms: dict[int, int] = field(default_factory=dict)  # queue -> hand-over start

    def rebalance(self, now_ms: int) -> list[int]:
        ids = sorted(self.members)
        queues = range(self.queue_count)
        self.assignment = {m: tuple(allocate_averagely(queues, ids, m)) for m in ids}
        self.owner = {q: m for m, qs in self.assignment.items() for q in qs}
        return self.settle(now_ms)

    def release(self, queues: Iterable[int], now_ms: int) -> list[int]:
        """The holders of ``queues`` let go of them; returns the wait of each hand-over
        that completed (ms)."""
        for queue in queues:
            self.holder.pop(queue, None)
        return self.settle(now_ms)

    def settle(self, now_ms: int) -> list[int]:
        """Give every queue nobody holds to its target owner; start the hand-over of a
        queue held by another member. Returns the waits of the hand-overs completed."""
        waits = []
        for queue in range(self.queue_count):
            target = self.owner.get(queue)
            holder = self.holder.get(queue)
            member = None if holder is None else self.members.get(holder)
            if member is None or (holder != target and not member.confirms):
                # It left or crashed, or never confirms: redelivery from the committed
                # offset.
                holder = None
            if holder is None:
                if target is None:
                    self.holder.pop(queue, None)
                else:
                    self.holder[queue] = target
            if self.holder.get(queue) == target:
                started = self.revoked_ms.pop(queue, None)
                if started is not None:
                    waits.append(now_ms - started)
            else:
                self.revoked_ms.setdefault(queue, now_ms)
        for queue in [q for q in self.holder if q >= self.queue_count]:
            del self.holder[queue]
        return waits

    def serving(self, member: str) -> tuple[int, ...]:
        return tuple(q for q in self.assignment.get(member, ()) if self.holder.get(q) == member)


class GroupRegistry:
    """Every (group, subject)'s members and their queues.

    Methods that change membership or hand a queue over return the (group, subject)
    keys whose assignment may have changed, so the broker can reset delivery cursors
    and wake held PULLs. ``handovers`` counts the completed hand-overs and
    ``handover_wait_ms_total`` the time they waited for their old owners (a metric).
    """

    def __init__(self, timeout_ms: int) -> None:
        if timeout_ms <= 0:
            raise ValueError(f"timeout_ms must be positive, got {timeout_ms}")
        self.timeout_ms = timeout_ms
        self.handovers = 0
        self.handover_wait_ms_total = 0
        self._groups: dict[GroupKey, _Group] = {}

    def join(
        self,
        group: str,
        subject: str,
        consumer_id: str,
        queue_count: int,
        connection: Hashable,
        now_ms: int,
        *,
        confirms: bool = True,
    ) -> tuple[tuple[int, ...], bool]:
        """Add (or refresh) a member; returns (its target queues, whether the assignment
        changed). ``confirms=False``: a member that cannot say which queues it holds
        (it keeps no prefetch, as an HTTP consumer): its lost queues move at once.

        A member that joins again from another connection (a reconnect) is bound to the
        new one and keeps the queues it holds.
        """
        key = (group, subject)
        state = self._groups.get(key)
        if state is None:
            state = self._groups[key] = _Group(queue_count)
        member = state.members.get(consumer_id)
        changed = member is None or state.queue_count != queue_count
        state.members[consumer_id] = _Member(now_ms, connection, confirms)
        state.queue_count = queue_count
        if changed:
            self._handed_over(state.rebalance(now_ms))
        return state.assignment[consumer_id], changed

    def touch(
        self, group: str, subject: str, consumer_id: str, connection: Hashable, now_ms: int
    ) -> tuple[int, ...] | None:
        """A heartbeat (or a PULL): the member's target queues, or None when it is not a
        member (never joined, timed out, or its connection closed)."""
        state = self._groups.get((group, subject))
        member = None if state is None else state.members.get(consumer_id)
        if member is None:
            return None
        member.last_seen_ms = now_ms
        member.connection = connection
        return state.assignment[consumer_id]

    def confirm(
        self, group: str, subject: str, consumer_id: str, held: Iterable[int], now_ms: int
    ) -> bool:
        """The member says it still holds only ``held``: every queue it holds beyond its
        target and not in ``held`` is released to its new owner. Returns whether a
        hand-over completed (then wake that owner's PULLs)."""
        state = self._groups.get((group, subject))
        if state is None or consumer_id not in state.members:
            return False
        keep = set(held) | set(state.assignment[consumer_id])
        let_go = [q for q, m in state.holder.items() if m == consumer_id and q not in keep]
        if not let_go:
            return False
        self._handed_over(state.release(let_go, now_ms))
        return True

    def assignment(self, group: str, subject: str, consumer_id: str) -> tuple[int, ...] | None:
        """The member's target queues, or None when it is not a member."""
        state = self._groups.get((group, subject))
        if state is None or consumer_id not in state.members:
            return None
        return state.assignment[consumer_id]

    def serving(self, group: str, subject: str, consumer_id: str) -> tuple[int, ...]:
        """The member's target queues that no other member still holds: what its PULL
        reads."""
        state = self._groups.get((group, subject))
        return () if state is None else state.serving(consumer_id)

    def owner(self, group: str, subject: str, queue: int) -> str | None:
        """The member that consumes ``queue`` now (its holder), or None."""
        state = self._groups.get((group, subject))
        return None if state is None else state.holder.get(queue)

    def in_handover(self, group: str, subject: str) -> dict[int, int]:
        """Queues waiting for their old owner to let go -> since when (ms)."""
        state = self._groups.get((group, subject))
        return {} if state is None else dict(state.revoked_ms)

    def leave_connection(self, connection: Hashable, now_ms: int) -> set[GroupKey]:
        """Drop every member bound to ``connection`` (it closed)."""
        return self._drop(lambda m: m.connection == connection, now_ms)

    def expire(self, now_ms: int) -> set[GroupKey]:
        """Drop members silent for ``timeout_ms`` or more, and end the hand-overs whose
        old owner did not let go within ``timeout_ms`` (it is alive but stuck: its
        uncommitted messages go to the new owner from the committed offset)."""
        changed = self._drop(lambda m: m.last_seen_ms <= now_ms - self.timeout_ms, now_ms)
        for key, state in self._groups.items():
            overdue = [q for q, t in state.revoked_ms.items() if t <= now_ms - self.timeout_ms]
            if overdue:
                self._handed_over(state.release(overdue, now_ms))
                changed.add(key)
        return changed

    def next_expiry_ms(self) -> int | None:
        """When the next member times out if nothing is heard from it, or the next
        hand-over is overdue; None when neither can happen."""
        times = [m.last_seen_ms for g in self._groups.values() for m in g.members.values()]
        times += [t for g in self._groups.values() for t in g.revoked_ms.values()]
        return min(times) + self.timeout_ms if times else None

    def queues_in_handover(self) -> int:
        return sum(len(g.revoked_ms) for g in self._groups.values())

    def members(self, group: str, subject: str) -> list[str]:
        state = self._groups.get((group, subject))
        return sorted(state.members) if state is not None else []

    def keys(self) -> list[GroupKey]:
        return list(self._groups)

    def _drop(self, doomed, now_ms: int) -> set[GroupKey]:  # a predicate on _Member
        changed: set[GroupKey] = set()
        for key, state in self._groups.items():
            gone = [cid for cid, m in state.members.items() if doomed(m)]
            for cid in gone:
                del state.members[cid]
            if gone:
                self._handed_over(state.rebalance(now_ms))
                changed.add(key)
        return changed

    def _handed_over(self, waits_ms: list[int]) -> None:
        self.handovers += len(waits_ms)
        self.handover_wait_ms_total += sum(waits_ms)
