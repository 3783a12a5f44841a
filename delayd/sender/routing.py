"""Which broker group a due message goes to.

A message with a key goes where every other message of its key goes, so that they stay
in one group (and, inside it, in one queue: delayd.broker.routing) and are consumed in
order. The choice is weighted rendezvous hashing — highest random weight (Thaler and
Ravishankar, 1998) with Schindelhauer and Schomaker's weighting ("Weighted Distributed
Hash Tables", 2005): each candidate group scores ``-weight / ln(u)``, ``u`` a hash of
(key, group name) mapped into (0, 1), and the highest score wins. A group gets a share
of the keys proportional to its weight, and when it becomes unusable only its own keys
move (each to its second-highest score), while the other keys stay put — no ring, no
virtual nodes, no state shared between delay servers beyond the configuration.

A message without a key goes to a weighted random choice among the candidates.

Pure logic: health comes in as ``usable(name)`` (the caller's circuit breakers), and
retries name the groups that already failed in ``exclude``.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import xxhash

_U_BITS = 53  # a float holds 53 bits exactly: u = (h + 0.5) / 2**53 is strictly in (0, 1)
_U_SCALE = 1.0 / (1 << _U_BITS)


@dataclass(frozen=True, slots=True)
class GroupWeight:
    """A broker group's name and its weight (share of traffic, an integer >= 1)."""

    name: str
    weight: int


class Router:
    """Chooses a group per message; see the module docstring.

    ``seed`` fixes the random choices of messages without a key (tests, benchmarks);
    keyed choices do not depend on it, nor on the process: every delay server with the
    same configuration sends a key to the same group. With no group every choice is
    None (groups found in etcd may not be known yet). Raises ValueError when
    ``groups`` names a group twice or has a weight below 1.
    """

    def __init__(self, groups: Sequence[GroupWeight], *, seed: int | None = None) -> None:
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            twice = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"broker group names must be unique; given twice: {twice}")
        for g in groups:
            if not isinstance(g.weight, int) or g.weight < 1:
                raise ValueError(f"broker group {g.name!r}: weight must be an integer >= 1")
        self.groups = tuple(groups)
        self._names = tuple(names)
        self._weights = tuple(g.weight for g in groups)
        # xxh64(key, seed=xxh64(name)) is a hash of the pair without building
        # key + name for every group of every message.
        self._seeds = tuple(xxhash.xxh64_intdigest(n.encode()) for n in names)
        self._cumulative = tuple(_cumulative(self._weights))
        self._random = random.Random(seed)

    def choose(
        self, key: str | None, usable: Callable[[str], bool], exclude: Collection[str] = ()
    ) -> str | None:
        """The group for a message with ``key`` (None: no key), among the groups with
        ``usable(name)`` true and not in ``exclude``; None when there is none."""
        names = self._names
        if len(names) == 1:  # the embedded broker, say: per message, so no list built
            only = names[0]
            return only if only not in exclude and usable(only) else None
        candidates = [i for i, n in enumerate(names) if n not in exclude and usable(n)]
        if len(candidates) <= 1:
            return names[candidates[0]] if candidates else None
        if key is not None:
            return names[self._highest_score(key, candidates)]
        if len(candidates) == len(names):
            cumulative = self._cumulative
        else:
            cumulative = _cumulative(self._weights[i] for i in candidates)
        draw = self._random.random() * cumulative[-1]
        return names[candidates[bisect.bisect_right(cumulative, draw)]]

    def _highest_score(self, key: str, candidates: list[int]) -> int:
        data = key.encode()
        hash64, log, seeds, weights = xxhash.xxh64_intdigest, math.log, self._seeds, self._weights
        best, best_score = candidates[0], -1.0
        for i in candidates:
            u = ((hash64(data, seeds[i]) >> (64 - _U_BITS)) + 0.5) * _U_SCALE
            score = -weights[i] / log(u)  # log(u) < 0: every score is positive
            if score > best_score:
                best, best_score = i, score
        return best


def _cumulative(weights) -> list[int]:
    total, out = 0, []
    for w in weights:
        total += w
        out.append(total)
    return out
