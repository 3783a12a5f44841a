"""Keep a lease alive, and say when it can no longer be trusted (the trio side of
delayd.cluster.lease_guard)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from delayd.cluster.etcd import GRPC_NOT_FOUND
from delayd.cluster.lease_guard import LeaseGuard
from delayd.errors import EtcdError, EtcdUnavailable

log = logging.getLogger(__name__)

# A step-down says how late this process ran (a timer firing, a renewal going out) when
# it ran at least this late: below it, lateness is the scheduler's ordinary jitter.
LATE_MS = 50


def now_ms() -> int:
    """trio's clock in milliseconds (virtual under autojump_clock)."""
    return int(trio.current_time() * 1000)


class _Unanswered:
    """The renewals sent since the newest answered one, and how late this process ran
    meanwhile: what a step-down says about why no renewal was answered in time."""

    def __init__(self) -> None:
        self.failures: dict[int, str] = {}  # by when it was sent: why it failed
        self.waiting: set[int] = set()  # when each renewal still unanswered was sent
        self.late_ms = 0

    def sent(self, sent_ms: int, late_ms: int) -> None:
        self.waiting.add(sent_ms)
        self.ran_late(late_ms)

    def ran_late(self, late_ms: int) -> None:
        self.late_ms = max(self.late_ms, late_ms)

    def failed(self, sent_ms: int, problem: str) -> None:
        self.waiting.discard(sent_ms)
        if not self.failures:
            log.warning("lease renewal failed, retrying: %s", problem)
        self.failures[sent_ms] = problem

    def answered(self, sent_ms: int) -> None:
        """A renewal sent at ``sent_ms`` was answered: those sent before it no longer
        matter."""
        self.waiting.discard(sent_ms)
        if self.failures and max(self.failures) < sent_ms:
            log.info("lease renewed again after %d failed renewals", len(self.failures))
        self.failures = {t: p for t, p in self.failures.items() if t > sent_ms}
        self.waiting = {t for t in self.waiting if t > sent_ms}
        if not self.failures and not self.waiting:
            self.late_ms = 0

    def describe(self, now: int) -> str:
        """What happened since the newest answered renewal, as clauses of one sentence."""
        said = []
        if not self.failures and not self.waiting:
            said.append("none sent")
        if self.failures:
            last = self.failures[max(self.failures)]
            said.append(f"{len(self.failures)} failed, the last: {last}")
        if self.waiting:
            said.append(
                f"{len(self.waiting)} unanswered, the oldest sent {now - min(self.waiting)} ms ago"
            )
        if self.late_ms >= LATE_MS:
            said.append(
                f"this process ran up to {self.late_ms} ms late (its event loop busy, or "
                "the machine short of CPU)"
            )
        return "; ".join(said)


async def keep_lease(guard: LeaseGuard, renew: Callable[[], Awaitable[object]]) -> str:
    """Call ``renew()`` every ``guard.renew_every_ms`` until the lease is no longer
    trusted, and return why. The guard must have been granted.

    The first renewal is due ``renew_every_ms`` after the grant was sent (at once if
    that has passed: a slow registration must not eat the time the renewals have), each
    next one ``renew_every_ms`` after the one before went out. A renewal does not wait
    for the one before it to be answered: one answered late still proves the lease
    alive when it was sent (LeaseGuard). Returns at ``guard.trusted_until_ms`` of the
    newest answered renewal, saying what became of the renewals sent since, or as soon
    as ``renew`` raises EtcdError with code NOT_FOUND (etcd no longer knows the lease).
    ``renew`` raising EtcdUnavailable is a missed renewal; any other error propagates.
    """
    started_ms = now_ms()
    unanswered = _Unanswered()
    reason = ""
    async with trio.open_nursery() as nursery:

        async def renewal(sent_ms: int) -> None:
            nonlocal reason
            try:
                await renew()
            except EtcdUnavailable as exc:
                unanswered.failed(sent_ms, str(exc))
                return
            except EtcdError as exc:
                if exc.code != GRPC_NOT_FOUND:
                    raise
                renewed_at_ms = guard.renewed_at_ms
                guard.lost()
                reason = f"etcd no longer knows the lease ({exc})"
                if renewed_at_ms is not None:
                    reason += (
                        f"; the newest renewal it answered was sent {now_ms() - renewed_at_ms}"
                        f" ms ago, the lease's ttl is {guard.ttl_ms} ms"
                    )
                nursery.cancel_scope.cancel()
                return
            unanswered.answered(sent_ms)
            guard.renewed(sent_ms)

        async def renewals() -> None:
            assert guard.renewed_at_ms is not None, "keep_lease needs a granted lease"
            due_ms = guard.renewed_at_ms + guard.renew_every_ms
            while True:
                await trio.sleep_until(due_ms / 1000)
                sent_ms = now_ms()
                unanswered.sent(sent_ms, late_ms=sent_ms - max(due_ms, started_ms))
                nursery.start_soon(renewal, sent_ms)
                due_ms = sent_ms + guard.renew_every_ms

        nursery.start_soon(renewals)
        until = guard.trusted_until_ms
        while until is not None:
            await trio.sleep_until(until / 1000)
            if guard.trusted_until_ms == until:  # no renewal moved it while we slept
                break
            until = guard.trusted_until_ms
        if not reason:
            now = now_ms()
            if until is not None:
                unanswered.ran_late(now - until)
            reason = (
                f"no lease renewal answered for {guard.ttl_ms - guard.margin_ms} ms (since the "
                f"newest answered one: {unanswered.describe(now)}); the lease may expire in "
                f"{guard.margin_ms} ms"
            )
        nursery.cancel_scope.cancel()
    return reason
