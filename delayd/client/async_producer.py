"""The async producer, on anyio: works under trio and under asyncio.

::

    async with delayd.open_producer("127.0.0.1:20811") as producer:
        receipt = await producer.send("orders", b"...", delay_ms=30_000)

Several ``send``/``send_batch`` calls may run at once (from different tasks) over the one
connection; each SEND_BATCH frame is its own request, so the server's group commit can
acknowledge several with one fsync.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar, Unpack

import anyio
import anyio.abc

from delayd.client import _calls as calls
from delayd.client._async_session import AsyncSession
from delayd.client._backoff import Backoff
from delayd.client._due import reschedule_due_ms
from delayd.client._messages import SendOptions, build_message, coerce_batch, split_frames
from delayd.client._routing import RESEND_WINDOW_S
from delayd.client._task_group import background_task_group, run_all
from delayd.client.cancel_receipt import CancelReceipt, RescheduleReceipt, check_message_ids
from delayd.client.receipt import Receipt, still_busy, stored_or_raise
from delayd.errors import (
    BusyError,
    ConnectionClosedError,
    DelaydTimeout,
    NotLeaderError,
    UnreachableError,
)
from delayd.group_address import GroupAddress, parse_group_address
from delayd.protocol import Message, SendBatchResult
from delayd.timestamps import wall_ms
from delayd.tls import ClientTls
from delayd.version import __version__

CLIENT_NAME = f"delayd-python-async/{__version__}"
T = TypeVar("T")


class AsyncProducer:
    """Sends messages to a broker or to the delay server; made by ``open_producer``.

    ``timeout_s`` bounds every call, reconnection and retries included (DelaydTimeout).
    A message refused as BUSY is sent again up to ``busy_retries`` times with back-off.
    """

    def __init__(
        self,
        session: AsyncSession,
        *,
        timeout_s: float,
        busy_retries: int,
        busy_backoff: Backoff | None = None,
    ) -> None:
        self._session = session
        self.addr = session.addr
        self.timeout_s = timeout_s
        self.busy_retries = busy_retries
        self._busy_backoff = busy_backoff or Backoff(initial_s=0.01, max_s=1.0)
        self._closed = False

    async def send(
        self, subject: str, body: bytes | str, **options: Unpack[SendOptions]
    ) -> Receipt:
        """Send one message and wait until the server has stored it durably.

        ``options`` (SendOptions): when it is due, ``at`` an aware datetime or ``delay``
        a timedelta after the server receives it, or the same in milliseconds, ``at_ms``
        (epoch ms UTC) or ``delay_ms`` (at most one of the four; none: not delayed; a
        naive datetime, a negative delay or two times raise ValueError, a time of the
        wrong type TypeError, each naming the argument); ``message_id``, ``key``,
        ``properties``. Returns the receipt
        (``message_id``; ``due_ms`` and ``sequence`` from the delay server).

        Raises RejectedError when the server refuses the message (its ``code`` and
        ``reason`` say why), BusyError when it stayed busy through the retries,
        DelaydTimeout when the whole call took longer than ``timeout_s``.
        """
        (receipt,) = await self.send_batch([build_message(subject, body, **options)])
        return stored_or_raise(receipt, self.addr, self.busy_retries)

    async def send_batch(
        self, messages: Iterable[Message | Mapping[str, Any] | tuple[str, bytes]]
    ) -> list[Receipt]:
        """Send several messages; one receipt per message, in order, refusals included.

        Items are ``delayd.protocol.Message``, dicts of ``send`` arguments, or
        ``(subject, body)`` pairs. Nothing is raised for refused messages: check
        ``receipt.ok`` (BUSY receipts are those still busy after the retries). Raises
        DelaydTimeout after ``timeout_s``, ValueError for malformed items, and
        RejectedError / ProtocolError when the connection itself is refused.
        """
        batch = coerce_batch(messages)
        if self._closed:
            raise ConnectionClosedError("the producer is closed")
        if not batch:
            return []
        with anyio.move_on_after(self.timeout_s):
            frames = split_frames(batch)
            results: list[list[Receipt]] = [[] for _ in frames]

            async def one(index: int) -> None:
                results[index] = await self._send_frame(frames[index])

            jobs = [functools.partial(one, index) for index in range(len(frames))]
            await run_all(jobs, stop_on_error=True)
            return [receipt for part in results for receipt in part]
        self._session.abort()
        raise self._session.took_too_long(f"sending {len(batch)} message(s)", self.timeout_s)

    async def _send_frame(self, messages: list[Message]) -> list[Receipt]:
        """Send one SEND_BATCH, again after a lost connection or to the leader a
        NOT_LEADER answer names, and BUSY messages again.

        Resending is safe because the ids are the same and the server drops ids it has
        stored already (answering DUPLICATE, which is success).
        """
        receipts: list[Receipt | None] = [None] * len(messages)
        todo = list(range(len(messages)))
        busy_rounds = 0
        while todo:
            link = await self._session.link()
            pending = [messages[i] for i in todo]
            try:
                response = await link.request(calls.send_batch(pending))
            except ConnectionClosedError as exc:
                self._session.lost(link, exc)
                continue
            except NotLeaderError as exc:
                self._session.redirected(link, exc)  # the same ids again, at the leader
                continue
            except BusyError as exc:
                # The whole request was refused as busy (or the server is stopping).
                self._session.last_problem = exc
                busy = list(todo)
            else:
                assert isinstance(response, SendBatchResult)
                self._session.succeeded()
                busy = []
                for index, result in zip(todo, response.results, strict=True):
                    receipt = Receipt.from_result(messages[index].message_id, result)
                    receipts[index] = receipt
                    if result.code.is_retryable:  # BUSY, or a refusal that may pass later
                        busy.append(index)
            if busy:
                busy_rounds += 1
                if busy_rounds > self.busy_retries:
                    still_busy(receipts, messages, busy)
                    break
                await anyio.sleep(self._busy_backoff.next_delay())
            todo = busy
        return [r for r in receipts if r is not None]

    async def cancel(self, message_id: str) -> CancelReceipt:
        """Cancel the delayed message ``message_id`` (delay server only).

        Returns once the server's answer is definite and durable: ``outcome`` is
        CANCELLED (it will not be delivered), ALREADY_DELIVERED (``dispatched_ms`` says
        when it was handed to a broker) or UNKNOWN. Sent again after a lost connection
        (a second cancel of a cancelled message answers CANCELLED). Raises
        DelaydTimeout after ``timeout_s``, ValueError for an empty id.
        """
        return await self._call(calls.cancel(message_id))

    async def cancel_many(self, message_ids: Iterable[str]) -> list[CancelReceipt]:
        """Cancel several delayed messages: one receipt per id, in order, each as
        ``cancel``'s. Sent as CANCEL_BATCH frames of up to CANCEL_BATCH_IDS ids, all at
        once over the connection (the server answers each with one fsync pair), each
        sent again after a lost connection. Raises ValueError for a bad id (before
        sending anything), DelaydTimeout after ``timeout_s``."""
        return await self._call_frames(calls.cancel_batches(message_ids))

    async def held(self, message_ids: Iterable[str]) -> list[int | None]:
        """For each id, the due time (epoch ms) of the message the delay server holds
        with it — what a send of the id would be answered DUPLICATE with — or None;
        read-only, nothing is stored. HELD_IDS frames of up to CANCEL_BATCH_IDS ids, all
        at once. Raises ValueError for a bad id, RejectedError (UNSUPPORTED) for a
        server older than protocol version 3, DelaydTimeout after ``timeout_s``."""
        return await self._call_frames(calls.held_batches(check_message_ids(message_ids)))

    async def _call_frames(self, frames: list[calls.Call[list[T]]]) -> list[T]:
        """``_call`` of every frame at once; their answers joined, in order."""
        answers: list[list[T]] = [[] for _ in frames]

        async def one(index: int) -> None:
            answers[index] = await self._call(frames[index])

        jobs = [functools.partial(one, index) for index in range(len(frames))]
        await run_all(jobs, stop_on_error=True)
        return [item for frame_answers in answers for item in frame_answers]

    async def reschedule(
        self,
        message_id: str,
        *,
        at: datetime | None = None,
        delay: timedelta | None = None,
        at_ms: int | None = None,
        delay_ms: int | None = None,
    ) -> RescheduleReceipt:
        """Move the delayed message ``message_id`` to ``at`` (an aware datetime) or
        ``at_ms`` (epoch ms UTC), or to ``delay`` (a timedelta) or ``delay_ms`` from now
        (this machine's clock); it keeps its id and body and is delivered at the new time
        instead of the old one — never both, never neither.

        ``outcome``: RESCHEDULED, ALREADY_DELIVERED (too late; ``dispatched_ms``),
        UNKNOWN (no pending message with that id), DELAY_TOO_LONG (beyond the server's
        max_delay: refused, never clamped). A time in the past means "now". Raises
        ValueError unless exactly one time is given, or for a naive datetime or a negative
        delay; TypeError for a time of the wrong type; DelaydTimeout after ``timeout_s``.
        """
        due_ms = reschedule_due_ms(wall_ms(), at, delay, at_ms, delay_ms)
        return await self._call(calls.reschedule(message_id, due_ms))

    async def _call(self, call: calls.Call[T]) -> T:
        """One request, sent again after a lost connection, within ``timeout_s``."""
        if self._closed:
            raise ConnectionClosedError("the producer is closed")
        with anyio.move_on_after(self.timeout_s):
            while True:
                link = await self._session.link()
                call.check_version(link.protocol_version, self.addr)
                try:
                    response = await link.request(call.build)
                except ConnectionClosedError as exc:
                    self._session.lost(link, exc)
                    continue
                except NotLeaderError as exc:
                    self._session.redirected(link, exc)
                    continue
                self._session.succeeded()
                return call.finish(response)
        self._session.abort()
        raise self._session.took_too_long(call.what, self.timeout_s)

    async def aclose(self) -> None:
        """Close the connection; later calls raise ConnectionClosedError."""
        self._closed = True
        self._session.close()


@asynccontextmanager
async def open_producer(
    addr: str,
    *,
    token: str | None = None,
    tls: ClientTls | None = None,
    timeout_s: float = 10.0,
    busy_retries: int = 5,
    client_name: str = CLIENT_NAME,
    retry_first_connect: bool = True,
    resend_window_s: float = RESEND_WINDOW_S,
) -> AsyncIterator[AsyncProducer]:
    """An async producer connected to ``addr``, closed on exit: ``"host:port"``, a
    group's members ``"h1:p1,h2:p2"`` or ``"etcd://host:port/GROUP"`` (the group's leader
    is found, and followed across a failover: docs/clients.md, "Addresses"), or every
    delay group of a cluster, ``"etcd://host:port/[CLUSTER/]*"``: messages are spread
    over them by id (an AsyncClusterProducer: docs/cluster.md, "Routing by message id";
    it reads the cluster's registry before the body runs, and connects to each group
    when it first sends there).

    Connects (HELLO, with ``token`` when given; over TLS with ``tls``) before the body
    runs, retrying with back-off for up to ``timeout_s`` — or, with
    ``retry_first_connect=False``, raising UnreachableError at once when that
    connection cannot be made. Raises ValueError for a malformed ``addr``,
    RejectedError for a wrong token, TlsError for a certificate refused (by either
    side) or a TLS file that cannot be used, DelaydTimeout when the server cannot be
    reached.

    ``resend_window_s`` (a cluster address only; default one day): an id sent again up
    to this long after its first send is answered DUPLICATE even when the cluster's
    active delay groups changed in between, at the cost of asking the groups that may
    hold it first (docs/cluster.md, "A resend of the same id ..."); 0 asks none.
    ValueError when negative.
    """
    target = parse_group_address(addr)
    if target.whole_cluster:
        async with _open_cluster_producer(
            target, token=token, tls=tls, timeout_s=timeout_s, busy_retries=busy_retries,
            client_name=client_name, retry_first_connect=retry_first_connect,
            resend_window_s=resend_window_s,
        ) as producer:  # fmt: skip
            yield producer
        return
    async with background_task_group() as tg:
        session = AsyncSession(addr, token=token, client_name=client_name, task_group=tg, tls=tls)
        session.retry_first_connect = retry_first_connect
        producer = AsyncProducer(session, timeout_s=timeout_s, busy_retries=busy_retries)
        try:
            with anyio.move_on_after(timeout_s) as scope:
                await session.link()
            if scope.cancelled_caught:
                raise DelaydTimeout(
                    f"could not connect to {addr} within {timeout_s} s "
                    f"({session.describe_problem()})"
                )
            yield producer
        finally:
            await producer.aclose()


@asynccontextmanager
async def _open_cluster_producer(
    target: GroupAddress, *, timeout_s: float, retry_first_connect: bool, **options: Any
) -> AsyncIterator[AsyncProducer]:
    """open_producer of a whole cluster: the registry read before the body runs
    (retried for ``timeout_s`` unless ``retry_first_connect`` is False)."""
    from delayd.client._cluster_producer import AsyncClusterProducer

    async with background_task_group() as tg:
        producer = AsyncClusterProducer(
            target, task_group=tg, timeout_s=timeout_s,
            retry_first_connect=retry_first_connect, **options,
        )  # fmt: skip
        try:
            with anyio.move_on_after(timeout_s) as scope:
                while True:
                    try:
                        await producer.delay_groups()
                        break
                    except UnreachableError:
                        if not retry_first_connect:
                            raise
                        await anyio.sleep(0.2)
            if scope.cancelled_caught:
                raise DelaydTimeout(f"could not read the groups of {target} within {timeout_s} s")
            yield producer
        finally:
            await producer.aclose()
