"""One producer connection to the delay server: a delayd.protocol.Connection over a
trio stream, feeding SEND_BATCH to the intake path.

Per connection a reader task parses frames and dispatches requests in arrival order and
a writer task owns the sending side (whole frames from a small channel), the layout of
the broker's server. SEND_BATCH is validated and appended on the reader, so pipelined
batches keep their order, and answered from a request task once durable, so batches in
flight share group-commit fsyncs; at most MAX_IN_FLIGHT such tasks per connection, after
which the reader stops reading and TCP pushes back on the producer.

Every request counts until its answer is queued to the writer (whose queue is bounded
too), not merely until it is decided: a client that pipelines requests and never reads
the answers holds at most MAX_IN_FLIGHT batches and MAX_TOMBSTONES_IN_FLIGHT tombstones,
then its reader stops, and it stalls only itself. Requests answered on the reader
(HELLO, STATS, refusals) wait for room in the writer there. Deadlines, the frame budget
and the connection cap are the listener's (delayd.stream_events, connection_gate).

Bad input never crashes the server: a protocol violation (bad frame, no HELLO, wrong
token) gets the closing ERROR the Connection names and the socket is closed; requests
the delay server does not serve get ERROR UNSUPPORTED; an unexpected failure in one
request is logged and answered ERROR INTERNAL. A full disk is an answer: a SEND_BATCH
gets DISK_FULL results, a cancel or reschedule ERROR DISK_FULL (both retryable; nothing
was stored). Any other StorageError from message_log (a failed fsync) is not the
client's fault and not survivable: it propagates and stops the server, which then
acknowledges nothing more (recovery on restart reads what is really on disk).

Closing: at EOF or after a protocol error the in-flight requests are cancelled (their
answers could not be delivered). ``stop_reading`` (server shutdown) instead stops
taking requests and lets the in-flight ones finish, so batches already appended are
still acknowledged, then closes with FIN after the last answer: what the
client sent after the stop is read and dropped, never appended, never answered
(delayd.stoppable_listener.linger).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import trio

from delayd.answer_queue import AnswerQueue
from delayd.connection_gate import ConnectionGate
from delayd.errors import ConnectionClosedError, LocalProtocolError
from delayd.nowait import acquire
from delayd.protocol import (
    SERVER,
    Cancel,
    CancelBatch,
    CancelBatchResult,
    CancelResult,
    Connection,
    Error,
    ErrorCode,
    Event,
    Hello,
    HelloOk,
    Reschedule,
    RescheduleOutcome,
    RescheduleResult,
    SendBatch,
    SendBatchResult,
    Stats,
    StatsResult,
)
from delayd.receiver import Intake
from delayd.server.cancels import Answer
from delayd.server.intake import IntakePath
from delayd.stoppable_listener import linger
from delayd.stream_events import read_and_dispatch
from delayd.stream_writer import FrameWriter
from delayd.tls import peer_of
from storage.errors import DiskFullError, StorageError

log = logging.getLogger(__name__)

SERVER_NAME = "delayd-serve"
MAX_IN_FLIGHT = 64  # SEND_BATCHes (and CANCEL_BATCHes) awaiting durability per connection
# Single CANCEL / RESCHEDULE frames awaiting their answer per connection: tiny, and each
# waits for two group-commit fsyncs, so a pipelining client needs many in flight.
MAX_TOMBSTONES_IN_FLIGHT = 1024
OUTBOX_FRAMES = 16


class DelayConnection:
    """One client connection; see the module docstring."""

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
    ) -> None:
        self.intake = intake
        self.gate = gate
        self.stream = stream
        self.conn = Connection(SERVER, token=token, max_frame_size=max_frame_size)
        self.stats = stats
        self.broker_address = broker_address
        self._writer = FrameWriter(stream, OUTBOX_FRAMES)
        self._slots = trio.Semaphore(MAX_IN_FLIGHT)
        self._unacked: AnswerQueue[tuple[Intake, int]] = AnswerQueue()  # (intake, request id)
        self._tombstone_slots = trio.Semaphore(MAX_TOMBSTONES_IN_FLIGHT)
        self._read_scope = trio.CancelScope()
        self._stopping = False
        self.peer = peer_of(stream)

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as outer:
                outer.start_soon(self._write_loop, outer.cancel_scope)
                async with trio.open_nursery() as requests:
                    await requests.start(self._ack_loop)
                    final = None
                    with self._read_scope:
                        final = await self._read_loop(requests)
                    self._unacked.close()  # the acker ends once all are answered
                    if not self._stopping:
                        requests.cancel_scope.cancel()
                if final is not None:
                    with contextlib.suppress(trio.BrokenResourceError):
                        await self._writer.send(final)
                self._writer.close()
            if self._stopping and not self._writer.broken:
                await linger(self.stream)
        finally:
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    def stop_reading(self) -> None:
        """Take no more requests; answer the ones in flight, then close."""
        self._stopping = True
        self._read_scope.cancel()

    async def _write_loop(self, connection_scope: trio.CancelScope) -> None:
        await self._writer.run()
        if self._writer.broken:
            connection_scope.cancel()  # the peer is gone: stop reading, drop answers

    async def _read_loop(self, requests: trio.Nursery) -> bytes | None:
        """Parse and dispatch until EOF (None) or a protocol error (the closing frame)."""

        async def dispatch(event: Event) -> None:
            await self._dispatch(event, requests)

        return await read_and_dispatch(self.stream, self.conn, self.peer, dispatch, self.gate)

    async def _dispatch(self, event: Event, requests: trio.Nursery) -> None:
        rid = event.request_id
        try:
            if isinstance(event, SendBatch):
                await acquire(self._slots)
                try:
                    await self.intake.make_room()
                    intake = self.intake.append(event.messages, event.encoded)
                except BaseException:
                    self._slots.release()
                    raise
                self._unacked.append((intake, rid))
            elif isinstance(event, Hello):
                version = self.conn.protocol_version or 1
                hello_ok = HelloOk(version, SERVER_NAME, self.conn.max_frame_size, request_id=rid)
                await self._answer(hello_ok)
            elif isinstance(event, Stats):
                stats = self.stats()
                if self.intake.canceller is not None:
                    stats = {**stats, **self.intake.canceller.stats()}
                await self._answer(StatsResult(stats, request_id=rid))
            elif isinstance(event, (Cancel, Reschedule)):
                await self._tombstone(event, requests)
            elif isinstance(event, CancelBatch):
                await self._cancel_batch(event, requests)
            else:
                where = f" at {self.broker_address}" if self.broker_address else ""
                reason = (
                    "this is the delay server: it takes SEND_BATCH, CANCEL, CANCEL_BATCH, "
                    f"RESCHEDULE and STATS; "
                    f"{event.command.name} goes to its broker{where}"
                )
                await self._answer(Error(ErrorCode.UNSUPPORTED, reason, request_id=rid))
        except DiskFullError as exc:
            # Nothing was stored (message_log cut the refused append back): retryable.
            reason = str(exc)[: Error.MAX_REASON_LENGTH]
            await self._answer(Error(ErrorCode.DISK_FULL, reason, request_id=rid))
        except StorageError:
            raise
        except Exception as exc:  # one bad request must not end the server
            log.exception("internal error serving %s from %s", type(event).__name__, self.peer)
            reason = f"internal error: {type(exc).__name__}: {exc}"[: Error.MAX_REASON_LENGTH]
            await self._answer(Error(ErrorCode.INTERNAL, reason, request_id=rid))

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
            await self.intake.settle_all(answers)
            results = tuple((a.outcome, a.dispatched_ms) for a in answers)
            await self._answer(CancelBatchResult(results, request_id=request_id))  # type: ignore[arg-type]
        finally:
            self._slots.release()  # once answered: see the module docstring

    async def _settle(self, answer: Answer, request_id: int) -> None:
        try:
            await self.intake.settle(answer)
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

    async def _ack_loop(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Answer appended SEND_BATCHes once the flush policy allows, in append order.

        One wait covers every batch appended before it, so a group commit costs one
        wake-up here, not a task per batch (a task costs scheduling steps, and on a
        busy event loop those are most of the cost of a small batch).
        """
        task_status.started()
        while (ready := await self._unacked.take_all()) is not None:
            held = len(ready)  # slots of these batches, each released once answered
            try:
                answers = await self.intake.acknowledge_all([intake for intake, _ in ready])
                for (_, request_id), results in zip(ready, answers, strict=True):
                    await self._answer(SendBatchResult(results, request_id=request_id))
                    self._slots.release()
                    held -= 1
            finally:
                for _ in range(held):
                    self._slots.release()

    async def _answer(self, event: Event) -> None:
        """Encode and queue one answer; dropped when the connection is already closed."""
        try:
            data = self.conn.send(event)
        except ConnectionClosedError:
            return
        except LocalProtocolError as exc:
            log.error("cannot send %s to %s: %s", type(event).__name__, self.peer, exc)
            return
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._writer.send(data)
