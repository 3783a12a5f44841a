"""The one checker of every fault test: what producers were told, held against what
consumers saw.

A test (or the load processes of tests/fault_load.py, through ``History.load``) records
a *history*: each send and the answer to it, each cancel and reschedule and theirs, each
message a consumer received and whether its commit landed. ``check`` counts:

- **lost**: acknowledged (OK, or DUPLICATE: stored by an earlier send whose answer was
  lost), not cancelled, due by ``due_by_ms``, and seen by no consumer of any group.
  A cancel or reschedule whose answer never came leaves the message in doubt: not
  counted lost.
- **early**: seen (the consumer's clock, ``seen_ms``), dispatched (the delay server's
  ``dispatched_ms``) or stored by the broker (``stored_ms``) before its due time less
  ``skew_ms``. The due time is the one the
  server answered, moved by every RESCHEDULED answer (a reschedule whose answer never
  came allows either time, so the earlier one counts; so does one answered
  ALREADY_DELIVERED, which may be the answer to a resend of a request an earlier
  attempt carried out); for a send never answered, its
  earliest possible due time (the client's clock at sending plus the delay). A copy
  that carries a due time between that earliest one and the answered one is an
  earlier attempt's (the client resent the send after a failover; the first attempt
  reached the old leader, which delivered it and was then cut): it is held to its own. Hosts in
  network namespaces share one kernel clock, so tests there use ``skew_ms = 0``;
  separate machines need their clock error here.
- **twice**: an id a consumer group received again *after* a commit covering an
  earlier copy had landed — the broker had answered it at or before the ms the copy
  came, so the group's committed offset said "done". A commit covers its own message
  and every one before it in the queue of its broker group (a Sighting's
  ``committed_ms``, or ``History.committed``). Also twice: an id found at two positions
  (broker group, queue, offset) (stored twice: a group reads both copies whatever it
  commits). A copy
  received again before any commit covering it landed is the at-least-once window,
  reported as ``redelivered``.
- **cancel violated**: an id answered CANCELLED that any consumer received. Histories
  never reuse an id after cancelling it, so every sighting counts.

``Report.assert_clean()`` fails with every count and the offending ids.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

SHOWN_IDS = 10  # offending ids listed per kind in a failure message


@dataclass(frozen=True)
class Sighting:
    """One message as a consumer received it. ``committed_ms``: when the commit
    covering it landed (the broker answered), None when no commit is known to have."""

    message_id: str
    seen_ms: int
    dispatched_ms: int | None = None  # when the delay server sent it to the broker
    due_ms: int | None = None  # as the message carried it
    position: tuple[int, int] | None = None  # (queue, queue_offset) at its broker
    group: str = ""
    committed_ms: int | None = None
    stored_ms: int | None = None  # when the broker stored it
    broker: str = ""  # the broker group it came from (a cluster has several)

    @property
    def times(self) -> list[int]:
        """Every time the message was somewhere: none may be before its due time."""
        return [t for t in (self.seen_ms, self.dispatched_ms, self.stored_ms) if t is not None]


@dataclass
class _Fate:
    """What the producers were told about one id."""

    earliest_due_ms: int | None = None  # sent, answer or not
    acked_due_ms: int | None = None  # OK or DUPLICATE
    duplicate: bool = False
    cancelled: bool = False
    in_doubt: bool = False  # a cancel or reschedule without an answer
    moves: list[int] = field(default_factory=list)  # RESCHEDULED to, in answer order
    unanswered_moves: list[int] = field(default_factory=list)


class History:
    """Everything a fault test learned, from any number of producers and consumers
    (one clock: the hosts' shared kernel clock, epoch ms)."""

    def __init__(self) -> None:
        self.fates: dict[str, _Fate] = defaultdict(_Fate)
        self.sightings: list[Sighting] = []
        # (broker group, group, queue) -> (offset committed through, when it landed)
        self.commits: dict[tuple[str, str, int], list[tuple[int, int]]] = defaultdict(list)

    # --- what producers were told -------------------------------------------------------

    def sent(self, message_id: str, earliest_due_ms: int) -> None:
        """A send went out (the earliest due time it can have: the client's clock when
        it sent, plus the delay)."""
        fate = self.fates[message_id]
        if fate.earliest_due_ms is None or earliest_due_ms < fate.earliest_due_ms:
            fate.earliest_due_ms = earliest_due_ms

    def acked(self, message_id: str, due_ms: int, *, duplicate: bool = False) -> None:
        """Answered OK (or DUPLICATE, with the due time of the copy held) at ``due_ms``."""
        fate = self.fates[message_id]
        fate.acked_due_ms = due_ms
        fate.duplicate |= duplicate

    def cancel(self, message_id: str, outcome: str | None) -> None:
        """A cancel answered ``outcome`` (CANCELLED, ALREADY_DELIVERED, UNKNOWN), or
        None when its answer never came."""
        fate = self.fates[message_id]
        if outcome == "CANCELLED":
            fate.cancelled = True
        elif outcome is None:
            fate.in_doubt = True

    def reschedule(self, message_id: str, outcome: str | None, due_ms: int) -> None:
        """A reschedule to ``due_ms`` answered ``outcome`` (RESCHEDULED moves the
        message; other answers leave it), or None when its answer never came."""
        fate = self.fates[message_id]
        if outcome == "RESCHEDULED":
            fate.moves.append(due_ms)
        elif outcome is None:
            fate.in_doubt = True
            fate.unanswered_moves.append(due_ms)
        elif outcome == "ALREADY_DELIVERED":
            # The client sends a request again when its answer was lost (a server
            # killed after deciding it): an earlier attempt of this very call may have
            # moved the message, which then went out at ``due_ms`` before the resend
            # was answered. So ``due_ms`` is a time it may have been due at.
            fate.unanswered_moves.append(due_ms)

    # --- what consumers saw ---------------------------------------------------------------

    def seen(self, sighting: Sighting) -> None:
        self.sightings.append(sighting)

    def seen_all(self, sightings: Iterable[Sighting]) -> None:
        self.sightings.extend(sightings)

    # --- the load processes' records ------------------------------------------------------

    def committed(
        self, group: str, queue: int, offset: int, landed_ms: int, *, broker: str = ""
    ) -> None:
        """A commit by ``group`` of ``queue`` through ``offset`` (that message and every
        one before it in the queue) landed at the broker group ``broker``: it answered
        at ``landed_ms``. Queues and offsets are a broker group's own: a commit covers
        nothing in another."""
        self.commits[(broker, group, queue)].append((offset, landed_ms))

    # --- the load processes' records ------------------------------------------------------

    @classmethod
    def load(cls, paths: Iterable[Path]) -> History:
        """The history written by tests/fault_load.py processes: one JSON object a line.
        A line cut by a kill -9 (the last one of a file) is ignored."""
        events = []
        for path in paths:
            for line in path.read_text().splitlines():
                with contextlib.suppress(json.JSONDecodeError):
                    events.append(json.loads(line))
        return cls.from_events(events)

    @classmethod
    def from_events(cls, events: Iterable[dict]) -> History:
        """The history of tests/fault_load.py's events (decoded lines)."""
        history = cls()
        for event in events:
            kind = event["event"]
            if kind == "sent":
                history.sent(event["id"], event["earliest_due_ms"])
            elif kind == "acked":
                history.acked(event["id"], event["due_ms"], duplicate=event["duplicate"])
            elif kind == "cancel":
                history.cancel(event["id"], event["outcome"])
            elif kind == "reschedule":
                history.reschedule(event["id"], event["outcome"], event["due_ms"])
            elif kind == "seen":
                history.seen(
                    Sighting(
                        event["id"],
                        event["seen_ms"],
                        dispatched_ms=event["dispatched_ms"],
                        due_ms=event["due_ms"],
                        position=(event["queue"], event["offset"]),
                        group=event["group"],
                        stored_ms=event["stored_ms"],
                        broker=event.get("broker", ""),
                    )
                )
            elif kind == "committed":
                history.committed(
                    event["group"],
                    event["queue"],
                    event["offset"],
                    event["ms"],
                    broker=event.get("broker", ""),
                )
        return history


@dataclass
class Report:
    acked: int
    duplicates: int  # of those, answered DUPLICATE (a retry of a send whose answer was lost)
    seen: int  # distinct ids any consumer received
    lost: list[str]
    early: list[str]
    twice: list[str]
    cancel_violated: list[str]
    redelivered: list[str]  # received again before a commit of them landed: allowed
    skew_ms: int

    @property
    def clean(self) -> bool:
        return not (self.lost or self.early or self.twice or self.cancel_violated)

    def summary(self) -> str:
        return (
            f"{self.acked} acknowledged ({self.duplicates} as DUPLICATE), {self.seen} seen; "
            f"lost {len(self.lost)}, "
            f"early {len(self.early)} (skew allowance {self.skew_ms} ms), "
            f"twice {len(self.twice)}, cancel violated {len(self.cancel_violated)}; "
            f"{len(self.redelivered)} redelivered before their commit landed"
        )

    def assert_clean(self) -> None:
        problems = [
            f"{kind}: {ids[:SHOWN_IDS]}"
            for kind, ids in (
                ("lost", self.lost),
                ("early", self.early),
                ("twice", self.twice),
                ("cancel violated", self.cancel_violated),
            )
            if ids
        ]
        assert not problems, self.summary() + "\n" + "\n".join(problems)


def check(history: History, *, due_by_ms: int, skew_ms: int = 0) -> Report:
    """Count what went wrong in ``history`` (the module's docstring defines each count).
    ``due_by_ms``: messages due by then must have been seen (the test waited for them)."""
    fates = history.fates
    by_id: dict[str, list[Sighting]] = defaultdict(list)
    for s in history.sightings:
        by_id[s.message_id].append(s)

    lost = [
        i
        for i, f in fates.items()
        if f.acked_due_ms is not None
        and not (f.cancelled or f.in_doubt)
        and (f.moves[-1] if f.moves else f.acked_due_ms) <= due_by_ms
        and i not in by_id
    ]
    early = []
    for i, sightings in by_id.items():
        for s in sightings:
            due = _earliest_due(fates.get(i), s)
            if due is not None and min(s.times) + skew_ms < due:
                early.append(i)
                break
    twice, redelivered = [], []
    for i, sightings in by_id.items():
        kind = _repeat(sightings, history.commits)
        if kind == "twice":
            twice.append(i)
        elif kind == "redelivered":
            redelivered.append(i)
    cancel_violated = [i for i, f in fates.items() if f.cancelled and i in by_id]
    return Report(
        acked=sum(1 for f in fates.values() if f.acked_due_ms is not None),
        duplicates=sum(1 for f in fates.values() if f.duplicate),
        seen=len(by_id),
        lost=sorted(lost),
        early=sorted(early),
        twice=sorted(twice),
        cancel_violated=sorted(cancel_violated),
        redelivered=sorted(redelivered),
        skew_ms=skew_ms,
    )


def _earliest_due(fate: _Fate | None, sighting: Sighting) -> int | None:
    """The earliest time the message may be delivered: the answered due time as
    moved by the last RESCHEDULED answer (or any unanswered reschedule), else the
    send's earliest due time; the message's own due time when nothing was recorded."""
    if fate is None or (fate.acked_due_ms is None and fate.earliest_due_ms is None):
        return sighting.due_ms
    answered = fate.acked_due_ms if fate.acked_due_ms is not None else fate.earliest_due_ms
    current = fate.moves[-1] if fate.moves else answered
    return min([current, *fate.unanswered_moves, *_first_attempt(fate, sighting)])


def _first_attempt(fate: _Fate, sighting: Sighting) -> list[int]:
    """The due time of the copy seen, when it is an earlier attempt's than the one
    answered: the client resends a send after a failover, and the first attempt, which
    reached the old leader and was cut from the group, may have gone out at its own due
    time, before the answered one. No attempt is due before the send's earliest."""
    if fate.moves or None in (sighting.due_ms, fate.earliest_due_ms, fate.acked_due_ms):
        return []
    if fate.earliest_due_ms <= sighting.due_ms < fate.acked_due_ms:
        return [sighting.due_ms]
    return []


def _repeat(
    sightings: list[Sighting], commits: dict[tuple[str, str, int], list[tuple[int, int]]]
) -> str | None:
    """ "twice", "redelivered" or None for one id's sightings (see the module's
    docstring)."""
    if len({(s.broker, s.position) for s in sightings if s.position is not None}) > 1:
        return "twice"
    repeated = False
    by_group: dict[str, list[Sighting]] = defaultdict(list)
    for s in sorted(sightings, key=lambda s: s.seen_ms):  # stable: one process's order stays
        by_group[s.group].append(s)
    for group_sightings in by_group.values():
        for n, later in enumerate(group_sightings[1:], start=1):
            repeated = True
            if _covered(later, group_sightings[:n], commits):
                return "twice"
    return "redelivered" if repeated else None


def _covered(
    later: Sighting,
    earlier: list[Sighting],
    commits: dict[tuple[str, str, int], list[tuple[int, int]]],
) -> bool:
    """Whether a commit covering ``later``'s copy had landed (at or before the ms it
    was seen): an earlier copy's own, or its group's commit of its queue through its
    offset or further."""
    if any(e.committed_ms is not None and e.committed_ms <= later.seen_ms for e in earlier):
        return True
    if later.position is None:
        return False
    queue, offset = later.position
    return any(
        through >= offset and landed_ms <= later.seen_ms
        for through, landed_ms in commits.get((later.broker, later.group, queue), ())
    )
