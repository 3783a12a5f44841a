"""A member of a group: registration, leader election and step-down, on etcd (trio).

``GroupMember.run()`` keeps one *session* at a time:

1. grant a lease (``lease_ttl_ms``) and register ``MemberInfo`` under the group's
   members key, on that lease;
2. renew the lease every ttl/3 (delayd.cluster.lease); when the lease can no longer be
   trusted the member steps down at once and the session ends;
3. campaign: if ``eligible()``, a txn creates the leader key on the lease unless it
   exists (``create_revision == 0``), else it reads the key; the revision that created
   the key is the leader's epoch. Then watch the key; when it is deleted (its lease
   expired or was revoked), campaign again.

A session ends when its lease is lost or no longer trusted; the member revokes that
lease (if etcd can still be reached) and starts a new session, and so a new epoch if it
leads again: a lease it stopped trusting is never used again. Cancelling ``run()`` is
the graceful stop: the member steps down and revokes its lease, which deletes the leader
key, so a follower's watch sees the delete and takes over within milliseconds.

Only the keys and the role are here; what a leader does with its role (accepting,
replicating) is the caller's, through ``on_change`` and ``may_lead()``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence

import trio

from delayd.cluster.etcd import (
    GRPC_NOT_FOUND,
    GRPC_OUT_OF_RANGE,
    Compare,
    EtcdClient,
    EventKind,
    Get,
    KeyValue,
    Put,
    RangeResult,
)
from delayd.cluster.in_sync import write_in_sync
from delayd.cluster.lease import keep_lease, now_ms
from delayd.cluster.lease_guard import DEFAULT_LEASE_TTL_MS, LeaseGuard, check_lease_ttl_ms
from delayd.cluster.members import (
    DEFAULT_PREFIX,
    NO_LEADER,
    GroupKeys,
    MemberInfo,
    Role,
    View,
    view_of,
)
from delayd.errors import EtcdError, EtcdUnavailable
from delayd.structured_logs import fields

log = logging.getLogger(__name__)

RETRY_MIN_S = 0.05  # after a failed etcd call or a lost session, doubling ...
RESIGN_TIMEOUT_S = 1.0  # how long a graceful stop waits for etcd to revoke the lease


class GroupMember:
    """One member of ``group``; see the module docstring.

    ``view`` (``role``, ``epoch``, ``leader``) is what the member knows now. Each change
    is logged, passed to ``on_change(previous, current, reason)`` (called in the member's
    task: keep it short, never block) and wakes ``wait_change()``.

    ``eligible()`` is asked before every campaign; a member that is not eligible only
    follows, and asks again when the leader key changes or every ttl/3 while there is
    no leader. ``campaign_compares()`` adds conditions to the campaign txn (the
    eligibility it was judged on still holds: delayd.cluster.in_sync); a campaign that
    fails on them is tried again as one while nobody leads. ``campaign_puts()`` adds
    writes that take effect only if the campaign wins (a new group's in-sync set, in the
    same txn as the leader key: no moment where a leader exists and the set does not).

    ``elections_won`` counts the campaigns this member won (for a metric).
    """

    def __init__(
        self,
        etcd: EtcdClient,
        group: str,
        info: MemberInfo,
        *,
        prefix: str = DEFAULT_PREFIX,
        lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS,
        step_down_margin_ms: int | None = None,
        eligible: Callable[[], bool] = lambda: True,
        campaign_compares: Callable[[], Sequence[Compare]] = lambda: (),
        campaign_puts: Callable[[], Sequence[Put]] = lambda: (),
        on_change: Callable[[View, View, str], None] | None = None,
    ) -> None:
        """Raises ValueError for a bad group name, prefix or lease TTL (see
        check_lease_ttl_ms), or a margin LeaseGuard refuses."""
        self.etcd = etcd
        self.keys = GroupKeys(prefix, group)
        self.info = info
        self.lease_ttl_ms = check_lease_ttl_ms(lease_ttl_ms)
        LeaseGuard(lease_ttl_ms, step_down_margin_ms)  # refuse a bad margin now, not later
        self.step_down_margin_ms = step_down_margin_ms
        self.eligible = eligible
        self.campaign_compares = campaign_compares
        self.campaign_puts = campaign_puts
        self.on_change = on_change
        self.view: View = NO_LEADER
        self.elections_won = 0
        self._changed = trio.Event()
        self._guard: LeaseGuard | None = None
        self._lease_id = 0

    def __repr__(self) -> str:
        return f"<GroupMember {self.keys.group}/{self.info.member_id} {self.view}>"

    @property
    def role(self) -> Role:
        return self.view.role

    @property
    def epoch(self) -> int | None:
        return self.view.epoch

    @property
    def leader(self) -> MemberInfo | None:
        return self.view.leader

    def may_lead(self) -> bool:
        """Whether the member may act as leader right now: it leads and its lease is still
        trusted. Ask before every acknowledgement: the step-down runs on time only if
        the event loop does, and this check does not depend on it."""
        guard = self._guard
        return self.view.role is Role.LEADER and guard is not None and guard.trusted(now_ms())

    async def set_in_sync(self, members: Iterable[str]) -> bool:
        """As the leader, set the group's in-sync set (the members that may lead next) to
        ``members``. Fenced: written only while the leader key is still the one this
        member created at its epoch. Returns whether it was written (False: this member
        does not lead, or no longer does). Raises ValueError for a bad member id,
        EtcdUnavailable when etcd cannot be reached (the outcome may be unknown)."""
        epoch = self.epoch
        if self.role is not Role.LEADER or epoch is None:
            return False
        return await write_in_sync(self.etcd, self.keys, epoch, members)

    async def wait_change(self) -> View:
        """Wait for the next change of view and return the new view."""
        await self._changed.wait()
        return self.view

    def _set_view(self, view: View, reason: str) -> bool:
        """Take ``view``, logging why; returns whether the view changed."""
        previous = self.view
        if view == previous:
            return False
        self.view = view
        leader = view.leader.member_id if view.leader else "unknown"
        log_level = logging.INFO if view.role != previous.role else logging.DEBUG
        log.log(
            log_level,
            "group %s member %s: %s -> %s, epoch %s, leader %s: %s",
            self.keys.group,
            self.info.member_id,
            previous.role.name.lower(),
            view.role.name.lower(),
            view.epoch,
            leader,
            reason,
            extra=fields(
                group=self.keys.group,
                member=self.info.member_id,
                role=view.role.name.lower(),
                previous_role=previous.role.name.lower(),
                epoch=view.epoch,
                leader=leader,
            ),
        )
        if self.on_change is not None:
            self.on_change(previous, view, reason)
        self._changed.set()
        self._changed = trio.Event()
        return True

    def _leave(self, lease_id: int, reason: str) -> None:
        """The session on ``lease_id`` is over: take no role, and say why once (in the
        role change, or on a line of its own when the member had no role to leave)."""
        if not self._set_view(NO_LEADER, f"{self._leaving()}: {reason}"):
            log.info(
                "group %s member %s: lease %x given up: %s",
                self.keys.group,
                self.info.member_id,
                lease_id,
                reason,
                extra=fields(group=self.keys.group, member=self.info.member_id),
            )

    # The sessions

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Take part in the group until cancelled, then resign. Reports started at once;
        watch ``view`` or ``wait_change()`` for the role. Retries EtcdUnavailable for
        ever (as a candidate once its lease is no longer trusted); raises EtcdError only
        for answers that retrying cannot change."""
        task_status.started()
        retry_s = RETRY_MIN_S
        outage_told = False
        try:
            while True:
                try:
                    reason = await self._session()
                    retry_s, outage_told = RETRY_MIN_S, False
                except EtcdUnavailable as exc:
                    # The grant or the registration failed: said once per outage, not at
                    # every retry.
                    reason = f"etcd unavailable: {exc}"
                    self._set_view(NO_LEADER, f"{self._leaving()}: {reason}")
                    log.log(
                        logging.DEBUG if outage_told else logging.INFO,
                        "group %s member %s: cannot start a session, retrying: %s",
                        self.keys.group,
                        self.info.member_id,
                        reason,
                    )
                    outage_told = True
                await self._revoke(f"session over: {reason}")
                await trio.sleep(retry_s)
                retry_s = min(retry_s * 2, self.lease_ttl_ms / 3000)
        finally:
            self._set_view(NO_LEADER, "stopping")
            with trio.CancelScope(shield=True):
                await self._revoke("stopping")

    async def _revoke(self, why: str) -> None:
        """Revoke the session's lease, if any, giving up its keys; best effort: when etcd
        cannot be reached the lease expires by itself."""
        lease_id, self._lease_id, self._guard = self._lease_id, 0, None
        if not lease_id:
            return
        with trio.move_on_after(RESIGN_TIMEOUT_S):
            try:
                await self.etcd.lease_revoke(lease_id)
                log.debug("revoked lease %x (%s)", lease_id, why)
            except EtcdError as exc:  # already gone, or etcd cannot be reached
                log.debug("could not revoke lease %x (%s): %s", lease_id, why, exc)

    async def _session(self) -> str:
        """One lease's life; returns why it ended. Raises EtcdUnavailable when the lease
        cannot be granted or the member registered."""
        sent_ms = now_ms()
        lease = await self.etcd.lease_grant(self.lease_ttl_ms // 1000)
        self._lease_id = lease.id
        # etcd may grant a longer lease (it has a minimum), never a shorter one; trusting
        # the TTL asked for is the safe side.
        guard = LeaseGuard(min(self.lease_ttl_ms, lease.ttl_s * 1000), self.step_down_margin_ms)
        guard.granted(sent_ms)
        self._guard = guard
        try:
            await self.etcd.put(
                self.keys.member(self.info.member_id), self.info.to_json(), lease=lease.id
            )
        except EtcdError as exc:
            if exc.code == GRPC_NOT_FOUND:
                ended = (
                    f"lease expired before the member could register ({exc}), "
                    f"{now_ms() - sent_ms} ms after it was asked for"
                )
                self._leave(lease.id, ended)
                return ended
            raise
        ended = ""
        async with trio.open_nursery() as nursery:

            async def lease_keeper() -> None:
                nonlocal ended
                ended = await keep_lease(guard, lambda: self.etcd.lease_keepalive(lease.id))
                self._leave(lease.id, ended)
                nursery.cancel_scope.cancel()

            async def elections() -> None:
                nonlocal ended
                ended = await self._elect(lease.id)
                guard.lost()
                self._leave(lease.id, ended)
                nursery.cancel_scope.cancel()

            nursery.start_soon(lease_keeper)
            nursery.start_soon(elections)
        return ended

    def _leaving(self) -> str:
        return "stepping down" if self.view.role is Role.LEADER else "leaving the group"

    async def _elect(self, lease_id: int) -> str:
        """Campaign and follow until the lease turns out to be gone; returns why."""
        retry_s = RETRY_MIN_S
        while True:
            await self._until_lease_trusted()
            try:
                kv, revision = await self._campaign(lease_id)
                view = view_of(kv, lease_id, self.info.member_id)
                if view.role is Role.LEADER and self.view.role is not Role.LEADER:
                    self.elections_won += 1
                self._set_view(view, _why(view))
                await self._watch_leader(kv, revision + 1, lease_id)
                retry_s = RETRY_MIN_S
            except EtcdUnavailable as exc:
                # Keep the view: the lease guard decides when it no longer holds.
                log.debug("group %s: etcd unavailable, retrying: %s", self.keys.group, exc)
                await trio.sleep(retry_s)
                retry_s = min(retry_s * 2, self.lease_ttl_ms / 3000)
            except EtcdError as exc:
                if exc.code == GRPC_NOT_FOUND:
                    return f"etcd no longer knows the lease ({exc})"
                raise

    async def _until_lease_trusted(self) -> None:
        """Return once the session's lease is trusted. A lease no longer trusted (a
        registration slower than the renewals' slack, a stalled process) ends the session
        at once (the lease keeper), unless a late answer restores it: a campaign won on it
        meanwhile would lead for no time at all, yet take a new epoch and make the server
        promote and demote."""
        while (guard := self._guard) is None or not guard.trusted(now_ms()):
            await trio.sleep(RETRY_MIN_S)

    async def _campaign(self, lease_id: int) -> tuple[KeyValue | None, int]:
        """The leader key after trying to take it (when eligible), and the revision it
        was read at."""
        key = self.keys.leader
        if not self.eligible():
            found = await self.etcd.range(key)
            return (found.kvs[0] if found.kvs else None), found.revision
        own = self.info.to_json()
        result = await self.etcd.txn(
            [Compare.create_revision(key, 0), *self.campaign_compares()],
            [Put(key, own, lease_id), *self.campaign_puts()],
            [Get(key)],
        )
        if result.succeeded:
            won = KeyValue(key.encode(), own, result.revision, result.revision, 1, lease_id)
            return won, result.revision
        found = result.responses[0]
        assert isinstance(found, RangeResult)
        # A txn is atomic: the failure branch reads the key the compares found. No key:
        # an added compare failed, and the campaign is tried again as ineligible ones are.
        return (found.kvs[0] if found.kvs else None), result.revision

    async def _watch_leader(self, kv: KeyValue | None, start_revision: int, lease_id: int) -> None:
        """Follow the leader key from ``start_revision`` until it is deleted (return to
        campaign again). With no leader and not eligible, return after ttl/3 to ask
        ``eligible()`` again."""
        recheck_s = self.lease_ttl_ms / 3000 if kv is None else math.inf
        with trio.move_on_after(recheck_s):
            try:
                async with self.etcd.watch(
                    self.keys.leader, start_revision=start_revision
                ) as events:
                    async for event in events:
                        if event.kind is EventKind.DELETE:
                            self._set_view(NO_LEADER, self._why_deleted())
                            return
                        view = view_of(event.kv, lease_id, self.info.member_id)
                        self._set_view(view, _why(view))
            except EtcdError as exc:
                if exc.code != GRPC_OUT_OF_RANGE:
                    raise
                log.info("group %s: leader watch compacted, reading again", self.keys.group)

    def _why_deleted(self) -> str:
        """Why the leader key went, as far as this member can tell. A leader's own key
        goes only with its lease, which it revokes only once it stepped down: seeing
        the delete while leading means etcd let the lease go first."""
        if self.view.role is not Role.LEADER:
            return "the leader key was deleted"
        guard, now = self._guard, now_ms()
        if guard is None or guard.trusted_until_ms is None:
            return "its own leader key was deleted: its lease is gone from etcd"
        if guard.trusted(now):
            why = (
                f"while this member still trusted its lease for {guard.trusted_until_ms - now} "
                "ms: revoked by hand, the key deleted by hand, or etcd's clock ran fast"
            )
        else:
            why = (
                f"{now - guard.trusted_until_ms} ms after this member stopped trusting its "
                "lease, before it stepped down: its event loop ran late"
            )
        reason = f"its own leader key was deleted {why}"
        log.warning(
            "group %s member %s: %s (the newest renewal answered was sent %d ms ago, "
            "the lease's ttl is %d ms)",
            self.keys.group,
            self.info.member_id,
            reason,
            now - (guard.renewed_at_ms or 0),
            guard.ttl_ms,
        )
        return reason


def _why(view: View) -> str:
    if view.role is Role.LEADER:
        return "won the leader key"
    if view.role is Role.FOLLOWER:
        return "another member holds the leader key"
    return "no leader"
