"""What cancel and reschedule return, and the one place their arguments are checked.

Shared by the async and blocking producers (I/O-free; the requests are in _calls.py).
A cancel's answer is exactly one of CANCELLED (it will not be delivered),
ALREADY_DELIVERED (with ``dispatched_ms``) or UNKNOWN (no message with that id); never
"maybe" (docs/cancel.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from delayd.errors import RemoteProtocolError
from delayd.protocol import (
    CancelBatchResult,
    CancelOutcome,
    CancelResult,
    RescheduleOutcome,
    RescheduleResult,
    Response,
)

CANCEL_BATCH_IDS = 1024  # ids per CANCEL_BATCH frame that cancel_many sends


@dataclass(frozen=True, slots=True)
class CancelReceipt:
    """The answer to ``cancel``. ``dispatched_ms`` (epoch ms) is set when the message
    had already been handed to a broker."""

    message_id: str
    outcome: CancelOutcome
    dispatched_ms: int | None = None

    @property
    def cancelled(self) -> bool:
        return self.outcome is CancelOutcome.CANCELLED

    @classmethod
    def from_result(cls, message_id: str, result: Response) -> CancelReceipt:
        """The receipt of the answer to cancel_request(message_id)."""
        assert isinstance(result, CancelResult)
        return cls(message_id, CancelOutcome(result.outcome), result.dispatched_ms)


@dataclass(frozen=True, slots=True)
class RescheduleReceipt:
    """The answer to ``reschedule``: RESCHEDULED (due at ``at_ms`` now),
    ALREADY_DELIVERED (``dispatched_ms`` set), UNKNOWN (no pending message with that
    id: never sent, or cancelled), or DELAY_TOO_LONG (past the server's max_delay:
    refused, never clamped; the message keeps its old time)."""

    message_id: str
    outcome: RescheduleOutcome
    at_ms: int
    dispatched_ms: int | None = None

    @property
    def rescheduled(self) -> bool:
        return self.outcome is RescheduleOutcome.RESCHEDULED

    @classmethod
    def from_result(cls, message_id: str, at_ms: int, result: Response) -> RescheduleReceipt:
        """The receipt of the answer to reschedule_request(message_id, at_ms)."""
        assert isinstance(result, RescheduleResult)
        return cls(message_id, RescheduleOutcome(result.outcome), at_ms, result.dispatched_ms)


def check_message_id(message_id: str) -> None:
    """Raise ValueError for an id no message can have."""
    if not isinstance(message_id, str) or not message_id:
        raise ValueError("message_id must be a non-empty string")


def check_message_ids(message_ids: object) -> list[str]:
    """The ids of a ``cancel_many`` argument, as a list; ValueError for a bad one."""
    if isinstance(message_ids, str):
        raise ValueError("cancel_many takes an iterable of ids, not one id")
    ids = list(message_ids)  # type: ignore[call-overload]
    for message_id in ids:
        check_message_id(message_id)
    return ids


def batch_receipts(ids: tuple[str, ...], result: Response) -> list[CancelReceipt]:
    """The receipts of one CANCEL_BATCH frame; RemoteProtocolError when the server
    answered another number of results than ids."""
    assert isinstance(result, CancelBatchResult)
    if len(result.results) != len(ids):
        raise RemoteProtocolError(
            f"CANCEL_BATCH of {len(ids)} ids answered with {len(result.results)} results"
        )
    return [
        CancelReceipt(message_id, CancelOutcome(outcome), dispatched_ms)
        for message_id, (outcome, dispatched_ms) in zip(ids, result.results, strict=True)
    ]
