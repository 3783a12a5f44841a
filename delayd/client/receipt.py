"""Receipt: what a producer learns about one message it sent."""

from __future__ import annotations

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
        from_delay_server = result.due_ms is not None
        return cls(
            message_id,
            result.code,
            result.reason,
            due_ms=result.due_ms,
            sequence=result.queue_offset if from_delay_server else None,
            store_ms=result.store_ms,
            commitlog_offset=result.commitlog_offset,
            queue=result.queue,
            queue_offset=result.queue_offset,  # as sent, also for code that reads the slot
        )


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
