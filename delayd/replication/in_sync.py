"""The in-sync set and the acknowledged offsets (pure: time is ``now_ms``, passed in).

A follower is *in sync* when it has durable everything the leader had ``lag_ms`` ago
(Kafka's replica.lag.time.max.ms, KIP-16): for every stream, its durable end is at
least where the leader's stream ended at ``now - lag_ms``. The tracker keeps the
leader's growth of the last ``lag_ms`` per stream, as events ``(time_ms, end)`` in time
order, and folds older ones into ``horizon``, the leader's ends at ``now - lag_ms``.
A stream's ends only grow while one leader leads, so the events a follower lacks are a
tail of each stream's: ``next_change_ms`` walks those tails from the newest, which costs
what the follower lacks, not the whole window of growth (it runs at every report and
every growth, thousands of times a second under load).

The set that counts for acknowledgements, ``members``, changes only through
``apply``: the leader computes ``proposed(now)``, persists it (etcd) and then applies
it, so a follower leaves the ack rule only once the group knows it may no longer
campaign. With ``ack = "sync"`` a stream's acknowledged offset is the least durable
end among the leader and every follower of ``members``, and only while ``members``
has at least ``min_in_sync`` followers; it never moves back.
"""

from __future__ import annotations

from collections import deque


class InSyncTracker:
    def __init__(self, lag_ms: int, min_in_sync: int, leader_ends: dict[str, int]) -> None:
        """``leader_ends``: the leader's streams when it began tracking.
        They are the first horizon, so a follower that lacks any of them (an empty one,
        its disk wiped) is not in sync before it has them."""
        if lag_ms <= 0:
            raise ValueError(f"replica_lag_ms must be positive, got {lag_ms}")
        if min_in_sync < 0:
            raise ValueError(f"min_in_sync must be 0 or more, got {min_in_sync}")
        self.lag_ms = lag_ms
        self.min_in_sync = min_in_sync
        self.horizon = dict(leader_ends)  # the leader's ends at now - lag_ms (or start)
        self._growth: dict[str, deque[tuple[int, int]]] = {}  # stream -> growth since
        self.durable: dict[str, dict[str, int]] = {}  # member -> stream -> durable end
        self.members: frozenset[str] = frozenset()  # the set the ack rule uses
        # Until then a member of ``members`` that has not reported yet stays in sync:
        # a new leader starts with the set the group persisted, whose followers need a
        # moment to connect to it.
        self.grace_until_ms = -1
        self.acked: dict[str, int] = {}

    # ------------------------------------------------------------------ inputs

    def leader_grew(self, stream: str, end: int, now_ms: int) -> None:
        """The leader's ``stream`` now ends at ``end``."""
        events = self._growth.get(stream)
        if events is None:
            events = self._growth[stream] = deque()
        events.append((now_ms, end))

    def leader_removed(self, stream: str) -> None:
        """The leader deleted ``stream`` (superseded by a newer one): no follower needs
        it to be in sync."""
        self.horizon.pop(stream, None)
        self._growth.pop(stream, None)

    def follower_durable(self, member: str, offsets: dict[str, int]) -> None:
        """``member`` reports these streams durable up to these offsets (a report
        never lowers what an earlier one said: a DURABLE frame may be late)."""
        known = self.durable.setdefault(member, {})
        for stream, offset in offsets.items():
            if offset > known.get(stream, -1):
                known[stream] = offset

    def follower_reset(self, member: str, ends: dict[str, int]) -> None:
        """``member`` (re)connected and truncated to ``ends``: what it has now."""
        self.durable[member] = dict(ends)

    def apply(self, members: frozenset[str]) -> None:
        """Make ``members`` the set the ack rule uses (after it was persisted)."""
        self.members = frozenset(members)

    def start(self, members: frozenset[str], now_ms: int) -> None:
        """Begin with the set the group persisted: its followers count for acks at
        once, and one that has not reported keeps its place for ``lag_ms``."""
        self.apply(members)
        self.grace_until_ms = now_ms + self.lag_ms

    # ------------------------------------------------------------------ outputs

    def proposed(self, now_ms: int) -> frozenset[str]:
        """The followers in sync at ``now_ms``."""
        self._fold(now_ms)
        in_sync = {
            member
            for member, durable in self.durable.items()
            if all(durable.get(stream, 0) >= end for stream, end in self.horizon.items())
        }
        if now_ms < self.grace_until_ms:
            in_sync.update(member for member in self.members if member not in self.durable)
        return frozenset(in_sync)

    def next_change_ms(self, now_ms: int) -> int | None:
        """When a follower of ``members`` that is in sync now falls out of sync if it
        reports nothing more: the time of the first growth it lacks, plus ``lag_ms``.
        None when none would."""
        self._fold(now_ms)
        soonest = None if now_ms >= self.grace_until_ms else self.grace_until_ms
        for member in self.members:
            lacked_since = self._lacks_since(self.durable.get(member, {}))
            if lacked_since is not None:
                due = lacked_since + self.lag_ms
                soonest = due if soonest is None else min(soonest, due)
        return soonest

    def _lacks_since(self, durable: dict[str, int]) -> int | None:
        """When the leader first had a record a follower durable up to ``durable``
        lacks, within the window (None when it lacks none): the oldest event of each
        stream's tail it lacks."""
        since = None
        for stream, events in self._growth.items():
            held = durable.get(stream, 0)
            oldest = None
            for time_ms, end in reversed(events):
                if held >= end:
                    break
                oldest = time_ms
            if oldest is not None and (since is None or oldest < since):
                since = oldest
        return since

    def acknowledged(self, stream: str, leader_durable: int) -> int:
        """The acknowledged offset of ``stream`` under the sync rule, given the leader's
        durable end of it: moves only while ``members`` has ``min_in_sync`` followers."""
        previous = self.acked.get(stream, 0)
        if len(self.members) < self.min_in_sync:
            return previous
        offset = leader_durable
        for member in self.members:
            offset = min(offset, self.durable.get(member, {}).get(stream, 0))
        if offset > previous:
            self.acked[stream] = offset
            return offset
        return previous

    def lag_bytes(self, member: str, leader_ends: dict[str, int]) -> int:
        """How many bytes of the leader's streams ``member`` lacks durable."""
        durable = self.durable.get(member, {})
        return sum(max(0, end - durable.get(stream, 0)) for stream, end in leader_ends.items())

    def _fold(self, now_ms: int) -> None:
        horizon_ms = now_ms - self.lag_ms
        for stream, events in self._growth.items():
            while events and events[0][0] <= horizon_ms:
                self.horizon[stream] = events.popleft()[1]
