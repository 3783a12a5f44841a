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

Who holds which queue is this broker's memory only. A broker that begins to lead its
replicated group (:meth:`GroupRegistry.promoted`) forgets the members it had and holds
every queue of the consumer groups that have committed offsets until a member that
rejoins *claims* it (JOIN_GROUP's ``held``: the queues it still holds, with messages in
hand its commit of could not land while the group had no leader), or until
``timeout_ms`` pass without a claim (its holder did not come back: it is gone, as the
expiry rule says). A claimed queue goes back to its claimant, and the usual hand-over
then moves it towards the target assignment. A queue claimed by two members (one of
them stale: the old leader had already handed it over, or was handing it over) is held
by both and served to neither until all but one let go, as in a hand-over.
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
    (``revoked_ms``: since when), so nobody is served the queue meanwhile. After a
    promotion a queue may be ``unclaimed`` (held for a holder the old leader knew, not
    back yet) or have ``co_holders`` (several members claimed it): it is served to
    nobody then either.
    """

    queue_count: int
    members: dict[str, _Member] = field(default_factory=dict)
    assignment: dict[str, tuple[int, ...]] = field(default_factory=dict)
    owner: dict[int, str] = field(default_factory=dict)  # queue -> target member
    holder: dict[int, str] = field(default_factory=dict)  # queue -> member consuming it
    co_holders: dict[int, set[str]] = field(default_factory=dict)  # queue -> other claimants
    unclaimed: set[int] = field(default_factory=set)  # held for a holder not back yet
    revoked_ms: dict[int, int] = field(default_factory=dict)  # queue -> hand-over start

    def rebalance(self, now_ms: int) -> list[int]:
        ids = sorted(self.members)
        queues = range(self.queue_count)
        self.assignment = {m: tuple(allocate_averagely(queues, ids, m)) for m in ids}
        self.owner = {q: m for m, qs in self.assignment.items() for q in qs}
        return self.settle(now_ms)

    def release(self, queues: Iterable[int], now_ms: int, member: str | None = None) -> list[int]:
        """``member`` (None: every holder) lets go of ``queues``; returns the wait of
        each hand-over that completed (ms)."""
        for queue in queues:
            if member is None or self.holder.get(queue) == member:
                self.holder.pop(queue, None)
            if member is None:
                self.co_holders.pop(queue, None)
            else:
                self.co_holders.get(queue, set()).discard(member)
        return self.settle(now_ms)

    def holders(self, queue: int) -> list[str]:
        """Every member that holds ``queue``: its holder first, then other claimants."""
        first = self.holder.get(queue)
        others = sorted(self.co_holders.get(queue, ()))
        return others if first is None else [first, *others]

    def claim(self, member: str, queues: Iterable[int]) -> bool:
        """``member`` says it holds ``queues`` (after a promotion): an unclaimed one is
        its; one another member claimed is held by both. Returns whether any was new."""
        claimed = False
        for queue in queues:
            if queue >= self.queue_count or member in self.holders(queue):
                continue
            if queue in self.unclaimed:
                self.unclaimed.discard(queue)
                self.holder[queue] = member
            elif queue in self.holder:
                self.co_holders.setdefault(queue, set()).add(member)
            else:
                self.holder[queue] = member
            claimed = True
        return claimed

    def settle(self, now_ms: int) -> list[int]:
        """Give every queue nobody holds (and nobody may still claim) to its target
        owner; start the hand-over of a queue held by another member, or by several.
        Returns the waits of the hand-overs completed."""
        waits = []
        for queue in range(self.queue_count):
            if queue in self.unclaimed:
                continue
            target = self.owner.get(queue)
            # A holder that left or crashed, or never confirms, lets go: redelivery from
            # the committed offset.
            holders = [
                m
                for m in self.holders(queue)
                if m in self.members and (m == target or self.members[m].confirms)
            ]
            if not holders and target is not None:
                holders = [target]
            # Of several claimants the target keeps it; the others hand it over.
            holder = target if target in holders else (holders[0] if holders else None)
            others = set(holders) - {holder}
            self.co_holders.pop(queue, None)
            if others:
                self.co_holders[queue] = others
            if holder is None:
                self.holder.pop(queue, None)
            else:
                self.holder[queue] = holder
            if holder == target and not others:
                started = self.revoked_ms.pop(queue, None)
                if started is not None:
                    waits.append(now_ms - started)
            else:
                self.revoked_ms.setdefault(queue, now_ms)
        for queue in [q for q in self.holder if q >= self.queue_count]:
            del self.holder[queue]
        for queue in [q for q in self.co_holders if q >= self.queue_count]:
            del self.co_holders[queue]
        self.unclaimed = {q for q in self.unclaimed if q < self.queue_count}
        return waits

    def serving(self, member: str) -> tuple[int, ...]:
        return tuple(
            q
            for q in self.assignment.get(member, ())
            if self.holder.get(q) == member and q not in self.co_holders
        )


class GroupRegistry:
    """Every (group, subject)'s members and their queues.

    Methods that change membership or hand a queue over return the (group, subject)
    keys whose assignment may have changed, so the broker can reset delivery cursors
    and wake held PULLs. ``handovers`` counts the completed hand-overs and
    ``handover_wait_ms_total`` the time they waited for their old owners (a metric);
    ``claim_holds`` counts the queues held after a promotion until claimed or given
    out, ``claim_hold_ms_total`` the time they were held, and ``unclaimed_given``
    those nobody claimed within ``timeout_ms`` (metrics).
    """

    def __init__(self, timeout_ms: int) -> None:
        if timeout_ms <= 0:
            raise ValueError(f"timeout_ms must be positive, got {timeout_ms}")
        self.timeout_ms = timeout_ms
        self.handovers = 0
        self.handover_wait_ms_total = 0
        self.claim_holds = 0
        self.claim_hold_ms_total = 0
        self.unclaimed_given = 0
        self._groups: dict[GroupKey, _Group] = {}
        # After a promotion: the groups whose queues wait for claims, since when, and
        # until when (None: no promotion's claims are awaited).
        self._claimable: set[GroupKey] = set()
        self._promoted_ms = 0
        self._claims_until_ms: int | None = None

    def promoted(self, known: Iterable[GroupKey], now_ms: int) -> None:
        """This broker leads its group from now on: forget every member (they were
        another leadership's: they join again), and hold every queue of the groups in
        ``known`` (those with committed offsets; a group without any has nothing in
        anyone's hand) until a member that joins claims it, or ``timeout_ms`` pass."""
        self._groups.clear()
        self._claimable = set(known)
        self._promoted_ms = now_ms
        self._claims_until_ms = now_ms + self.timeout_ms if self._claimable else None

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
        held: Iterable[int] = (),
    ) -> tuple[tuple[int, ...], bool]:
        """Add (or refresh) a member; returns (its target queues, whether the assignment
        or who holds a queue changed). ``confirms=False``: a member that cannot say which
        queues it holds (it keeps no prefetch, as an HTTP consumer): its lost queues
        move at once. ``held``: the queues the member says it still holds; a claim
        while this broker awaits claims after a promotion (:meth:`promoted`), else
        ignored: this broker knows who holds what.

        A member that joins again from another connection (a reconnect) is bound to the
        new one and keeps the queues it holds.
        """
        key = (group, subject)
        claiming = self._claiming(key, now_ms)
        state = self._groups.get(key)
        if state is None:
            state = self._groups[key] = _Group(queue_count)
            if claiming:
                state.unclaimed = set(range(queue_count))
        member = state.members.get(consumer_id)
        changed = member is None or state.queue_count != queue_count
        state.members[consumer_id] = _Member(now_ms, connection, confirms)
        state.queue_count = queue_count
        if claiming:
            unclaimed = len(state.unclaimed)
            if state.claim(consumer_id, held):
                changed = True
                self._held_after_promotion(unclaimed - len(state.unclaimed), now_ms)
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
        let_go = [
            q for q in range(state.queue_count) if q not in keep and consumer_id in state.holders(q)
        ]
        if not let_go:
            return False
        self._handed_over(state.release(let_go, now_ms, consumer_id))
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

    def unclaimed(self, group: str, subject: str) -> set[int]:
        """Queues held after a promotion for a holder that has not claimed them yet."""
        state = self._groups.get((group, subject))
        return set() if state is None else set(state.unclaimed)

    def leave_connection(self, connection: Hashable, now_ms: int) -> set[GroupKey]:
        """Drop every member bound to ``connection`` (it closed)."""
        return self._drop(lambda m: m.connection == connection, now_ms)

    def expire(self, now_ms: int) -> set[GroupKey]:
        """Drop members silent for ``timeout_ms`` or more, and end the hand-overs whose
        old owner did not let go within ``timeout_ms`` (it is alive but stuck: its
        uncommitted messages go to the new owner from the committed offset)."""
        changed = self._drop(lambda m: m.last_seen_ms <= now_ms - self.timeout_ms, now_ms)
        if self._claims_until_ms is not None and now_ms >= self._claims_until_ms:
            # Nobody claimed them in time: their holders are gone.
            self._claims_until_ms = None
            self._claimable.clear()
            for key, state in self._groups.items():
                if state.unclaimed:
                    self.unclaimed_given += len(state.unclaimed)
                    self._held_after_promotion(len(state.unclaimed), now_ms)
                    state.unclaimed.clear()
                    self._handed_over(state.settle(now_ms))
                    changed.add(key)
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
        if any(g.unclaimed for g in self._groups.values()):
            times.append(self._promoted_ms)  # the claims end timeout_ms after it
        return min(times) + self.timeout_ms if times else None

    def queues_in_handover(self) -> int:
        return sum(len(g.revoked_ms) for g in self._groups.values())

    def queues_unclaimed(self) -> int:
        return sum(len(g.unclaimed) for g in self._groups.values())

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

    def _claiming(self, key: GroupKey, now_ms: int) -> bool:
        """Whether claims on ``key``'s queues count now (after a promotion)."""
        until = self._claims_until_ms
        return until is not None and now_ms < until and key in self._claimable

    def _held_after_promotion(self, queues: int, now_ms: int) -> None:
        self.claim_holds += queues
        self.claim_hold_ms_total += queues * (now_ms - self._promoted_ms)

    def _handed_over(self, waits_ms: list[int]) -> None:
        self.handovers += len(waits_ms)
        self.handover_wait_ms_total += sum(waits_ms)
