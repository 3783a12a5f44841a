"""The requests a producer makes and what it makes of their answers, sans-I/O.

One copy for the async and the blocking producer, which differ only in how they wait:
a Call says what to send (``build``, given the request id) and turns the server's
answer into what the caller gets (``finish``); ``what`` names it in time-out messages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from delayd.client.cancel_receipt import (
    CANCEL_BATCH_IDS,
    CancelReceipt,
    RescheduleReceipt,
    batch_receipts,
    check_message_id,
    check_message_ids,
)
from delayd.errors import RejectedError, RemoteProtocolError
from delayd.protocol import (
    HELD_IDS_VERSION,
    MIN_PROTOCOL_VERSION,
    Cancel,
    CancelBatch,
    ErrorCode,
    HeldIds,
    HeldIdsResult,
    Message,
    Request,
    Reschedule,
    Response,
    SendBatch,
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    """One request and the reading of its answer."""

    build: Callable[[int], Request]
    finish: Callable[[Response], T]
    what: str  # "cancelling 'order-17'"
    min_version: int = MIN_PROTOCOL_VERSION  # the protocol version the request needs

    def check_version(self, protocol_version: int, addr: str) -> None:
        """Raise RejectedError (UNSUPPORTED) when the connection's negotiated
        ``protocol_version`` is older than the request: the server would answer
        UNKNOWN_COMMAND and close the connection."""
        if protocol_version < self.min_version:
            raise RejectedError(
                ErrorCode.UNSUPPORTED,
                f"{addr} speaks protocol version {protocol_version}; {self.what} needs "
                f"{self.min_version} or later: upgrade delayd there",
            )


def cancel(message_id: str) -> Call[CancelReceipt]:
    """CANCEL of ``message_id``; ValueError for an id no message can have."""
    check_message_id(message_id)
    return Call(
        lambda request_id: Cancel(message_id, request_id=request_id),
        lambda answer: CancelReceipt.from_result(message_id, answer),
        f"cancelling {message_id!r}",
    )


def cancel_batches(message_ids: object) -> list[Call[list[CancelReceipt]]]:
    """CANCEL_BATCHes of the ids of a ``cancel_many`` argument, CANCEL_BATCH_IDS to a
    frame; ValueError for a bad id, before anything is sent."""
    ids = check_message_ids(message_ids)
    frames = [tuple(ids[i : i + CANCEL_BATCH_IDS]) for i in range(0, len(ids), CANCEL_BATCH_IDS)]
    return [_cancel_batch(frame) for frame in frames]


def _cancel_batch(ids: tuple[str, ...]) -> Call[list[CancelReceipt]]:
    return Call(
        lambda request_id: CancelBatch(ids, request_id=request_id),
        lambda answer: batch_receipts(ids, answer),
        f"cancelling {len(ids)} message(s)",
    )


def held_batches(message_ids: list[str]) -> list[Call[list[int | None]]]:
    """HELD_IDS frames of ``message_ids`` (checked by the caller), CANCEL_BATCH_IDS to a
    frame: each answers, per id, the due time of the message the server holds with it,
    or None."""
    frames = [
        tuple(message_ids[i : i + CANCEL_BATCH_IDS])
        for i in range(0, len(message_ids), CANCEL_BATCH_IDS)
    ]
    return [_held(frame) for frame in frames]


def _held(ids: tuple[str, ...]) -> Call[list[int | None]]:
    def finish(answer: Response) -> list[int | None]:
        assert isinstance(answer, HeldIdsResult)
        if len(answer.due_ms) != len(ids):
            raise RemoteProtocolError(
                f"HELD_IDS of {len(ids)} ids answered with {len(answer.due_ms)} results"
            )
        return list(answer.due_ms)

    return Call(
        lambda request_id: HeldIds(ids, request_id=request_id),
        finish,
        f"asking whether it holds {len(ids)} id(s)",
        HELD_IDS_VERSION,
    )


def reschedule(message_id: str, due_ms: int) -> Call[RescheduleReceipt]:
    """RESCHEDULE of ``message_id`` to ``due_ms`` (epoch ms; delayd.client._due turns the
    caller's time into it); ValueError for a bad id."""
    check_message_id(message_id)
    return Call(
        lambda request_id: Reschedule(message_id, due_ms, request_id=request_id),
        lambda answer: RescheduleReceipt.from_result(message_id, due_ms, answer),
        f"rescheduling {message_id!r}",
    )


def send_batch(messages: list[Message]) -> Callable[[int], SendBatch]:
    """The SEND_BATCH of ``messages``, to build with its request id (its answer is read
    per message, with BUSY ones sent again, by the producers)."""
    return lambda request_id: SendBatch(messages, request_id=request_id)
