"""One producer connection to the delay server, built on the connection skeleton of
delayd.serving.connection (reader, writer, acker, limits, graceful stop), feeding the
intake path: SEND_BATCH, CANCEL, CANCEL_BATCH, RESCHEDULE, HELD_IDS and STATS.

SEND_BATCH is validated and appended on the reader, so pipelined batches keep their
order, and answered by the acker once durable, so batches in flight share group-commit
fsyncs. A CANCEL or RESCHEDULE appends its tombstone on the reader as well (in order
with this connection's sends) and is answered from a request task once durable and
resolved (docs/cancel.md); a CANCEL_BATCH is one append and one answer. SEND_BATCHes
and CANCEL_BATCHes take the skeleton's slots, single tombstones MAX_TOMBSTONES_IN_FLIGHT
of their own; at a graceful stop every one of them is answered. HELD_IDS is read-only:
answered on the reader from the id index, as a SEND_BATCH of the ids would decide
DUPLICATE.

A member of a group that does not lead it (``membership``, delayd.serving.membership)
answers SEND_BATCH, CANCEL, CANCEL_BATCH, RESCHEDULE and HELD_IDS (a follower's id
index may lag its leader's) with ERROR NOT_LEADER naming
the leader's intake address; the leader asks ``may_lead()`` again before each answer, so
what was in flight when it stepped down is answered NOT_LEADER too, never acknowledged.

Requests the delay server does not serve get ERROR UNSUPPORTED naming its broker. A full
disk is an answer: a SEND_BATCH gets DISK_FULL results, a cancel or reschedule ERROR
DISK_FULL (both retryable; nothing was stored). Any other StorageError from message_log
(a failed fsync) is not the client's fault and not survivable: it propagates and stops
the server, which then acknowledges nothing more (recovery on restart reads what is
really on disk).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from delayd.nowait_acquire import acquire
from delayd.protocol import (
    Cancel,
    CancelBatch,
    CancelBatchResult,
    CancelResult,
    Error,
    ErrorCode,
    Event,
    HeldIds,
    HeldIdsResult,
    Reschedule,
    RescheduleOutcome,
    RescheduleResult,
    SendBatch,
    SendBatchResult,
    Stats,
    StatsResult,
)
from delayd.server.cancels import Answer
from delayd.server.intake import IntakePath, NotAcknowledged
from delayd.server.receiver import Intake
from delayd.serving.connection import ServerConnection
from delayd.serving.connection_gate import ConnectionGate
from storage.errors import DiskFullError, StorageError

if TYPE_CHECKING:  # only a member of a group has one (it needs the etcd client)
    from delayd.serving.membership import Membership

log = logging.getLogger(__name__)

SERVER_NAME = "delayd-serve"
# Single CANCEL / RESCHEDULE frames awaiting their answer per connection: tiny, and each
# waits for two group-commit fsyncs, so a pipelining client needs many in flight.
MAX_TOMBSTONES_IN_FLIGHT = 1024


_LEADER_ONLY = (SendBatch, Cancel, CancelBatch, Reschedule, HeldIds)


class DelayConnection(ServerConnection[tuple[Intake, int]]):
    """One producer connection; see the module docstring. ``_unacked`` holds the
    appended SEND_BATCHes: (intake, request id)."""

    server_name = SERVER_NAME

    def __init__(
        self,
        intake: IntakePath,
        stream: trio.abc.Stream,
        *,
        token: str | None,
        max_frame_size: int,
        stats: Callable[[], dict[str, str | int | float]],
        broker_address: str | None,
        gate: ConnectionGate,
        membership: Membership | None = None,
    ) -> None:
        super().__init__(stream, token=token, max_frame_size=max_frame_size, gate=gate)
        self.membership = membership
        self.intake = intake
        self.stats = stats
        self.broker_address = broker_address
        self._tombstone_slots = trio.Semaphore(MAX_TOMBSTONES_IN_FLIGHT)

    def _not_leader(self, request_id: int, *, acknowledged: bool = True) -> Error | None:
        """ERROR NOT_LEADER when this member may not act as leader now (or its group did
        not acknowledge the request's records), else None."""
        membership = self.membership
        if membership is None or (acknowledged and membership.may_lead()):
            return None
        return Error(ErrorCode.NOT_LEADER, membership.refusal("intake"), request_id=request_id)

    async def _serve(self, event: Event, requests: trio.Nursery) -> None:
        rid = event.request_id
        if isinstance(event, _LEADER_ONLY) and (refused := self._not_leader(rid)) is not None:
            await self._answer(refused)
            return
        if isinstance(event, SendBatch):
            await acquire(self._slots)
            try:
                await self.intake.make_room()
                intake = self.intake.append(event.messages, event.encoded)
            except BaseException:
                self._slots.release()
                raise
            self._unacked.append((intake, rid))
        elif isinstance(event, Stats):
            stats = self.stats()
            if self.intake.canceller is not None:
                stats = {**stats, **self.intake.canceller.stats()}
            await self._answer(StatsResult(stats, request_id=rid))
        elif isinstance(event, (Cancel, Reschedule)):
            await self._tombstone(event, requests)
        elif isinstance(event, CancelBatch):
            await self._cancel_batch(event, requests)
        elif isinstance(event, HeldIds):
            if not all(event.message_ids):
                reason = f"message_id {event.message_ids.index('')} is empty: name every id"
                await self._answer(Error(ErrorCode.INVALID_REQUEST, reason, request_id=rid))
                return
            due_ms = await self.intake.held(event.message_ids)
            await self._answer(HeldIdsResult(tuple(due_ms), request_id=rid))
        else:
            where = f" at {self.broker_address}" if self.broker_address else ""
            reason = (
                "this is the delay server: it takes SEND_BATCH, CANCEL, CANCEL_BATCH, "
                f"RESCHEDULE, HELD_IDS and STATS; "
                f"{event.command.name} goes to its broker{where}"
            )
            await self._answer(Error(ErrorCode.UNSUPPORTED, reason, request_id=rid))

    def _error_for(self, exc: Exception, event: Event) -> Error:
        if isinstance(exc, DiskFullError):
            # Nothing was stored (message_log cut the refused append back): retryable.
            reason = str(exc)[: Error.MAX_REASON_LENGTH]
            return Error(ErrorCode.DISK_FULL, reason, request_id=event.request_id)
        if isinstance(exc, StorageError):
            raise exc  # not the client's fault and not survivable: see the module docstring
        return super()._error_for(exc, event)

    async def _tombstone(self, event: Cancel | Reschedule, requests: trio.Nursery) -> None:
        """Append the tombstone on the reader (in order with this connection's sends:
        a cancel sent after a send's ack always finds it), answer once it is durable
        and resolved (docs/cancel.md)."""
        rid = event.request_id
        if not event.message_id:
            reason = "message_id is empty: name the message to cancel or reschedule"
            await self._answer(Error(ErrorCode.INVALID_REQUEST, reason, request_id=rid))
            return
        due_ms = None
        if isinstance(event, Reschedule):
            due_ms, refusal = self.intake.reschedule_due_ms(event.at_ms)
            if due_ms is None:
                # Answered like a send past max_delay: refused, never clamped.
                log.info("reschedule of %r refused: %s", event.message_id, refusal)
                too_long = RescheduleResult(RescheduleOutcome.DELAY_TOO_LONG, request_id=rid)
                await self._answer(too_long)
                return
        await acquire(self._tombstone_slots)
        try:
            await self.intake.make_room()
            answer = self.intake.append_tombstone(event.message_id, due_ms)
        except BaseException:
            self._tombstone_slots.release()
            raise
        requests.start_soon(self._settle, answer, rid)

    async def _cancel_batch(self, event: CancelBatch, requests: trio.Nursery) -> None:
        """CANCEL for each id, in one message_log append and one answer frame (the
        same tombstones, decisions and durability as single CANCELs)."""
        rid = event.request_id
        ids = event.message_ids
        if not ids:
            await self._answer(CancelBatchResult((), request_id=rid))
            return
        if not all(ids):
            reason = f"message_id {ids.index('')} is empty: name every message to cancel"
            await self._answer(Error(ErrorCode.INVALID_REQUEST, reason, request_id=rid))
            return
        await acquire(self._slots)
        try:
            await self.intake.make_room()
            answers = self.intake.append_tombstones(ids)
        except BaseException:
            self._slots.release()
            raise
        requests.start_soon(self._settle_batch, answers, rid)

    async def _settle_batch(self, answers: list[Answer], request_id: int) -> None:
        try:
            acknowledged = await self._settled(answers)
            if (refused := self._not_leader(request_id, acknowledged=acknowledged)) is not None:
                await self._answer(refused)
                return
            results = tuple((a.outcome, a.dispatched_ms) for a in answers)
            await self._answer(CancelBatchResult(results, request_id=request_id))  # type: ignore[arg-type]
        finally:
            self._slots.release()  # once answered: see the module docstring

    async def _settled(self, answers: list[Answer]) -> bool:
        """Settle ``answers``; whether the group acknowledged their tombstones."""
        try:
            await self.intake.settle_all(answers)
        except NotAcknowledged:
            return False
        return True

    async def _settle(self, answer: Answer, request_id: int) -> None:
        try:
            acknowledged = await self._settled([answer])
            if (refused := self._not_leader(request_id, acknowledged=acknowledged)) is not None:
                await self._answer(refused)
                return
            if answer.is_cancel:
                result: Event = CancelResult(
                    answer.outcome, answer.dispatched_ms, request_id=request_id
                )  # type: ignore[arg-type]
            else:
                result = RescheduleResult(
                    answer.outcome,
                    answer.dispatched_ms,
                    request_id=request_id,  # type: ignore[arg-type]
                )
            await self._answer(result)
        finally:
            self._tombstone_slots.release()  # once answered: see the module docstring

    async def _acknowledge(self, ready: list[tuple[Intake, int]]) -> None:
        held = len(ready)  # slots of these batches, each released once answered
        try:
            intakes = [intake for intake, _ in ready]
            try:
                answers = await self.intake.acknowledge_all(intakes)
                acknowledged = True
            except NotAcknowledged:
                answers, acknowledged = [[] for _ in ready], False
            for (_, request_id), results in zip(ready, answers, strict=True):
                refused = self._not_leader(request_id, acknowledged=acknowledged)
                await self._answer(refused or SendBatchResult(results, request_id=request_id))
                self._slots.release()
                held -= 1
        finally:
            for _ in range(held):
                self._slots.release()
