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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import xxhash

from delayd.client.cancel_receipt import CancelReceipt, RescheduleReceipt
from delayd.cluster.registry import GroupKind, GroupStatus, Registration
from delayd.errors import UnreachableError
from delayd.protocol import CancelOutcome, RescheduleOutcome

R = TypeVar("R", CancelReceipt, RescheduleReceipt)

# How long a producer trusts the registry it read: a group added or drained is picked
# up within this, or at once after a failure.
REFRESH_S = 2.0


def owner(message_id: str, groups: Sequence[str]) -> str:
    """The group of ``groups`` (not empty) that ``message_id`` belongs to."""
    data = message_id.encode()
    return max(groups, key=lambda g: (xxhash.xxh64_intdigest(data, _seed(g)), g))


def _seed(group: str) -> int:
    return xxhash.xxh64_intdigest(group.encode())


@dataclass(frozen=True, slots=True)
class DelayGroups:
    """The delay groups of a cluster's registry: ``active`` take new ids; ``lookup``
    (active and draining, by name) are asked about ids they may hold."""

    active: tuple[str, ...]
    lookup: tuple[str, ...]

    @classmethod
    def from_registry(cls, entries: Mapping[str, Registration]) -> DelayGroups:
        delay = sorted(
            (e for e in entries.values() if e.kind is GroupKind.DELAY), key=lambda e: e.group
        )
        return cls(
            active=tuple(e.group for e in delay if e.status is GroupStatus.ACTIVE),
            lookup=tuple(e.group for e in delay if e.status is not GroupStatus.RETIRED),
        )

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

    def split(self, message_ids: Sequence[str]) -> dict[str, list[int]]:
        """The indexes of ``message_ids`` by owner, in their order (UnreachableError as
        ``owner``)."""
        by_group: dict[str, list[int]] = {}
        for index, message_id in enumerate(message_ids):
            by_group.setdefault(self.owner(message_id), []).append(index)
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
