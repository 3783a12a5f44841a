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

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any

from delayd import __version__
from delayd.client._backoff import Backoff
from delayd.client._blocking_session import BlockingSession
from delayd.client._messages import (
    MAX_FRAME_MESSAGES,
    build_message,
    coerce_batch,
    split_frames,
)
from delayd.client.cancel_receipt import (
    CANCEL_BATCH_IDS,
    CancelReceipt,
    RescheduleReceipt,
    batch_receipts,
    check_message_id,
    check_message_ids,
    reschedule_at_ms,
)
from delayd.client.receipt import Receipt
from delayd.errors import (
    BusyError,
    ConnectionClosedError,
    DelaydError,
    DelaydTimeout,
    RejectedError,
)
from delayd.protocol import (
    Cancel,
    CancelBatch,
    CancelBatchResult,
    CancelResult,
    Message,
    Reschedule,
    RescheduleResult,
    Response,
    ResultCode,
    SendBatch,
    SendBatchResult,
)
from delayd.tls import ClientTls

CLIENT_NAME = f"delayd-python-blocking/{__version__}"


class Producer:
    """Sends messages to a broker or to the delay server at ``addr`` (``"host:port"``).

    Connects on ``with`` (or on the first call). ``timeout_s`` bounds every call,
    reconnection and retries included (DelaydTimeout); BUSY messages are sent again up
    to ``busy_retries`` times with back-off. ``tls``: connect over TLS (a CA file,
    and a certificate and key for mutual TLS; delayd.tls.ClientTls). Raises ValueError
    for a malformed ``addr``, TlsError for a TLS file that cannot be used, and on a
    call for a certificate the client refused.
    """

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
    ) -> None:
        self._session = BlockingSession(addr, token=token, client_name=client_name, tls=tls)
        self.addr = addr
        self.timeout_s = timeout_s
        self.busy_retries = busy_retries
        self.max_frame_messages = max_frame_messages
        self.max_in_flight = max_in_flight
        self._busy_backoff = Backoff(initial_s=0.01, max_s=1.0)
        self._lock = threading.Lock()
        self._closed = False

    def __enter__(self) -> Producer:
        self.connect()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def connect(self) -> None:
        """Connect now rather than on the first send (DelaydTimeout, RejectedError)."""
        with self._lock:
            self._check_open()
            self._session.link(time.monotonic() + self.timeout_s)

    def close(self) -> None:
        """Close the connection; later calls raise ConnectionClosedError."""
        with self._lock:
            self._closed = True
            self._session.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionClosedError("the producer is closed")

    def send(
        self,
        subject: str,
        body: bytes | str,
        *,
        at_ms: int | None = None,
        delay_ms: int | None = None,
        message_id: str | None = None,
        key: str | None = None,
        properties: Mapping[str, str] | None = None,
    ) -> Receipt:
        """Send one message and wait until the server has stored it durably.

        Arguments and errors as ``AsyncProducer.send``: RejectedError for a refusal,
        BusyError when the server stayed busy, DelaydTimeout after ``timeout_s``,
        ValueError for ``at_ms`` together with ``delay_ms``.
        """
        message = build_message(
            subject,
            body,
            at_ms=at_ms,
            delay_ms=delay_ms,
            message_id=message_id,
            key=key,
            properties=properties,
        )
        (receipt,) = self.send_batch([message])
        if receipt.code.is_retryable:  # BUSY, or another refusal that may pass later
            raise BusyError(
                f"{self.addr} stayed busy through {self.busy_retries} retries: "
                f"{receipt.reason} ({receipt.code.name})"
            )
        if not receipt.ok:
            raise RejectedError(receipt.code, receipt.reason)
        return receipt

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
        check_message_id(message_id)
        result = self._request(lambda rid: Cancel(message_id, request_id=rid))
        assert isinstance(result, CancelResult)
        return CancelReceipt.from_result(message_id, result)

    def cancel_many(self, message_ids: Iterable[str]) -> list[CancelReceipt]:
        """Cancel several delayed messages; as ``AsyncProducer.cancel_many`` (frames
        pipelined, ``max_in_flight`` at a time)."""
        ids = check_message_ids(message_ids)
        step = CANCEL_BATCH_IDS
        frames = [tuple(ids[i : i + step]) for i in range(0, len(ids), step)]
        answers: dict[int, list[CancelReceipt]] = {}

        def on_answer(index: int, answer: object) -> None:
            if isinstance(answer, DelaydError):
                raise answer
            assert isinstance(answer, CancelBatchResult)
            answers[todo[index]] = batch_receipts(frames[todo[index]], answer)

        deadline = time.monotonic() + self.timeout_s
        todo = list(range(len(frames)))
        with self._lock:
            self._check_open()
            while todo:
                link = self._session.link(deadline)
                builds = [lambda rid, f=frames[i]: CancelBatch(f, request_id=rid) for i in todo]
                try:
                    link.pipeline(builds, deadline, on_answer=on_answer, window=self.max_in_flight)
                except ConnectionClosedError as exc:
                    self._session.lost(exc)  # send the unanswered frames again
                    todo = [i for i in todo if i not in answers]
                    continue
                except DelaydTimeout:
                    self._session.lost(DelaydTimeout("a cancel timed out"))
                    raise DelaydTimeout(
                        f"cancelling {len(ids)} message(s) at {self.addr} took over "
                        f"{self.timeout_s} s ({self._session.describe_problem()})"
                    ) from None
                self._session.succeeded()
                todo = []
        return [receipt for index in range(len(frames)) for receipt in answers[index]]

    def reschedule(
        self, message_id: str, *, at_ms: int | None = None, delay_ms: int | None = None
    ) -> RescheduleReceipt:
        """Move a delayed message to a new time; as ``AsyncProducer.reschedule``."""
        check_message_id(message_id)
        due_ms = reschedule_at_ms(at_ms, delay_ms)
        result = self._request(lambda rid: Reschedule(message_id, due_ms, request_id=rid))
        assert isinstance(result, RescheduleResult)
        return RescheduleReceipt.from_result(message_id, due_ms, result)

    def _request(self, build) -> Response:
        """One request, sent again after a lost connection, within ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        with self._lock:
            self._check_open()
            while True:
                link = self._session.link(deadline)
                try:
                    response = link.request(build, deadline)
                except ConnectionClosedError as exc:
                    self._session.lost(exc)
                    continue
                except DelaydTimeout:
                    self._session.lost(DelaydTimeout("a request timed out"))
                    raise DelaydTimeout(
                        f"no answer from {self.addr} within {self.timeout_s} s "
                        f"({self._session.describe_problem()})"
                    ) from None
                self._session.succeeded()
                return response

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
                self._session.lost(DelaydTimeout("a send timed out"))
                raise DelaydTimeout(
                    f"sending {len(batch)} message(s) to {self.addr} took over "
                    f"{self.timeout_s} s ({self._session.describe_problem()})"
                ) from None
            self._session.succeeded()
            todo = round_.unfinished()
            if todo:
                busy_rounds += 1
                if busy_rounds > self.busy_retries:
                    for index in todo:
                        if receipts[index] is None:
                            receipts[index] = Receipt(
                                batch[index].message_id, ResultCode.BUSY, "server busy"
                            )
                    break
                delay = self._busy_backoff.next_delay()
                if time.monotonic() + delay >= deadline:
                    raise DelaydTimeout(
                        f"{self.addr} stayed busy for {self.timeout_s} s; "
                        f"{len(todo)} message(s) not stored"
                    )
                time.sleep(delay)
        return [r for r in receipts if r is not None]


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
        self._answered: set[int] = set()  # frames answered

    def builds(self) -> list[Callable[[int], SendBatch]]:
        return [lambda rid, f=frame: SendBatch(f, request_id=rid) for frame in self._frames]

    def on_answer(self, frame_index: int, answer: object) -> None:
        self._answered.add(frame_index)
        indexes = self._indexes[frame_index]
        if isinstance(answer, BusyError):
            self._again.extend(indexes)  # the whole frame was refused as busy
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
