"""The intake path: Receiver decisions, message_log appends, acks after durability.

A SEND_BATCH is handled in two halves, as the broker does:

1. ``append`` (on the connection's reader, so pipelined batches keep their order): wait
   for room in message_log's unsynced window, then — with no await in between, which is
   what keeps sequences increasing in message_log order — let the Receiver validate and
   number the batch and append its records.
2. ``acknowledge`` (in a request task): wait until the flush policy made the records
   durable (``sync``: the next group-commit fsync, shared by every batch waiting at that
   moment), then build the answer and wake the replayer.

``pending_acks`` (records appended, not yet answered) and the replayer's lag feed the
Receiver's BUSY decision.

A full disk is an answer: when message_log refuses an append (DiskFullError, nothing
of it kept) the batch's accepted messages are answered DISK_FULL, retryable, with the
directory and its free bytes, and ``refusals`` says so to /readyz and the metrics
until an append succeeds again. A cancel or reschedule then raises DiskFullError for
the connection to answer ERROR DISK_FULL. Sends are refused so already when less than
``min_free_bytes`` would be left (storage.space): that reserve is for replay, delivery
and checkpoints, and for cancels and reschedules, refused only below half of it (their
resolution writes too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import trio

from delayd.errors import DelaydError
from delayd.logs import retirement, tombstone
from delayd.logs.message_log import TYPE_MESSAGE, TYPE_RETIRE_BUCKET
from delayd.protocol import EncodedMessages, Message, ResultCode, SendResult
from delayd.replay import Replayer
from delayd.server.receiver import Intake, Receiver
from delayd.timestamps import wall_ms
from delayd.write_refusals import MESSAGE_LOG, WriteRefusals
from storage.errors import DiskFullError
from storage.flusher import FlushMode, LogWriter
from storage.space import FreeSpaceGuard

if TYPE_CHECKING:
    from delayd.server.cancels import Answer, Canceller
    from delayd.server.replicating import GroupReplication


class NotAcknowledged(DelaydError):
    """The group did not acknowledge the records: this member stopped leading (or
    leads again at a new epoch) while they waited. Answer NOT_LEADER: they may still be
    cut, or be kept by the new leader."""


class IntakePath:
    """Appends accepted messages to message_log; see the module docstring."""

    def __init__(
        self,
        receiver: Receiver,
        writer: LogWriter,
        replayer: Replayer,
        *,
        clock: Callable[[], int] = wall_ms,
    ) -> None:
        self.receiver = receiver
        self.writer = writer
        self.log = writer.log
        self.replayer = replayer
        self.clock = clock
        self.pending_acks = 0  # records appended whose batch is not answered yet
        # Set once every id message_log held at start is in the id index (replay caught
        # up): before that a resend of such an id could not be told from a new one.
        self.ids_ready = trio.Event()
        if receiver.known is None:
            self.ids_ready.set()
        # Set by the server once delivery is built: it resolves cancel and reschedule.
        self.canceller: Canceller | None = None
        # A member of a group: acks wait until the group has the records (ack = sync).
        self.replication: GroupReplication | None = None
        self.refusals = WriteRefusals()  # the server shares its own
        reserve = receiver.limits.min_free_bytes
        self.space = FreeSpaceGuard(self.log.fs, self.log.directory, reserve)
        # Cancels and reschedules go on into half the reserve: resolving them writes
        # too (dispatch_log entries, rescheduled copies), into the other half.
        self.tombstone_space = FreeSpaceGuard(self.log.fs, self.log.directory, reserve // 2)

    async def make_room(self) -> None:
        """Wait until intake can decide duplicates (``ids_ready``), and while
        message_log's unsynced bytes are over half its window (as
        LogWriter.append_batch does), so the append below never fsyncs inline."""
        if not self.ids_ready.is_set():
            await self.ids_ready.wait()
        log = self.log
        while log.unsynced_bytes > log.max_unsynced_bytes // 2:
            await self.writer.flush()

    def append(self, messages: Sequence[Message], encoded: EncodedMessages | None = None) -> Intake:
        """Validate and append ``messages`` (``encoded``: as they arrived, which saves
        encoding them again); call ``make_room`` just before.

        A full disk refuses the batch's accepted messages as DISK_FULL (nothing of
        them stored). Raises StorageError when message_log cannot be written for any
        other reason (the server stops).
        """
        intake = self.receiver.accept(
            messages,
            self.clock(),
            pending_acks=self.pending_acks,
            replay_lag_records=self.replayer.lag_records,
            encoded=encoded,
        )
        if intake.payloads:
            try:
                self.space.check(sum(map(len, intake.payloads)))
                offsets = self.log.append_batch(intake.payloads, TYPE_MESSAGE)
            except DiskFullError as exc:
                self.refusals.refuse(MESSAGE_LOG, exc)
                # Not stored, and its ids not held: a retry is a new send.
                return self.receiver.refuse_accepted(intake, ResultCode.DISK_FULL, str(exc))
            if self.refusals.any:
                self.refusals.clear(MESSAGE_LOG)
            if self.receiver.known is not None:  # held from now on (idempotent intake)
                self.receiver.known.hold(intake.message_ids, intake.due_ms, intake.last_sequence)
            known = (intake.due_ms, intake.message_ids, intake.receive_ms)
            self.replayer.offer(offsets, intake.payloads, known)
            self.pending_acks += len(intake.payloads)
        return intake

    async def acknowledge(self, intake: Intake) -> list[SendResult]:
        """The answer for ``intake``, once its records are as durable as the flush
        policy promises (and, in a group, acknowledged by it). Raises StorageError when
        the flush fails, NotAcknowledged when the group did not acknowledge."""
        return (await self.acknowledge_all([intake]))[0]

    async def acknowledge_all(self, intakes: Sequence[Intake]) -> list[list[SendResult]]:
        """``acknowledge`` of each of ``intakes``, with one wait: the flush it waits for
        covers every record appended before the call (group commit)."""
        count = sum(len(intake.payloads) for intake in intakes)
        if count:
            try:
                if self.writer.policy.mode is FlushMode.SYNC:
                    await self.writer.flush()
                await self._replicated()
            finally:
                self.pending_acks -= count
            self.replayer.notify(max(i.last_sequence for i in intakes if i.payloads))
        return [self.receiver.acknowledge(intake) for intake in intakes]

    async def _replicated(self) -> None:
        """Wait until the group acknowledged message_log up to what is durable here (a
        member of a group). Raises NotAcknowledged when it will not be, by this leader."""
        replication = self.replication
        if replication is None or await replication.wait_acknowledged(self.log.durable_offset):
            return
        raise NotAcknowledged(
            "this member stopped leading its group before the group acknowledged the records"
        )

    async def send_batch(self, messages: Sequence[Message]) -> list[SendResult]:
        """Both halves at once, for callers that need no pipelining order (the HTTP
        API, whose requests are independent; tests)."""
        await self.make_room()
        return await self.acknowledge(self.append(messages))

    async def held(self, message_ids: Sequence[str]) -> list[int | None]:
        """For each id, the due time of the message this server holds with it (what a
        send of the id would be answered DUPLICATE with), or None; stores nothing.
        Raises CorruptionError for a damaged index chain."""
        await self.ids_ready.wait()
        known = self.receiver.known
        if known is None:  # no idempotent intake: a send would store every id again
            return [None] * len(message_ids)
        return known.held([message_id.encode() for message_id in message_ids])

    # ------------------------------------------------------------------ cancel, reschedule

    def append_tombstone(self, message_id: str, due_ms: int | None = None) -> Answer:
        """Append a cancel (``due_ms`` None) or reschedule tombstone for ``message_id``
        to message_log, in order with the sends of the connection (call ``make_room``
        just before); returns the Answer its replay will fill. ``due_ms`` must already
        be checked against max_delay (``reschedule_due_ms``). Raises ValueError for an
        empty or oversized id, StorageError when message_log cannot be written."""
        (answer,) = self.append_tombstones([message_id], due_ms)
        return answer

    def append_tombstones(
        self, message_ids: Sequence[str], due_ms: int | None = None
    ) -> list[Answer]:
        """``append_tombstone`` for several ids in one append (a CANCEL_BATCH): all or
        none — ValueError for an empty or oversized id appends nothing, and so does a
        full disk (DiskFullError)."""
        if self.canceller is None:
            raise RuntimeError("cancel and reschedule need delivery (no canceller)")
        receive_ms = self.clock()
        stones = [tombstone.Tombstone(m, receive_ms, due_ms) for m in message_ids]
        payloads = [tombstone.encode(stone) for stone in stones]
        rtype = stones[0].rtype
        try:
            self.tombstone_space.check(sum(map(len, payloads)))
            offsets = self.log.append_batch(payloads, rtype)
        except DiskFullError as exc:
            self.refusals.refuse(MESSAGE_LOG, exc)
            raise
        self.replayer.offer_typed(offsets, payloads, rtype)
        return self.canceller.expect_many(offsets, is_cancel=due_ms is None)

    # ------------------------------------------------------------------ retention

    def append_retirements(self, retirements: Sequence[retirement.Retirement]) -> int:
        """Append bucket retirements (delayd.logs.retirement) for retention, in order
        with the sends; returns message_log's end after them. Raises DiskFullError
        (nothing appended: the next pass tries again), StorageError."""
        payloads = [retirement.encode(r) for r in retirements]
        rtype = TYPE_RETIRE_BUCKET
        offsets = self.log.append_batch(payloads, rtype)
        self.replayer.offer_typed(offsets, payloads, rtype)
        return self.log.end_offset

    async def commit_appended(self) -> bool:
        """Wait until what was appended is durable (flush policy) and, in a group,
        acknowledged by it; False when this member stopped leading first."""
        if self.writer.policy.mode is FlushMode.SYNC:
            await self.writer.flush()
        try:
            await self._replicated()
        except NotAcknowledged:
            return False
        return True

    def reschedule_due_ms(self, at_ms: int) -> tuple[int | None, str]:
        """The due time a reschedule to ``at_ms`` gets, as a send's would: a past time
        is due at once; beyond max_delay it is refused — (None, the reason)."""
        now_ms = self.clock()
        refusal = self.receiver.due_refusal(at_ms, now_ms)
        if refusal is not None:
            if self.canceller is not None:
                self.canceller.refuse_reschedule()
            return None, refusal
        return max(at_ms, now_ms), ""

    async def settle(self, answer: Answer) -> Answer:
        """Wait until the tombstone is durable (flush policy) and resolved."""
        await self.settle_all([answer])
        return answer

    async def settle_all(self, answers: list[Answer]) -> None:
        """``settle`` for the answers of one ``append_tombstones``."""
        if self.writer.policy.mode is FlushMode.SYNC:
            await self.writer.flush()
        await self._replicated()
        self.replayer.notify(0)
        assert self.canceller is not None
        await self.canceller.wait_all(answers)
        # The dispatch_log entries that decided them are durable: the group's too.
        replication = self.replication
        buckets = set().union(*(answer.buckets for answer in answers))
        if replication is not None and not await replication.wait_dispatch_acknowledged(buckets):
            raise NotAcknowledged(
                "this member stopped leading its group before the group acknowledged "
                "what decided the cancel or reschedule"
            )
