"""A circuit breaker per broker group: stop sending to a group that keeps failing.

The states are those of Hystrix and resilience4j. CLOSED lets every batch through and
counts consecutive failures; at ``failure_threshold`` the circuit opens. OPEN lets
nothing through for the open time; after it the circuit is HALF_OPEN and lets exactly
one batch through, the probe. A successful probe closes the circuit; a failed one opens
it again for twice as long (up to ``max_open_ms``), so a group that stays dead costs one
probe per ``max_open_ms`` instead of one per ``open_ms``.

Pure logic: the caller passes ``now_ms`` (a monotonic clock in milliseconds, STYLE.md
#4) and reports the outcome of every batch it was allowed to send.
"""

from __future__ import annotations

import enum


class CircuitState(enum.IntEnum):
    """Ordered by how much traffic gets through (a gauge can export the value)."""

    CLOSED = 0  # every call goes through
    HALF_OPEN = 1  # the open time has passed: one probe goes through
    OPEN = 2  # nothing goes through until the open time has passed


class CircuitBreaker:
    """The circuit of one broker group; see the module docstring.

    Every ``allow(now_ms)`` that returned True must be followed by exactly one
    ``record_success`` or ``record_failure`` — a probe whose outcome is never reported
    keeps the circuit half-open with its probe out, refusing every call (report a
    cancelled call as a failure). Outcomes of calls made while the circuit was closed
    may arrive after it opened: a late failure only adds to ``consecutive_failures``
    (but one that arrives while the probe is out counts as the probe's: outcomes carry
    no identity), and a late success closes the circuit, since the group has just
    answered.

    ``consecutive_failures`` and ``opened_total`` (every change to OPEN, re-openings
    after a failed probe included) are for metrics; ``probe_in_flight`` tells a router
    that a half-open group will refuse calls until its probe is answered.
    """

    def __init__(
        self, *, failure_threshold: int = 5, open_ms: int = 1000, max_open_ms: int = 30_000
    ) -> None:
        """Raises ValueError unless ``failure_threshold >= 1`` and
        ``0 < open_ms <= max_open_ms`` (milliseconds)."""
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be at least 1, got {failure_threshold}")
        if not 0 < open_ms <= max_open_ms:
            raise ValueError(
                f"need 0 < open_ms <= max_open_ms (milliseconds), got {open_ms} and {max_open_ms}"
            )
        self.failure_threshold = failure_threshold
        self.base_open_ms = open_ms
        self.max_open_ms = max_open_ms
        self.consecutive_failures = 0
        self.opened_total = 0
        self.probe_in_flight = False
        # While open (and half-open): opened at _opened_ms for _open_ms. None: closed.
        self._opened_ms: int | None = None
        self._open_ms = open_ms

    def __repr__(self) -> str:
        return (
            f"<CircuitBreaker failures={self.consecutive_failures} opened={self._opened_ms} "
            f"for={self._open_ms}ms probe={self.probe_in_flight}>"
        )

    @property
    def open_ms(self) -> int:
        """How long the circuit stays (or stayed) open this time, in milliseconds."""
        return self._open_ms

    def state(self, now_ms: int) -> CircuitState:
        """The state at ``now_ms``. HALF_OPEN once the open time has passed, whether or
        not the probe is out; reading the state never hands out the probe."""
        if self._opened_ms is None:
            return CircuitState.CLOSED
        if now_ms - self._opened_ms >= self._open_ms:
            return CircuitState.HALF_OPEN
        return CircuitState.OPEN

    def allow(self, now_ms: int) -> bool:
        """Whether a call may go to the group now. Closed: always. Open: no. Half-open:
        True exactly once (this call is the probe), then False until it is reported."""
        if self._opened_ms is None:
            return True
        if self.probe_in_flight or now_ms - self._opened_ms < self._open_ms:
            return False
        self.probe_in_flight = True
        return True

    def record_success(self, now_ms: int) -> None:
        """A call succeeded: close the circuit, forget the failures and the back-off."""
        self.consecutive_failures = 0
        self.probe_in_flight = False
        self._opened_ms = None
        self._open_ms = self.base_open_ms

    def record_failure(self, now_ms: int) -> None:
        """A call failed: count it; open at the threshold; a failed probe re-opens the
        circuit for twice the last open time, at most ``max_open_ms``."""
        self.consecutive_failures += 1
        if self.probe_in_flight:
            self.probe_in_flight = False
            self._open(now_ms, min(self.max_open_ms, self._open_ms * 2))
        elif self._opened_ms is None and self.consecutive_failures >= self.failure_threshold:
            self._open(now_ms, self.base_open_ms)

    def _open(self, now_ms: int, open_ms: int) -> None:
        self._opened_ms = now_ms
        self._open_ms = open_ms
        self.opened_total += 1
