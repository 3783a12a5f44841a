"""Receipt: what a producer learns about one message it sent."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from delayd.errors import BusyError, RejectedError
from delayd.protocol import Message, ResultCode, SendResult


@dataclass(frozen=True, slots=True)
class Receipt:
    """The server's answer about one sent message.

    ``code`` is OK or DUPLICATE (stored; ``ok`` is true) or a refusal, with ``reason``
    saying what to change. ``producer.send`` raises for refusals, so its receipts are
    always ``ok``; ``send_batch`` returns one receipt per message, refusals included.

    Times are epoch milliseconds. ``due_ms`` and ``sequence`` come from the delay server
    (the absolute due time it computed on receipt, and the message's sequence in its
    message_log, which travels in the result's ``queue_offset`` slot); a broker leaves
    them None and fills ``store_ms``, ``commitlog_offset``, ``queue`` and
    ``queue_offset`` instead. Any field the server did not send is None.
    """

    message_id: str
    code: ResultCode = ResultCode.OK
    reason: str = ""
    due_ms: int | None = None
    sequence: int | None = None
    store_ms: int | None = None
    commitlog_offset: int | None = None
    queue: int | None = None
    queue_offset: int | None = None

    @property
    def ok(self) -> bool:
        """Whether the message is stored (OK, or DUPLICATE: stored by an earlier send)."""
        return self.code.is_success

    @classmethod
    def from_result(cls, message_id: str, result: SendResult) -> Receipt:
        """The receipt for ``message_id`` from its SEND_BATCH result."""
        # The delay server sends due_ms, and its message_log sequence in the queue_offset
        # slot (docs/protocol.md, "SEND_BATCH results"); a broker sends no due_ms.
        due_ms, queue_offset = result.due_ms, result.queue_offset
        return _ReceiptBuilder(  # type: ignore[return-value]
            message_id,
            result.code,
            result.reason,
            due_ms,
            None if due_ms is None else queue_offset,
            result.store_ms,
            result.commitlog_offset,
            result.queue,
            queue_offset,  # as sent, also for code that reads the slot
        )


class _ReceiptBuilder:
    """Receipt's fields by plain stores, then the instance becomes a Receipt: a frozen
    dataclass's __init__ stores each field through object.__setattr__, and a producer
    makes one receipt per message it sends (as the protocol's _SendResultBuilder)."""

    __slots__ = Receipt.__slots__

    def __init__(
        self,
        message_id: str,
        code: ResultCode,
        reason: str,
        due_ms: int | None,
        sequence: int | None,
        store_ms: int | None,
        commitlog_offset: int | None,
        queue: int | None,
        queue_offset: int | None,
    ) -> None:
        self.message_id, self.code, self.reason = message_id, code, reason
        self.due_ms, self.sequence, self.store_ms = due_ms, sequence, store_ms
        self.commitlog_offset, self.queue, self.queue_offset = commitlog_offset, queue, queue_offset
        self.__class__ = Receipt  # type: ignore[assignment]


assert Receipt.__slots__ == tuple(f.name for f in dataclasses.fields(Receipt))


def stored_or_raise(receipt: Receipt, addr: str, busy_retries: int) -> Receipt:
    """``send``'s answer: ``receipt`` when the message is stored. Raises BusyError when
    it stayed BUSY (or another refusal that may pass later) through ``busy_retries``,
    RejectedError, with the server's reason, for any other refusal."""
    if receipt.code.is_retryable:
        raise BusyError(
            f"{addr} stayed busy through {busy_retries} retries: "
            f"{receipt.reason} ({receipt.code.name})"
        )
    if not receipt.ok:
        raise RejectedError(receipt.code, receipt.reason)
    return receipt


def still_busy(
    receipts: list[Receipt | None], messages: Sequence[Message], indexes: Sequence[int]
) -> None:
    """The BUSY retries are spent: the messages at ``indexes`` still without a receipt
    (their whole frame was refused) get a BUSY one."""
    for index in indexes:
        if receipts[index] is None:
            receipts[index] = Receipt(messages[index].message_id, ResultCode.BUSY, "server busy")
