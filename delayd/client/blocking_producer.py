"""The blocking producer: plain sockets, for ordinary synchronous code.

::

    with delayd.Producer("127.0.0.1:20811") as producer:
        receipt = producer.send("orders", b"...", delay_ms=30_000)

Thread-safe: calls from several threads take turns on the one connection (a lock). A big
``send_batch`` is cut into frames of ``max_frame_messages`` that are pipelined, up to
``max_in_flight`` at a time, so it costs about one round trip and the server's group
commit acknowledges several frames with one fsync.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, TypeVar, Unpack

from delayd.client import _calls as calls
from delayd.client._blocking_client import BlockingClient
from delayd.client._due import reschedule_due_ms
from delayd.client._messages import (
    MAX_FRAME_MESSAGES,
    SendOptions,
    build_message,
    coerce_batch,
    split_frames,
)
from delayd.client._routing import RESEND_WINDOW_S
from delayd.client.cancel_receipt import CancelReceipt, RescheduleReceipt, check_message_ids
from delayd.client.receipt import Receipt, still_busy, stored_or_raise
from delayd.errors import (
    BusyError,
    ConnectionClosedError,
    DelaydError,
    DelaydTimeout,
    NotLeaderError,
)
from delayd.group_address import parse_group_address
from delayd.protocol import Message, Response, SendBatch, SendBatchResult
from delayd.timestamps import wall_ms
from delayd.tls import ClientTls
from delayd.version import __version__

CLIENT_NAME = f"delayd-python-blocking/{__version__}"
T = TypeVar("T")


class Producer(BlockingClient):
    """Sends messages to a broker or to the delay server at ``addr`` (``"host:port"``).

    Connects on ``with`` (or on the first call). ``timeout_s`` bounds every call,
    reconnection and retries included (DelaydTimeout); BUSY messages are sent again up
    to ``busy_retries`` times with back-off. ``tls``: connect over TLS (a CA file,
    and a certificate and key for mutual TLS; delayd.tls.ClientTls). With
    ``retry_first_connect=False`` a first connection that cannot be made raises
    UnreachableError at once instead of being retried until ``timeout_s`` (later
    reconnections are retried either way). Raises ValueError for a malformed ``addr``,
    TlsError for a TLS file that cannot be used, and on a call for a certificate the
    client refused.

    ``addr`` may also name every delay group of a cluster, ``"etcd://host:port/[CLUSTER/]*"``:
    the Producer made is then a ClusterProducer, which spreads messages over the groups
    by id (docs/cluster.md, "Routing by message id"); ``resend_window_s`` is then as
    ``open_producer``'s.
    """

    def __new__(cls, addr: str, *args: Any, **kwargs: Any) -> Producer:
        if cls is Producer and _names_a_cluster(addr):
            from delayd.client._blocking_cluster_producer import ClusterProducer

            return super().__new__(ClusterProducer)
        return super().__new__(cls)

    def __init__(
        self,
        addr: str,
        *,
        token: str | None = None,
        tls: ClientTls | None = None,
        timeout_s: float = 10.0,
        busy_retries: int = 5,
        max_frame_messages: int = MAX_FRAME_MESSAGES,
        max_in_flight: int = 8,
        client_name: str = CLIENT_NAME,
        retry_first_connect: bool = True,
        resend_window_s: float = RESEND_WINDOW_S,
    ) -> None:
        # resend_window_s is a cluster's (ClusterProducer): one group has no other owner.
        super().__init__(addr, token, client_name, timeout_s, retry_first_connect, tls)
        self.busy_retries = busy_retries
        self.max_frame_messages = max_frame_messages
        self.max_in_flight = max_in_flight

    def connect(self) -> None:
        """Connect now rather than on the first send (DelaydTimeout, RejectedError,
        UnreachableError)."""
        with self._lock:
            self._check_open()
            self._session.link(time.monotonic() + self.timeout_s)

    def close(self) -> None:
        """Close the connection; later calls raise ConnectionClosedError."""
        with self._lock:
            self._closed = True
            self._session.close()

    def send(self, subject: str, body: bytes | str, **options: Unpack[SendOptions]) -> Receipt:
        """Send one message and wait until the server has stored it durably.

        Options (SendOptions) and errors as ``AsyncProducer.send``: RejectedError for a
        refusal, BusyError when the server stayed busy, DelaydTimeout after
        ``timeout_s``, ValueError or TypeError (naming it) for a bad ``at``/``delay``/``at_ms``/
        ``delay_ms``.
        """
        (receipt,) = self.send_batch([build_message(subject, body, **options)])
        return stored_or_raise(receipt, self.addr, self.busy_retries)

    def send_batch(
        self, messages: Iterable[Message | Mapping[str, Any] | tuple[str, bytes]]
    ) -> list[Receipt]:
        """Send several messages; one receipt per message, in order, refusals included.

        Items and errors as ``AsyncProducer.send_batch``.
        """
        batch = coerce_batch(messages)
        if not batch:
            return []
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            self._check_open()
            return self._send(batch, deadline)

    def cancel(self, message_id: str) -> CancelReceipt:
        """Cancel a delayed message; as ``AsyncProducer.cancel``."""
        return self._call(calls.cancel(message_id))

    def cancel_many(self, message_ids: Iterable[str]) -> list[CancelReceipt]:
        """Cancel several delayed messages; as ``AsyncProducer.cancel_many`` (frames
        pipelined, ``max_in_flight`` at a time)."""
        batches = calls.cancel_batches(message_ids)
        answers: dict[int, list[CancelReceipt]] = {}

        def on_answer(index: int, answer: Response | DelaydError) -> None:
            if isinstance(answer, DelaydError):
                raise answer
            answers[todo[index]] = batches[todo[index]].finish(answer)

        deadline = time.monotonic() + self.timeout_s
        todo = list(range(len(batches)))
        with self._lock:
            self._check_open()
            while todo:
                link = self._session.link(deadline)
                builds = [batches[i].build for i in todo]
                try:
                    link.pipeline(builds, deadline, on_answer=on_answer, window=self.max_in_flight)
                except ConnectionClosedError as exc:
                    self._session.lost(exc)  # send the unanswered frames again
                    todo = [i for i in todo if i not in answers]
                    continue
                except NotLeaderError as exc:
                    self._session.redirected(exc)  # the unanswered frames go to the leader
                    todo = [i for i in todo if i not in answers]
                    continue
                except DelaydTimeout:
                    what = f"cancel_many ({len(batches)} CANCEL_BATCH frame(s))"
                    raise self._timed_out(what) from None
                self._session.succeeded()
                todo = []
        return [receipt for index in range(len(batches)) for receipt in answers[index]]

    def held(self, message_ids: Iterable[str]) -> list[int | None]:
        """Which ids the delay server holds; as ``AsyncProducer.held`` (the frames one
        after another)."""
        frames = calls.held_batches(check_message_ids(message_ids))
        return [due_ms for frame in frames for due_ms in self._call(frame)]

    def reschedule(
        self,
        message_id: str,
        *,
        at: datetime | None = None,
        delay: timedelta | None = None,
        at_ms: int | None = None,
        delay_ms: int | None = None,
    ) -> RescheduleReceipt:
        """Move a delayed message to a new time; as ``AsyncProducer.reschedule``."""
        due_ms = reschedule_due_ms(wall_ms(), at, delay, at_ms, delay_ms)
        return self._call(calls.reschedule(message_id, due_ms))

    def _timed_out(self, what: str) -> DelaydTimeout:
        """The error of a call whose ``what`` ran out of ``timeout_s``; the link it
        waited on is dropped, since an answer may still come on it."""
        self._session.lost(DelaydTimeout(f"{what} timed out"))
        return self._session.took_too_long(what, self.timeout_s)

    def _call(self, call: calls.Call[T]) -> T:
        """One request, sent again after a lost connection, within ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            self._check_open()
            while True:
                link = self._session.link(deadline)
                call.check_version(link.protocol_version, self.addr)
                try:
                    response = link.request(call.build, deadline)
                except ConnectionClosedError as exc:
                    self._session.lost(exc)
                    continue
                except NotLeaderError as exc:
                    self._session.redirected(exc)
                    continue
                except DelaydTimeout:
                    raise self._timed_out(call.what) from None
                self._session.succeeded()
                return call.finish(response)

    def _send(self, batch: list[Message], deadline: float) -> list[Receipt]:
        """Send every frame; again after a lost connection (same ids, so the server
        answers DUPLICATE for those it had stored), and BUSY messages again later."""
        receipts: list[Receipt | None] = [None] * len(batch)
        todo = list(range(len(batch)))
        busy_rounds = 0
        while todo:
            round_ = _Round(batch, todo, self.max_frame_messages, receipts)
            link = self._session.link(deadline)
            try:
                link.pipeline(
                    round_.builds(), deadline, on_answer=round_.on_answer, window=self.max_in_flight
                )
            except (ConnectionClosedError, BusyError) as exc:
                # Lost with some frames unanswered: send those again on a new connection.
                self._session.lost(exc)
                todo = round_.unfinished()
                continue
            except DelaydTimeout:
                raise self._timed_out(f"sending {len(batch)} message(s)") from None
            if round_.not_leader is not None:
                # Its frames were not stored here: the same ids again, at the leader.
                self._session.redirected(round_.not_leader)
                todo = round_.unfinished()
                continue
            self._session.succeeded()
            todo = round_.unfinished()
            if todo:
                busy_rounds += 1
                if busy_rounds > self.busy_retries:
                    still_busy(receipts, batch, todo)
                    break
                delay = self._busy_backoff.next_delay()
                if time.monotonic() + delay >= deadline:
                    raise DelaydTimeout(
                        f"{self.addr} stayed busy for {self.timeout_s} s; "
                        f"{len(todo)} message(s) not stored"
                    )
                time.sleep(delay)
        return [r for r in receipts if r is not None]


def _names_a_cluster(addr: object) -> bool:
    try:
        return parse_group_address(addr).whole_cluster  # type: ignore[arg-type]
    except ValueError:
        return False  # __init__ says what is wrong with it


class _Round:
    """One pass over the messages still to send: their frames and what came back."""

    def __init__(
        self,
        batch: list[Message],
        todo: list[int],
        max_frame_messages: int,
        receipts: list[Receipt | None],
    ) -> None:
        self._batch = batch
        self._receipts = receipts
        frames = split_frames([batch[i] for i in todo], max_messages=max_frame_messages)
        self._frames = frames
        self._indexes: list[list[int]] = []  # batch indexes of each frame
        position = 0
        for frame in frames:
            self._indexes.append(todo[position : position + len(frame)])
            position += len(frame)
        self._again: list[int] = []  # BUSY: to send again
        self.not_leader: NotLeaderError | None = None  # a frame answered NOT_LEADER
        self._answered: set[int] = set()  # frames answered

    def builds(self) -> list[Callable[[int], SendBatch]]:
        return [calls.send_batch(frame) for frame in self._frames]

    def on_answer(self, frame_index: int, answer: object) -> None:
        self._answered.add(frame_index)
        indexes = self._indexes[frame_index]
        if isinstance(answer, BusyError):
            self._again.extend(indexes)  # the whole frame was refused as busy
            return
        if isinstance(answer, NotLeaderError):
            self.not_leader = answer
            self._again.extend(indexes)
            return
        if isinstance(answer, DelaydError):
            raise answer
        assert isinstance(answer, SendBatchResult)
        for index, result in zip(indexes, answer.results, strict=True):
            self._receipts[index] = Receipt.from_result(self._batch[index].message_id, result)
            if result.code.is_retryable:  # BUSY, or a refusal that may pass later
                self._again.append(index)

    def unfinished(self) -> list[int]:
        """Batch indexes to send again: BUSY ones and those of unanswered frames."""
        again = list(self._again)
        for frame_index, indexes in enumerate(self._indexes):
            if frame_index not in self._answered:
                again.extend(indexes)
        return sorted(again)
