"""The step-down rule: LeaseGuard (pure) and keep_lease on trio's virtual clock."""

from __future__ import annotations

import re

import pytest
import trio

from delayd.cluster.etcd import GRPC_NOT_FOUND
from delayd.cluster.lease import keep_lease, now_ms
from delayd.cluster.lease_guard import LeaseGuard
from delayd.errors import EtcdError, EtcdUnavailable

TTL_MS = 2000
MARGIN_MS = 500
INTERVAL_MS = TTL_MS // 3  # 666


def test_trusted_until_the_last_renewal_sent_plus_ttl_minus_margin():
    guard = LeaseGuard(TTL_MS, MARGIN_MS)
    assert not guard.trusted(0)  # not granted yet
    guard.granted(100)
    assert guard.trusted_until_ms == 100 + TTL_MS - MARGIN_MS
    assert guard.trusted(1599)
    assert not guard.trusted(1600)
    guard.renewed(700)
    assert guard.trusted(2199)
    assert not guard.trusted(2200)


def test_a_late_answer_to_an_older_renewal_does_not_move_the_deadline_back():
    guard = LeaseGuard(TTL_MS, MARGIN_MS)
    guard.granted(0)
    guard.renewed(1300)
    guard.renewed(666)  # sent before the one above, answered after it
    assert guard.trusted_until_ms == 1300 + TTL_MS - MARGIN_MS


def test_a_lost_lease_is_never_trusted_again():
    guard = LeaseGuard(TTL_MS, MARGIN_MS)
    guard.granted(0)
    guard.lost()
    assert not guard.trusted(1)
    guard.renewed(10)
    assert guard.trusted_until_ms is None
    assert not guard.trusted(11)


def test_defaults_and_bad_margins():
    guard = LeaseGuard(TTL_MS)
    assert (guard.margin_ms, guard.renew_every_ms) == (500, 666)
    for margin in (0, -1, TTL_MS - INTERVAL_MS, TTL_MS):
        with pytest.raises(ValueError, match="step-down margin must be between 0 and 1334 ms"):
            LeaseGuard(TTL_MS, margin)
    with pytest.raises(ValueError, match="at least 3 ms"):
        LeaseGuard(2)


def granted_guard() -> tuple[LeaseGuard, int]:
    guard = LeaseGuard(TTL_MS, MARGIN_MS)
    start = now_ms()
    guard.granted(start)
    return guard, start


class Renewals:
    """A renew() that answers the first ``answered`` calls (after ``delay_s``), then
    does what ``then`` says: hang, raise EtcdUnavailable, or raise NOT_FOUND."""

    def __init__(self, answered: int, then: str, delay_s: float = 0.0) -> None:
        self.answered = answered
        self.then = then
        self.delay_s = delay_s
        self.sent_ms: list[int] = []

    async def __call__(self) -> None:
        self.sent_ms.append(now_ms())
        if len(self.sent_ms) <= self.answered:
            await trio.sleep(self.delay_s)
            return
        if self.then == "unavailable":
            raise EtcdUnavailable("etcd lease keepalive: no endpoint reachable")
        if self.then == "not found":
            raise EtcdError("lease not found", code=GRPC_NOT_FOUND)
        await trio.sleep_forever()


async def test_steps_down_at_the_deadline_of_the_last_answered_renewal(autojump_clock):
    guard, start = granted_guard()
    renew = Renewals(answered=3, then="hang")
    reason = await keep_lease(guard, renew)
    assert [t - start for t in renew.sent_ms[:4]] == [666, 1332, 1998, 2664]
    assert now_ms() - start == 1998 + TTL_MS - MARGIN_MS
    assert "no lease renewal answered for 1500 ms" in reason
    assert not guard.trusted(now_ms())


async def test_failed_renewals_count_as_missed(autojump_clock):
    guard, start = granted_guard()
    renew = Renewals(answered=1, then="unavailable")
    await keep_lease(guard, renew)
    assert now_ms() - start == 666 + TTL_MS - MARGIN_MS
    assert len(renew.sent_ms) == 3  # two retries after the last success, both failed


async def test_the_deadline_counts_from_when_a_renewal_was_sent_not_answered(autojump_clock):
    guard, start = granted_guard()
    renew = Renewals(answered=1, then="hang", delay_s=0.6)  # answered 600 ms after sending
    await keep_lease(guard, renew)
    assert now_ms() - start == 666 + TTL_MS - MARGIN_MS


async def test_a_lease_etcd_no_longer_knows_ends_at_once(autojump_clock):
    guard, start = granted_guard()
    reason = await keep_lease(guard, Renewals(answered=2, then="not found"))
    assert now_ms() - start == 3 * INTERVAL_MS
    assert "etcd no longer knows the lease" in reason
    assert guard.trusted_until_ms is None


async def test_a_lease_renewed_in_time_is_kept_for_ever(autojump_clock):
    guard, _ = granted_guard()
    renew = Renewals(answered=10**9, then="hang", delay_s=0.5)
    with trio.move_on_after(3600) as scope:
        await keep_lease(guard, renew)
    assert scope.cancelled_caught
    assert guard.trusted(now_ms())
    assert len(renew.sent_ms) == 3600_000 // INTERVAL_MS


async def test_other_etcd_errors_propagate(autojump_clock):
    guard, _ = granted_guard()

    async def refused() -> None:
        raise EtcdError("etcdserver: permission denied", code=7)

    with pytest.RaisesGroup(pytest.RaisesExc(EtcdError, match="permission denied")):
        await keep_lease(guard, refused)


async def test_a_member_slow_to_start_renewing_renews_at_once(autojump_clock):
    """Registering took longer than the renewals' slack: the first renewal is due an
    interval after the grant was sent, not after keep_lease started."""
    guard, start = granted_guard()
    await trio.sleep(1.0)  # the grant answered, the registration slow
    renew = Renewals(answered=10**9, then="hang", delay_s=0.1)
    with trio.move_on_after(60) as scope:
        await keep_lease(guard, renew)
    assert scope.cancelled_caught, "stepped down though every renewal was answered"
    assert renew.sent_ms[0] - start == 1000
    assert guard.trusted(now_ms())


async def test_a_renewal_answered_after_the_next_was_sent_still_counts(autojump_clock):
    """Renewals answered 800 ms after sending (more than the 666 ms between two): each
    still proves the lease alive when it was sent, in time for the deadline."""
    guard, _ = granted_guard()
    renew = Renewals(answered=10**9, then="hang", delay_s=0.8)
    with trio.move_on_after(60) as scope:
        await keep_lease(guard, renew)
    assert scope.cancelled_caught, "stepped down though every renewal was answered"
    assert guard.trusted(now_ms())


async def test_a_step_down_says_what_became_of_the_renewals(autojump_clock):
    guard, _ = granted_guard()
    hung = await keep_lease(guard, Renewals(answered=3, then="hang"))
    assert "(since the newest answered one: 2 unanswered, the oldest sent 834 ms ago)" in hung

    guard, _ = granted_guard()
    failed = await keep_lease(guard, Renewals(answered=1, then="unavailable"))
    assert "2 failed, the last: etcd lease keepalive: no endpoint reachable" in failed

    guard, _ = granted_guard()
    gone = await keep_lease(guard, Renewals(answered=2, then="not found"))
    assert "the newest renewal it answered was sent 666 ms ago, the lease's ttl is 2000" in gone


async def test_a_step_down_after_the_process_stalled_says_so(autojump_clock):
    """The event loop runs nothing past the deadline (a stall, or a machine short of
    CPU): the step-down says how late it ran, not just that nothing was answered."""
    guard, _ = granted_guard()

    async def stall() -> None:
        await trio.sleep(0.1)
        autojump_clock.jump(2.0)  # no task runs while the clock moves 2 s

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stall)
        reason = await keep_lease(guard, Renewals(answered=10**9, then="hang"))
    assert "no lease renewal answered for 1500 ms" in reason
    assert re.search(r"this process ran up to \d{3,4} ms late", reason), reason
