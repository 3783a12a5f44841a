"""Route sets: the broker groups (and weights) a bucket's sends are routed over, as its
dispatch_log records them (ROUTE entries; docs/cluster.md, "A resend after a failover").

Weighted rendezvous hashing (delayd.sender.routing) depends on nothing but the key and
the (name, weight) pairs, so a set recorded once tells every later reader — this
process after a restart, a follower promoted to lead — which group a message of the
bucket went to when it went to the set's first choice. Sets are few (one per change of
the broker groups): they are interned, so that "routed over the bucket's set" is an
identity test per message, and each has its router built once.
"""

from __future__ import annotations

from collections.abc import Iterable

from delayd.logs.dispatch_log import RouteSet
from delayd.sender.routing import GroupWeight, Router


def route_set_of(groups: Iterable[tuple[str, int]]) -> RouteSet:
    """The route set of (name, weight) pairs: sorted by name, so that equal sets are
    equal tuples whatever order the groups were added in."""
    return tuple(sorted(groups))


def _always(_name: str) -> bool:
    return True


class RouteSets:
    """Interned route sets and their routers."""

    def __init__(self) -> None:
        self._routers: dict[RouteSet, tuple[RouteSet, Router]] = {}

    def intern(self, route_set: RouteSet) -> RouteSet:
        """The one tuple equal to ``route_set`` that this object hands out."""
        known = self._routers.get(route_set)
        if known is None:
            router = Router([GroupWeight(name, weight) for name, weight in route_set])
            known = self._routers[route_set] = (route_set, router)
        return known[0]

    def first_choice(self, route_set: RouteSet, key: str) -> str | None:
        """The group of ``route_set`` that rendezvous hashing gives ``key`` when every
        group takes it (None for the empty set)."""
        self.intern(route_set)
        return self._routers[route_set][1].choose(key, _always)
