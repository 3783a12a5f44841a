"""How long a member may still act on its etcd lease: the step-down rule.

etcd expires a lease ``ttl`` after the last renewal it *received*. The member only knows
when it *sent* each renewal, and etcd cannot have received one before it was sent, so a
renewal sent at ``sent_ms`` and answered keeps the lease alive until at least ``sent_ms +
ttl_ms`` (on a clock running at the member's rate). A leader must stop acting before
another member can take over, which needs the lease expired in etcd, so the member trusts
its lease only until ``sent_ms + ttl_ms - margin_ms`` of its last answered renewal. The
margin covers the clock rates of two machines and the time it takes to act on stepping
down. The answer's arrival time is never used: a renewal answered late proves no more
than one answered at once.

Renewals go out every ``renew_every_ms`` (``ttl / 3``, as etcd's own clientv3 does),
so before the deadline a member has had two tries after the last success.

Pure logic: every call takes the caller's monotonic clock in milliseconds (STYLE.md #4).
"""

from __future__ import annotations

DEFAULT_LEASE_TTL_MS = 2000


def check_lease_ttl_ms(ttl_ms: int) -> int:
    """``ttl_ms`` if etcd can grant exactly that lease; else ValueError. etcd counts
    lease TTLs in whole seconds and its shortest lease is 1 s."""
    if ttl_ms < 1000 or ttl_ms % 1000:
        raise ValueError(
            f"lease_ttl_ms must be a whole number of seconds, at least 1000, got {ttl_ms} "
            "(etcd counts lease TTLs in seconds)"
        )
    return ttl_ms


def default_margin_ms(ttl_ms: int) -> int:
    """A quarter of the TTL: with renewals every ttl/3 a leader steps down after two
    renewals in a row went unanswered."""
    return ttl_ms // 4


class LeaseGuard:
    """The trust a member may put in its lease; see the module docstring.

    Until ``granted`` the lease is not trusted. ``renewed`` moves the deadline forward,
    never back (answers can arrive out of order). ``lost`` ends the trust for good: a
    lease etcd no longer knows never comes back.
    """

    def __init__(self, ttl_ms: int, margin_ms: int | None = None) -> None:
        """Raises ValueError unless ``ttl_ms >= 3`` and ``0 < margin_ms < ttl - ttl/3``
        (the deadline must leave room for one renewal after the last success)."""
        if ttl_ms < 3:
            raise ValueError(f"lease ttl must be at least 3 ms, got {ttl_ms}")
        self.ttl_ms = ttl_ms
        self.renew_every_ms = ttl_ms // 3
        self.margin_ms = default_margin_ms(ttl_ms) if margin_ms is None else margin_ms
        if not 0 < self.margin_ms < ttl_ms - self.renew_every_ms:
            raise ValueError(
                f"step-down margin must be between 0 and {ttl_ms - self.renew_every_ms} ms "
                f"(the lease ttl minus the renewal interval), got {self.margin_ms}"
            )
        self._trusted_until_ms: int | None = None
        self._renewed_at_ms: int | None = None
        self._lost = False

    def __repr__(self) -> str:
        return (
            f"<LeaseGuard ttl={self.ttl_ms}ms margin={self.margin_ms}ms "
            f"until={self._trusted_until_ms} lost={self._lost}>"
        )

    def granted(self, sent_ms: int) -> None:
        """The grant request sent at ``sent_ms`` was answered."""
        self.renewed(sent_ms)

    def renewed(self, sent_ms: int) -> None:
        """A renewal sent at ``sent_ms`` was answered: the lease was alive then."""
        if self._lost:
            return
        until = sent_ms + self.ttl_ms - self.margin_ms
        if self._trusted_until_ms is None or until > self._trusted_until_ms:
            self._trusted_until_ms = until
            self._renewed_at_ms = sent_ms

    def lost(self) -> None:
        """etcd said the lease is gone (expired or revoked)."""
        self._lost = True
        self._trusted_until_ms = None

    @property
    def trusted_until_ms(self) -> int | None:
        """The first instant the lease is no longer trusted; None before the grant or
        once lost."""
        return self._trusted_until_ms

    @property
    def renewed_at_ms(self) -> int | None:
        """When the newest answered renewal (or the grant) was sent; None before the
        grant. Kept once lost, to say how long ago the lease was last known alive."""
        return self._renewed_at_ms

    def trusted(self, now_ms: int) -> bool:
        """Whether the member may still act on its lease at ``now_ms``."""
        return self._trusted_until_ms is not None and now_ms < self._trusted_until_ms
