"""The broker's TCP server: one connection per socket over a Broker, built on the
connection skeleton of delayd.serving.connection (reader, writer, acker, limits,
graceful stop).

Cheap requests are answered on the reader. SEND_BATCH appends there — pipelined batches
keep their order — and is answered by the acker once the commitlog is durable: batches
in flight share group-commit fsyncs. A PULL that finds messages is answered on the
reader as well; one that has to wait runs in a request task, because it may be held
(long polling), and so does a durable COMMIT_OFFSET; answers may leave in any order
(docs/protocol.md, rule 4). Held PULLs and unacknowledged SEND_BATCHes take the
skeleton's slots. The connection cap, the HELLO and frame deadlines and the frame
budget come from the broker's ConnectionLimits.

A bad argument gets ERROR INVALID_REQUEST (a RejectedError's code); a storage failure
in one request gets ERROR INTERNAL, and the broker keeps serving the others; CANCEL,
CANCEL_BATCH, RESCHEDULE and HELD_IDS get ERROR UNSUPPORTED, naming the delay server. A member of
a group that does not lead it (``membership``) answers every request but STATS with
ERROR NOT_LEADER naming the leader's broker address, and a leader that steps down
answers the SEND_BATCHes in flight so too (docs/replication.md); a member's broker
(``Broker.gate``) answers a SEND_BATCH, and every COMMIT_OFFSET, once its group has the
records. A graceful
stop (``broker_listener(...).stop``) answers every SEND_BATCH appended and drops held
PULLs (they commit nothing), then closes with FIN: a batch is stored and answered, or
not stored.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from delayd.broker.broker import Broker
from delayd.errors import NotLeaderError, RejectedError
from delayd.nowait_acquire import acquire
from delayd.protocol import (
    Cancel,
    CancelBatch,
    CommitOffset,
    CommitOffsetOk,
    Error,
    ErrorCode,
    Event,
    Heartbeat,
    HeartbeatResult,
    HeldIds,
    JoinGroup,
    JoinGroupResult,
    Pull,
    PullResult,
    Query,
    QueryResult,
    Reschedule,
    SendBatch,
    SendBatchResult,
    Stats,
    StatsResult,
)
from delayd.protocol.frames import DEFAULT_MAX_FRAME_SIZE
from delayd.serving.connection import ServerConnection, internal_error
from delayd.serving.connection_gate import ConnectionGate
from delayd.serving.stoppable_listener import StoppableListener
from delayd.serving.tls import ServerTls
from storage.errors import StorageError

if TYPE_CHECKING:  # only a member of a group has one (it needs the etcd client)
    from delayd.serving.membership import Membership

log = logging.getLogger(__name__)

SERVER_NAME = "delayd-broker"


async def serve_broker(
    broker: Broker,
    host: str,
    port: int,
    *,
    token: str | None = None,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    listeners: list[trio.SocketListener] | None = None,
    gate: ConnectionGate | None = None,
    tls: ServerTls | None = None,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Listen on host:port (0: any free port), or on ``listeners`` already bound there
    (delayd.serving.listeners: bound before recovery), and serve until cancelled.

    ``gate``: the listener's cap and counts (for /metrics); by default one of the
    broker's ``connection_limits``. ``tls``: serve over TLS (delayd.tls). Reports the
    bound (host, port) addresses through ``task_status.started``. Raises ListenError
    when host:port cannot be bound.
    """
    listener = broker_listener(
        broker, token=token, max_frame_size=max_frame_size, gate=gate, tls=tls
    )
    await listener.serve(host, port, listeners=listeners, task_status=task_status)


def broker_listener(
    broker: Broker,
    *,
    token: str | None = None,
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE,
    gate: ConnectionGate | None = None,
    membership: Membership | None = None,
    tls: ServerTls | None = None,
) -> StoppableListener[BrokerConnection]:
    """The broker's listener with a graceful stop: ``serve`` it as serve_broker does,
    then ``stop(grace_s)`` answers every SEND_BATCH appended before closing (a held
    PULL is dropped: nothing is committed by it) — delayd.serving.stoppable_listener. ``gate``:
    its cap and counts (for /metrics); by default one of the broker's
    ``connection_limits``. ``membership``: the group whose leader alone serves (None:
    this broker runs alone). ``tls``: serve over TLS (delayd.tls)."""
    if gate is None:
        gate = ConnectionGate("broker", broker.config.connection_limits)
    # The connections count their protocol errors on the gate that admitted them.
    counted = gate

    def connection(stream: trio.abc.Stream) -> BrokerConnection:
        return BrokerConnection(broker, stream, token, max_frame_size, counted, membership)

    return StoppableListener("the broker", connection, gate, tls)


class BrokerConnection(ServerConnection[tuple[SendBatchResult, int]]):
    """One client connection; see the module docstring. ``_unacked`` holds the answers
    of the appended SEND_BATCHes, each with the commitlog's end after its append (what
    a replicated group must acknowledge before it is answered)."""

    server_name = SERVER_NAME
    # A held PULL commits nothing: a graceful stop drops it rather than wait for it.
    finish_requests_on_stop = False

    def __init__(
        self,
        broker: Broker,
        stream: trio.abc.Stream,
        token: str | None,
        max_frame_size: int,
        gate: ConnectionGate,
        membership: Membership | None = None,
    ) -> None:
        super().__init__(stream, token=token, max_frame_size=max_frame_size, gate=gate)
        self.broker = broker
        self.membership = membership

    def _not_leader(self, request_id: int) -> Error | None:
        """ERROR NOT_LEADER when this member may not act as leader now, else None."""
        membership = self.membership
        if membership is None or membership.may_lead():
            return None
        return Error(ErrorCode.NOT_LEADER, membership.refusal("broker"), request_id=request_id)

    async def run(self) -> None:
        try:
            await super().run()
        finally:
            self.broker.connection_closed(self)  # its group members leave with it

    async def _serve(self, event: Event, requests: trio.Nursery) -> None:
        broker = self.broker
        rid = event.request_id
        if not isinstance(event, Stats) and (refused := self._not_leader(rid)) is not None:
            await self._answer(refused)
            return
        if isinstance(event, SendBatch):
            await acquire(self._slots)  # released by the acker once answered
            try:
                await broker.store.make_room()
                results = broker.append_batch(event.messages, broker.clock(), event.encoded)
            except BaseException:
                self._slots.release()
                raise
            end = broker.store.commitlog.end_offset
            self._unacked.append((SendBatchResult(results, request_id=rid), end))
        elif isinstance(event, Pull):
            # Messages waiting: answered here, a scheduling step sooner than a task.
            encoded = broker.pull_ready(
                event.subject, event.group, event.consumer_id, event.max_messages, self
            )
            if encoded is not None:
                await self._answer(PullResult(encoded=encoded, request_id=rid))
            else:
                await self._spawn(requests, self._pull, event)
        elif isinstance(event, CommitOffset):
            broker.commit(event.group, event.subject, event.queue, event.offset)
            if event.durable or broker.gate is not None:  # a group: acked once it has it
                await self._spawn(requests, self._commit_durable, event)
            else:
                await self._answer(CommitOffsetOk(request_id=rid))
        elif isinstance(event, JoinGroup):
            now = broker.monotonic_ms()
            member = (event.group, event.subject, event.consumer_id)
            queues = broker.join(*member, self, now, held=event.held or ())
            await self._answer(JoinGroupResult(queues, request_id=rid))
        elif isinstance(event, Heartbeat):
            now = broker.monotonic_ms()
            member = (event.group, event.subject, event.consumer_id)
            queues = broker.heartbeat(*member, self, now, event.held)
            await self._answer(HeartbeatResult(queues, request_id=rid))
        elif isinstance(event, Query):
            found = broker.query(event.subject, message_id=event.message_id, key=event.key)
            await self._answer(QueryResult(found, request_id=rid))
        elif isinstance(event, Stats):
            await self._answer(StatsResult(broker.stats(), request_id=rid))
        elif isinstance(event, (Cancel, CancelBatch, Reschedule, HeldIds)):
            await self._answer(
                Error(
                    ErrorCode.UNSUPPORTED,
                    f"the broker does not implement {event.command.name}; "
                    "send it to the delay server",
                    request_id=rid,
                )
            )
        else:
            await self._answer(
                Error(ErrorCode.UNSUPPORTED, f"{type(event).__name__}", request_id=rid)
            )

    async def _spawn(
        self, requests: trio.Nursery, fn: Callable[..., Awaitable[None]], *args: object
    ) -> None:
        await acquire(self._slots)

        async def task() -> None:
            try:
                await fn(*args)
            finally:
                self._slots.release()

        requests.start_soon(task)

    async def _acknowledge(self, ready: list[tuple[SendBatchResult, int]]) -> None:
        # One wait for all of ready: wait_stored covers every batch appended before the
        # last one's end (durable, and acknowledged by the group of a member).
        try:
            await self.broker.wait_stored(ready[-1][1])
        except (StorageError, NotLeaderError) as exc:
            if isinstance(exc, StorageError):
                log.error("commitlog failure, batches from %s not acknowledged: %s", self.peer, exc)
            for result, _ in ready:
                rid = result.request_id
                if isinstance(exc, NotLeaderError):
                    refused = self._not_leader(rid) or self._error_for(exc, result)
                else:
                    reason = f"storage failure: {exc}"[: Error.MAX_REASON_LENGTH]
                    refused = Error(ErrorCode.INTERNAL, reason, request_id=rid)
                await self._answer(refused)
                self._slots.release()
            return
        for result, _ in ready:
            await self._answer(self._not_leader(result.request_id) or result)
            self._slots.release()

    async def _pull(self, event: Pull) -> None:
        try:
            encoded = await self.broker.pull_encoded(
                event.subject,
                event.group,
                event.consumer_id,
                event.max_messages,
                event.wait_ms,
                self,
            )
            answer: Event = PullResult(encoded=encoded, request_id=event.request_id)
        except Exception as exc:
            answer = self._error_for(exc, event)
        await self._answer(self._not_leader(event.request_id) or answer)

    async def _commit_durable(self, event: CommitOffset) -> None:
        """Answer a durable COMMIT_OFFSET (every COMMIT_OFFSET of a group member) once
        the offsets log holds it, and the group too (a task, so the requests behind it
        are not held up by the write)."""
        try:
            await self.broker.wait_commits_acknowledged()
            answer: Event = CommitOffsetOk(request_id=event.request_id)
        except Exception as exc:
            answer = self._error_for(exc, event)
        await self._answer(self._not_leader(event.request_id) or answer)

    def _error_for(self, exc: Exception, event: Event) -> Error:
        rid = event.request_id
        if isinstance(exc, RejectedError):
            code = exc.code if isinstance(exc.code, ErrorCode) else ErrorCode.INVALID_REQUEST
            return Error(code, exc.reason[: Error.MAX_REASON_LENGTH], request_id=rid)
        if isinstance(exc, StorageError):
            # Logged without a traceback: the store's message says what failed and where.
            log.error("storage failure serving %s from %s: %s", event, self.peer, exc)
            return internal_error(exc, event)
        return super()._error_for(exc, event)
