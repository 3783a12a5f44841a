"""Jittered, capped exponential back-off between reconnection attempts.

Delays grow as ``initial_s * multiplier**attempt`` up to ``max_s``, and each is drawn
uniformly from the upper half of that value ("equal jitter", as in the AWS architecture
blog's comparison): the jitter spreads out clients that all lost the same broker at the
same instant, and the lower bound keeps a client from hammering a broker that is still
starting. The randomness is injected so tests can pin the schedule.

A reconnecting session records each failure with ``failed(now_s)`` and asks
``wait_s(now_s)`` before its next attempt: the delay runs from the failure, not from
the call that waits, so time a caller spent elsewhere (between two ``receive(timeout_s=1)``
calls, say) counts towards it. Sleeping a fresh delay at the start of every call would
fail: once the delay grew past a caller's time-out, every call would run out of time
inside the sleep — or give up before it — and the client would never try again.
"""

from __future__ import annotations

import math
import random as _random
from collections.abc import Callable


class Backoff:
    """The delays, in seconds, before successive retries; ``reset()`` after a success.

    ``rand`` returns a float in [0, 1) (default ``random.random``).
    """

    def __init__(
        self,
        *,
        initial_s: float = 0.05,
        max_s: float = 2.0,
        multiplier: float = 2.0,
        rand: Callable[[], float] = _random.random,
    ) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError(f"need 0 < initial_s <= max_s, got {initial_s} and {max_s}")
        if multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {multiplier}")
        self.initial_s = initial_s
        self.max_s = max_s
        self.multiplier = multiplier
        self._rand = rand
        self.attempt = 0  # failures since the last reset
        self.retry_at_s = -math.inf  # no attempt before this time (the caller's clock)

    def next_delay(self) -> float:
        """The delay before the next attempt, in seconds; advances the schedule."""
        # Cap the exponent too, so a client retrying for days never overflows a float.
        ceiling = min(self.max_s, self.initial_s * self.multiplier ** min(self.attempt, 64))
        self.attempt += 1
        return ceiling * (0.5 + 0.5 * self._rand())

    def failed(self, now_s: float) -> None:
        """An attempt failed at ``now_s``: the next may start one delay later."""
        self.retry_at_s = now_s + self.next_delay()

    def wait_s(self, now_s: float) -> float:
        """Seconds from ``now_s`` until the next attempt may start (0: at once)."""
        return max(0.0, self.retry_at_s - now_s)

    def reset(self) -> None:
        """Start again from ``initial_s`` (call after a successful connection)."""
        self.attempt = 0
        self.retry_at_s = -math.inf
