"""Which delay group of a cluster a message id belongs to, sans-I/O (docs/cluster.md,
"Routing by message id").

The owner of an id is chosen by rendezvous hashing — highest random weight (Thaler and
Ravishankar, 1998): every *active* delay group of the registry scores
``xxh64(id, seed=xxh64(group))`` and the highest wins. Every producer with the same
registry picks the same owner, with no state shared between them; adding a group moves
only the ids the new group now wins, draining one moves only its own.

A lookup by id (cancel, reschedule) asks the owner first and then every other group that
may still hold the id (active and draining: a draining group keeps answering about what
it holds), so a message scheduled before the active set changed is still found.

A send asks first, when the active set changed lately, every group that may have owned
the id when it was sent before (``possible_owners``, ``ResendCheck``): a resend of an id
one of them holds is answered DUPLICATE, not stored a second time by its new owner.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import xxhash

from delayd.client.cancel_receipt import CancelReceipt, RescheduleReceipt
from delayd.client.receipt import Receipt
from delayd.cluster.registry import GroupKind, GroupStatus, Registration
from delayd.errors import UnreachableError
from delayd.protocol import CancelOutcome, RescheduleOutcome, ResultCode

R = TypeVar("R", CancelReceipt, RescheduleReceipt)

# How long a producer trusts the registry it read: a group added or drained is picked
# up within this, or at once after a failure.
REFRESH_S = 2.0
# How long after its first send an id sent again is still checked at the groups that
# may have owned it then (a producer option, docs/clients.md): one day.
RESEND_WINDOW_S = 86_400.0
# Added to the window: a send routes by a registry read up to REFRESH_S before, a call
# keeps its route through its retries (timeout_s), and ``changed_ms`` is the clock of
# the host that changed the status, which may be ahead of the producer's.
CHANGE_MARGIN_MS = 60_000


def owner(message_id: str, groups: Sequence[str]) -> str:
    """The group of ``groups`` (not empty) that ``message_id`` belongs to."""
    return _owner(message_id.encode(), _seeded(groups))


def _seeded(groups: Sequence[str]) -> list[tuple[int, str]]:
    return [(_seed(group), group) for group in groups]


def _owner(data: bytes, seeded: Sequence[tuple[int, str]]) -> str:
    """The best score wins, the greater name on a tie: ``owner`` with the groups'
    seeds computed once for many ids."""
    digest = xxhash.xxh64_intdigest
    best_score, best = -1, ""
    for seed, group in seeded:
        score = digest(data, seed)
        if score > best_score or (score == best_score and group > best):
            best_score, best = score, group
    return best


def _seed(group: str) -> int:
    return xxhash.xxh64_intdigest(group.encode())


def possible_owners(message_id: str, entries: Sequence[Registration], since_ms: int) -> list[str]:
    """Every group of ``entries`` (the registry's active and draining delay groups) that
    may have been ``message_id``'s owner at some time from ``since_ms`` to now, best
    score first (so the owner now is the first active one), knowing of each group only
    what the registry holds: it did not exist before ``registered_ms``, was registered
    active, has its status now since ``changed_ms``, and in between (when ``changed_ms``
    is later than ``registered_ms``) had any status at any time.

    The rule: walk the groups by score, best first, keeping ``free_until``: the window's
    times before it are those at which every group passed may have been inactive
    (``[since_ms, free_until)``; it starts unbounded). An active group is a candidate
    when it existed before ``free_until``, and then bounds it by its ``changed_ms``
    (from then on it is surely active). A draining group is a candidate when it may
    have been active at a free time — between its registration and its drain — and
    bounds nothing (it may have been inactive at any time). The walk ends at the first
    active group unchanged since ``since_ms`` (active through the whole window: nothing
    below it was the owner then).

    Sound: the owner at a time s of the window is the best group active at s; every
    group above it was inactive at s, so s is free when the walk reaches it, and it
    existed and was active at s, so the walk takes it. Exact: for a candidate g, a
    history that leaves the same registry has g the owner at a free time s (not a
    registration time): every group above g changes to draining at s (it may: s is
    free) and g to active (it may: it existed, and had not yet drained).
    Retired groups are not in ``entries``: lookups no longer ask them (docs/cluster.md).
    """
    data = message_id.encode()
    ranked = sorted(entries, key=lambda e: (xxhash.xxh64_intdigest(data, _seed(e.group)), e.group))
    found = []
    free_until = math.inf
    for entry in reversed(ranked):
        if free_until <= since_ms:
            break
        if entry.status is GroupStatus.ACTIVE:
            if entry.registered_ms < free_until:
                found.append(entry.group)
            free_until = min(free_until, entry.changed_ms)
        elif max(since_ms, entry.registered_ms) < min(free_until, entry.changed_ms):
            found.append(entry.group)
    return found


@dataclass(frozen=True, slots=True)
class DelayGroups:
    """The delay groups of a cluster's registry: ``active`` take new ids; ``lookup``
    (active and draining, by name) are asked about ids they may hold. ``entries``: the
    registry entries of ``lookup`` (a group without one registered and changed long
    ago)."""

    active: tuple[str, ...]
    lookup: tuple[str, ...]
    entries: Mapping[str, Registration] = field(default_factory=dict)

    @classmethod
    def from_registry(cls, entries: Mapping[str, Registration]) -> DelayGroups:
        delay = sorted(
            (e for e in entries.values() if e.kind is GroupKind.DELAY), key=lambda e: e.group
        )
        lookup = [e for e in delay if e.status is not GroupStatus.RETIRED]
        return cls(
            active=tuple(e.group for e in delay if e.status is GroupStatus.ACTIVE),
            lookup=tuple(e.group for e in lookup),
            entries={e.group: e for e in lookup},
        )

    def changed_since(self, since_ms: int) -> bool:
        """Whether a group was registered or changed status after ``since_ms``: else
        every id's one possible owner in the window is its owner now (a send asks no
        one first: the usual case, checked once per call)."""
        return any(e.changed_ms > since_ms for e in self.entries.values())

    def previous_owners(
        self, message_id: str, since_ms: int, entries: Sequence[Registration] | None = None
    ) -> list[str]:
        """The groups other than its owner now that may have owned ``message_id`` at
        some time from ``since_ms`` on (``possible_owners``), best score first;
        ``entries``: ``registrations()``, when the caller has it already."""
        if entries is None:
            entries = self.registrations()
        now = self.owner(message_id)
        return [g for g in possible_owners(message_id, entries, since_ms) if g != now]

    def registrations(self) -> list[Registration]:
        """The registry entry of each of ``lookup`` (made up, registered and changed at
        0, for a group without one)."""
        return [
            self.entries.get(g)
            or Registration(
                g,
                GroupKind.DELAY,
                GroupStatus.ACTIVE if g in self.active else GroupStatus.DRAINING,
                0,
                0,
            )
            for g in self.lookup
        ]

    def owner(self, message_id: str) -> str:
        """The active group ``message_id`` is sent to. Raises UnreachableError when the
        cluster has no active delay group."""
        if not self.active:
            raise UnreachableError(
                "the cluster has no active delay group (delayd cluster status; "
                "delayd cluster activate GROUP)"
            )
        return owner(message_id, self.active)

    def ask_order(self, message_id: str) -> list[str]:
        """The groups to ask about ``message_id``, owner first, then the others that may
        hold it, by name."""
        first = [owner(message_id, self.active)] if self.active else []
        return [*first, *(g for g in self.lookup if g not in first)]

    def held(
        self, message_ids: Sequence[str], answers: Mapping[str, Sequence[int | None]]
    ) -> list[int | None]:
        """For each id, the due time the first group of its ``ask_order`` that holds it
        answered (``answers``: every ``lookup`` group's HELD_IDS answers to
        ``message_ids``), or None when none does."""
        return [
            next(
                (due for g in self.ask_order(m) if (due := answers[g][i]) is not None),
                None,
            )
            for i, m in enumerate(message_ids)
        ]

    def split(self, message_ids: Sequence[str]) -> dict[str, list[int]]:
        """The indexes of ``message_ids`` by owner, in their order (UnreachableError as
        ``owner``)."""
        if not message_ids:
            return {}
        self.owner(message_ids[0])  # UnreachableError without an active group
        seeded = _seeded(self.active)
        by_group: dict[str, list[int]] = {}
        for index, message_id in enumerate(message_ids):
            by_group.setdefault(_owner(message_id.encode(), seeded), []).append(index)
        return by_group


class Lookup(Generic[R]):
    """Ids asked about group by group (cancel, reschedule), sans-I/O: ``next_round``
    says which ids to ask which group now, ``answered`` takes the receipts. An id's
    groups are asked one at a time in ``DelayGroups.ask_order``; an UNKNOWN answer
    moves it to the next, any other answer is final. An id every group answered UNKNOWN
    for is UNKNOWN. The caller raises when a group cannot be asked (naming it): an id
    is never answered UNKNOWN for a group that did not answer."""

    def __init__(self, message_ids: Sequence[str], groups: DelayGroups) -> None:
        if not groups.lookup:
            raise UnreachableError("the cluster has no delay group (delayd cluster status)")
        self.message_ids = list(message_ids)
        self._order = [groups.ask_order(message_id) for message_id in self.message_ids]
        self._answers: list[R | None] = [None] * len(self.message_ids)
        self._open = set(range(len(self.message_ids)))
        self._round = 0

    def next_round(self) -> dict[str, list[int]]:
        """The indexes of the ids still open, by the group to ask next (empty: done)."""
        by_group: dict[str, list[int]] = {}
        for index in sorted(self._open):
            order = self._order[index]
            if self._round < len(order):
                by_group.setdefault(order[self._round], []).append(index)
        self._open = {i for indexes in by_group.values() for i in indexes}
        self._round += 1
        return by_group

    def answered(self, indexes: Sequence[int], receipts: Sequence[R]) -> None:
        for index, receipt in zip(indexes, receipts, strict=True):
            self._answers[index] = receipt
            if not _unknown(receipt):
                self._open.discard(index)

    def receipts(self) -> list[R]:
        """One receipt per id, in the order given (after the last round)."""
        assert not self._open and all(r is not None for r in self._answers)
        return [r for r in self._answers if r is not None]


def _unknown(receipt: CancelReceipt | RescheduleReceipt) -> bool:
    if isinstance(receipt, CancelReceipt):
        return receipt.outcome is CancelOutcome.UNKNOWN
    return receipt.outcome is RescheduleOutcome.UNKNOWN


class ResendCheck:
    """The groups a batch's ids are to be asked about before they are sent, sans-I/O
    (docs/cluster.md, "A resend of the same id after the active set changed").

    An id's possible previous owners (``DelayGroups.previous_owners`` over the window
    from ``since_ms``) are asked whether they hold it, one HELD_IDS per group: ``asks``
    has the indexes of the ids to ask each group. ``answered`` takes a group's answers.
    An id one of them holds gets a DUPLICATE receipt with that group's due time (the
    best-ranked such group's) and is not sent; ``parts`` splits the others by owner.
    With no status change since ``since_ms`` nothing is asked (the usual case)."""

    def __init__(
        self, message_ids: Sequence[str], groups: DelayGroups, since_ms: int | None
    ) -> None:
        """``since_ms`` None: ask no group (the producer's window is 0)."""
        self.message_ids = message_ids
        self.groups = groups
        self.asks: dict[str, list[int]] = {}
        self._previous: dict[int, list[str]] = {}
        self._held: dict[int, dict[str, int]] = {}
        if since_ms is None or not groups.changed_since(since_ms):
            return
        entries = groups.registrations()
        for index, message_id in enumerate(message_ids):
            previous = groups.previous_owners(message_id, since_ms, entries)
            if previous:
                self._previous[index] = previous
                for group in previous:
                    self.asks.setdefault(group, []).append(index)

    def answered(self, group: str, indexes: Sequence[int], due_ms: Sequence[int | None]) -> None:
        for index, held_due_ms in zip(indexes, due_ms, strict=True):
            if held_due_ms is not None:
                self._held.setdefault(index, {})[group] = held_due_ms

    def receipts(self) -> dict[int, Receipt]:
        """The DUPLICATE receipts of the ids a previous owner holds, by index."""
        found = {}
        for index, by_group in self._held.items():
            group = next(g for g in self._previous[index] if g in by_group)
            found[index] = Receipt(
                self.message_ids[index],
                ResultCode.DUPLICATE,
                f"held by delay group {group}, its owner before the cluster's active delay "
                "groups changed: not stored again (due_ms is the held message's)",
                due_ms=by_group[group],
            )
        return found

    def parts(self) -> dict[str, list[int]]:
        """The indexes of the ids no previous owner holds, by owner, in their order
        (UnreachableError as ``DelayGroups.owner``)."""
        if not self._held:
            return self.groups.split(self.message_ids)
        todo = [i for i in range(len(self.message_ids)) if i not in self._held]
        parts = self.groups.split([self.message_ids[i] for i in todo])
        return {group: [todo[i] for i in indexes] for group, indexes in parts.items()}
