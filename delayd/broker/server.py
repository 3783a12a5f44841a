"""The broker's TCP server: one delayd.protocol.Connection per socket, over a Broker.

Per connection: a reader task parses frames and dispatches requests in arrival order; a
writer task owns the socket's sending side (whole frames from a small channel, so a
client that stops reading slows only itself). Cheap requests are answered inline.
SEND_BATCH appends inline — pipelined batches keep their order — and leaves its answer
to the connection's acker task, which waits for durability once for every batch
appended so far and then answers them in order: batches in flight share group-commit
fsyncs without a task each. A PULL that finds messages is answered inline as well; one
that has to wait runs in a request task, because it may be held (long polling); answers
may leave in any order (docs/protocol.md, rule 4). At most
MAX_IN_FLIGHT requests (held PULLs, unacknowledged SEND_BATCHes) per connection, each
until its answer is queued to the writer (bounded as well); requests answered inline
wait for room in the writer on the reader. So a client that never reads its answers
stops its own reader and costs bounded memory. The connection cap, the HELLO and frame
deadlines and the frame budget come from the broker's ConnectionLimits
(delayd.connection_gate, delayd.stream_events).

Bad input never crashes the broker: a protocol violation gets the closing ERROR the
Connection names and the socket is closed; a bad argument gets ERROR INVALID_REQUEST; an
unexpected failure in one request is logged and answered ERROR INTERNAL. A closed socket
cancels the connection's requests; their answers are dropped. A graceful stop
(``broker_listener(...).stop``, ``stop_reading``) instead answers every SEND_BATCH
appended, then closes with FIN: a batch is stored and answered, or not stored.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

import trio

from delayd.answer_queue import AnswerQueue
from delayd.broker.broker import Broker
from delayd.connection_gate import ConnectionGate
from delayd.errors import (
    ConnectionClosedError,
    LocalProtocolError,
    RejectedError,
)
from delayd.nowait import acquire
from delayd.protocol import (
    SERVER,
    Cancel,
    CancelBatch,
    CommitOffset,
    CommitOffsetOk,
    Connection,
    Error,
    ErrorCode,
    Event,
    Heartbeat,
    HeartbeatResult,
    Hello,
    HelloOk,
    JoinGroup,
    JoinGroupResult,
    Pull,
    PullResult,
    Query,
    QueryResult,
    Request,
    Reschedule,
    SendBatch,
    SendBatchResult,
    Stats,
    StatsResult,
)
from delayd.protocol.frames import DEFAULT_MAX_FRAME_SIZE
from delayd.stoppable_listener import StoppableListener, linger
from delayd.stream_events import read_and_dispatch
from delayd.stream_writer import FrameWriter
from delayd.tls import ServerTls, peer_of
from storage.errors import StorageError

log = logging.getLogger(__name__)

SERVER_NAME = "delayd-broker"
MAX_IN_FLIGHT = 64  # held PULLs and SEND_BATCHes awaiting fsync, per connection
OUTBOX_FRAMES = 16


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
    (delayd.listen: bound before recovery), and serve until cancelled.

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
    tls: ServerTls | None = None,
) -> StoppableListener[BrokerConnection]:
    """The broker's listener with a graceful stop: ``serve`` it as serve_broker does,
    then ``stop(grace_s)`` answers every SEND_BATCH appended before closing (a held
    PULL is dropped: nothing is committed by it) — delayd.stoppable_listener. ``gate``:
    its cap and counts (for /metrics); by default one of the broker's
    ``connection_limits``. ``tls``: serve over TLS (delayd.tls)."""
    if gate is None:
        gate = ConnectionGate("broker", broker.config.connection_limits)
    # The connections count their protocol errors on the gate that admitted them.
    counted = gate

    def connection(stream: trio.abc.Stream) -> BrokerConnection:
        return BrokerConnection(broker, stream, token, max_frame_size, counted)

    return StoppableListener("the broker", connection, gate, tls)


class BrokerConnection:
    """One client connection; see the module docstring."""

    def __init__(
        self,
        broker: Broker,
        stream: trio.abc.Stream,
        token: str | None,
        max_frame_size: int,
        gate: ConnectionGate,
    ) -> None:
        self.broker = broker
        self.gate = gate
        self.stream = stream
        self.conn = Connection(SERVER, token=token, max_frame_size=max_frame_size)
        self._writer = FrameWriter(stream, OUTBOX_FRAMES)
        self._slots = trio.Semaphore(MAX_IN_FLIGHT)
        self._unacked: AnswerQueue[SendBatchResult] = AnswerQueue()  # appended, not answered
        self._cancel = trio.CancelScope()
        self._read_scope = trio.CancelScope()
        self._stopping = False
        self.peer = peer_of(stream)

    async def run(self) -> None:
        try:
            with self._cancel:
                async with trio.open_nursery() as outer:
                    outer.start_soon(self._write_loop)
                    async with trio.open_nursery() as acks:
                        await acks.start(self._ack_loop)
                        async with trio.open_nursery() as requests:
                            final = None
                            with self._read_scope:
                                final = await self._read_loop(requests)
                            if not self._stopping:  # EOF, a protocol error: nobody to answer
                                acks.cancel_scope.cancel()
                            requests.cancel_scope.cancel()  # held PULLs commit nothing
                        self._unacked.close()  # the acker ends once all are answered
                    if final is not None:
                        with contextlib.suppress(trio.BrokenResourceError):
                            await self._writer.send(final)
                    self._writer.close()
            if self._stopping and not self._writer.broken:
                await linger(self.stream)  # FIN after the last answer, not RST
        finally:
            self.broker.connection_closed(self)
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    def stop_reading(self) -> None:
        """Take no more requests; answer the SEND_BATCHes appended, then close."""
        self._stopping = True
        self._read_scope.cancel()

    async def _write_loop(self) -> None:
        await self._writer.run()
        if self._writer.broken:
            self._cancel.cancel()  # the peer is gone: stop reading and drop answers

    async def _read_loop(self, requests: trio.Nursery) -> bytes | None:
        """Parse and dispatch until EOF (None) or a protocol error (the closing frame)."""

        async def dispatch(event: Event) -> None:
            await self._dispatch(event, requests)

        return await read_and_dispatch(self.stream, self.conn, self.peer, dispatch, self.gate)

    async def _dispatch(self, event: Event, requests: trio.Nursery) -> None:
        broker = self.broker
        rid = event.request_id
        try:
            if isinstance(event, Hello):
                await self._answer(
                    HelloOk(
                        self.conn.protocol_version or 1,
                        SERVER_NAME,
                        self.conn.max_frame_size,
                        request_id=rid,
                    )
                )
            elif isinstance(event, SendBatch):
                await acquire(self._slots)  # released by the acker once answered
                try:
                    await broker.store.make_room()
                    results = broker.append_batch(event.messages, broker.clock(), event.encoded)
                except BaseException:
                    self._slots.release()
                    raise
                self._unacked.append(SendBatchResult(results, request_id=rid))
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
                if event.durable:
                    await self._spawn(requests, self._commit_durable, event)
                else:
                    await self._answer(CommitOffsetOk(request_id=rid))
            elif isinstance(event, JoinGroup):
                now = broker.monotonic_ms()
                queues = broker.join(event.group, event.subject, event.consumer_id, self, now)
                await self._answer(JoinGroupResult(queues, request_id=rid))
            elif isinstance(event, Heartbeat):
                now = broker.monotonic_ms()
                queues = broker.heartbeat(event.group, event.subject, event.consumer_id, self, now)
                await self._answer(HeartbeatResult(queues, request_id=rid))
            elif isinstance(event, Query):
                found = broker.query(event.subject, message_id=event.message_id, key=event.key)
                await self._answer(QueryResult(found, request_id=rid))
            elif isinstance(event, Stats):
                await self._answer(StatsResult(broker.stats(), request_id=rid))
            elif isinstance(event, (Cancel, CancelBatch, Reschedule)):
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
        except Exception as exc:  # one bad request must not end the broker
            await self._answer(self._error_for(exc, event))

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

    async def _ack_loop(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Answer appended SEND_BATCHes once the flush policy allows, in append order.

        One wait covers every batch appended before it (wait_durable promises exactly
        that), so a group commit costs one wake-up here, not one task per batch.
        """
        task_status.started()
        while (ready := await self._unacked.take_all()) is not None:
            try:
                await self.broker.store.wait_durable()
            except StorageError as exc:
                log.error("commitlog failure, batches from %s not acknowledged: %s", self.peer, exc)
                for result in ready:
                    reason = f"storage failure: {exc}"[: Error.MAX_REASON_LENGTH]
                    await self._answer(
                        Error(ErrorCode.INTERNAL, reason, request_id=result.request_id)
                    )
                    self._slots.release()
                continue
            for result in ready:
                await self._answer(result)
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
        await self._answer(answer)

    async def _commit_durable(self, event: CommitOffset) -> None:
        """Answer a durable COMMIT_OFFSET once offsets.json holds it (a task, so the
        requests behind it are not held up by the write)."""
        try:
            await self.broker.make_offsets_durable()
            answer: Event = CommitOffsetOk(request_id=event.request_id)
        except Exception as exc:
            answer = self._error_for(exc, event)
        await self._answer(answer)

    def _error_for(self, exc: Exception, event: Request) -> Error:
        rid = event.request_id
        if isinstance(exc, RejectedError):
            code = exc.code if isinstance(exc.code, ErrorCode) else ErrorCode.INVALID_REQUEST
            return Error(code, exc.reason[: Error.MAX_REASON_LENGTH], request_id=rid)
        if isinstance(exc, StorageError):
            log.error("storage failure serving %s from %s: %s", event, self.peer, exc)
        else:
            log.exception("internal error serving %s from %s", type(event).__name__, self.peer)
        reason = f"internal error: {type(exc).__name__}: {exc}"
        return Error(ErrorCode.INTERNAL, reason[: Error.MAX_REASON_LENGTH], request_id=rid)

    async def _answer(self, event: Event) -> None:
        """Encode and queue one answer; dropped when the connection is already closed."""
        try:
            data = self.conn.send(event)
        except ConnectionClosedError:
            return
        except LocalProtocolError as exc:
            # E.g. a PULL_RESULT larger than the frame limit: answer the request anyway.
            log.error("cannot send %s to %s: %s", type(event).__name__, self.peer, exc)
            try:
                data = self.conn.send(
                    Error(
                        ErrorCode.INTERNAL,
                        f"answer not encodable: {exc}"[: Error.MAX_REASON_LENGTH],
                        request_id=event.request_id,
                    )
                )
            except (ConnectionClosedError, LocalProtocolError):
                return
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._writer.send(data)
