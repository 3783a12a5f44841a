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


def now_ms() -> int:
    """trio's clock in milliseconds (virtual under autojump_clock)."""
    return int(trio.current_time() * 1000)


async def keep_lease(guard: LeaseGuard, renew: Callable[[], Awaitable[object]]) -> str:
    """Call ``renew()`` every ``guard.renew_every_ms`` until the lease is no longer
    trusted, and return why. The guard must have been granted.

    Returns at ``guard.trusted_until_ms`` of the last answered renewal (a renewal is
    given at most one interval to answer), or as soon as ``renew`` raises EtcdError
    with code NOT_FOUND (etcd no longer knows the lease). ``renew`` raising
    EtcdUnavailable is a missed renewal; any other error propagates.
    """
    reason = ""
    async with trio.open_nursery() as nursery:

        async def renewals() -> None:
            nonlocal reason
            interval_s = guard.renew_every_ms / 1000
            next_s = trio.current_time() + interval_s
            failed = 0
            while True:
                await trio.sleep_until(next_s)
                next_s += interval_s
                sent_ms = now_ms()
                answered, problem = False, f"no answer within {guard.renew_every_ms} ms"
                with trio.move_on_after(interval_s):
                    try:
                        await renew()
                        answered = True
                    except EtcdUnavailable as exc:
                        problem = str(exc)
                    except EtcdError as exc:
                        if exc.code != GRPC_NOT_FOUND:
                            raise
                        guard.lost()
                        reason = f"etcd no longer knows the lease ({exc})"
                        nursery.cancel_scope.cancel()
                        return
                if not answered:
                    failed += 1
                    if failed == 1:
                        log.warning("lease renewal failed, retrying: %s", problem)
                    continue
                if failed:
                    log.info("lease renewed again after %d failed renewals", failed)
                    failed = 0
                guard.renewed(sent_ms)

        nursery.start_soon(renewals)
        until = guard.trusted_until_ms
        while until is not None:
            await trio.sleep_until(until / 1000)
            if guard.trusted_until_ms == until:  # no renewal moved it while we slept
                break
            until = guard.trusted_until_ms
        if not reason:
            reason = (
                f"no lease renewal answered for {guard.ttl_ms - guard.margin_ms} ms; "
                f"the lease may expire in {guard.margin_ms} ms"
            )
        nursery.cancel_scope.cancel()
    return reason
