"""A fixed-bucket histogram cheap enough to observe every delivered message.

prometheus_client's Histogram takes a lock and walks its buckets in Python per
observation; the sender observes a whole batch at once here (bisect per value, no
lock: one trio thread), and the metrics collector exports the counts.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable


class Histogram:
    """Counts per upper bound (``le``), Prometheus-style, plus sum and count."""

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # last: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0

    def observe_many(self, values: Iterable[float]) -> None:
        bounds, counts = self.bounds, self.counts
        total = 0.0
        n = 0
        for value in values:
            counts[bisect_left(bounds, value)] += 1
            total += value
            n += 1
        self.sum += total
        self.count += n

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs, ending with ``+Inf``."""
        out, running = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append((repr(float(bound)), running))
        out.append(("+Inf", running + self.counts[-1]))
        return out

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the q-quantile (None when empty)."""
        if not self.count:
            return None
        rank = q * self.count
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            if running >= rank:
                return bound
        return float("inf")
