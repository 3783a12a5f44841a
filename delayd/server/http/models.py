"""The HTTP API's request and response bodies (JSON), as pydantic models.

They are what the OpenAPI document (docs/openapi.json) describes. Shape checks only
(types, lengths, counts): the rules of intake — subject, id, delay, body size — are the
Receiver's, so an HTTP send and a binary SEND_BATCH are refused for the same reasons
with the same words (delayd.server.receiver).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

MAX_BATCH_MESSAGES = 1000  # messages in one POST /v1/batches
MAX_PULL_MESSAGES = 1000  # messages one pull asks for at most
MAX_WAIT_MS = 30_000  # a pull's long poll at most (a proxy's idle timeout is often 60 s)

# Ids, subjects, keys: the binary protocol's u16 length prefix bounds them.
Text = Annotated[str, Field(max_length=65_535)]


class _Strict(BaseModel):
    # A misspelt field ("dealy") must be refused, not silently ignored; and a value of
    # the wrong JSON type (false for a time, "5" for a count) not coerced.
    model_config = ConfigDict(extra="forbid", strict=True)


class ScheduleRequest(_Strict):
    """One message to schedule. Give at most one of ``at`` and ``delay`` (neither: due
    now), and at most one of ``body`` and ``body_base64``."""

    subject: Text = Field(description="Where it goes: ASCII letters, digits, '.', '_', '-'.")
    id: Text | None = Field(
        None,
        description="The message id, the deduplication key: send the same id again to "
        "retry safely. Made by the server (32 hex digits, time-ordered) when absent.",
    )
    key: Text | None = Field(None, description="Business key, for the broker's index.")
    properties: dict[str, str] = Field(default_factory=dict, description="String headers.")
    body: str | None = Field(None, description="The body as UTF-8 text.")
    body_base64: str | None = Field(None, description="The body as base64 (binary bodies).")
    at: int | str | None = Field(
        None,
        description="Due time: RFC 3339 with an offset (2026-11-22T10:00:00Z) or epoch "
        "milliseconds. A time in the past is delivered at once.",
        examples=["2026-11-22T10:00:00Z", 1795341600000],
    )
    delay: int | str | None = Field(
        None,
        description="Due after this long: milliseconds, or a duration with a unit "
        "(250ms, 90s, 15m, 1h30m, 7d).",
        examples=[90000, "90s", "1h30m"],
    )


class BatchRequest(_Strict):
    messages: list[ScheduleRequest] = Field(
        min_length=1, description=f"1 to {MAX_BATCH_MESSAGES} messages, scheduled in order."
    )


class Scheduled(BaseModel):
    """The answer for a message taken (durable when this is sent)."""

    id: str
    due_ms: int = Field(description="When it is due, epoch ms (UTC).")
    duplicate: bool = Field(
        description="True: a message with this id was already held; nothing new was "
        "scheduled and due_ms is the held message's."
    )


class Problem(BaseModel):
    """RFC 9457 problem details. ``code`` is the intake's result code, when it has one."""

    type: str
    title: str
    status: int
    detail: str
    code: str | None = None
    retryable: bool = False


class BatchItem(BaseModel):
    """One message of a batch: ``scheduled`` or ``problem``, never both."""

    scheduled: Scheduled | None = None
    problem: Problem | None = None


class BatchResult(BaseModel):
    results: list[BatchItem] = Field(description="One per message, in the request's order.")
    scheduled: int = Field(description="How many were taken (duplicates included).")
    refused: int


class RescheduleRequest(_Strict):
    """The new due time: exactly one of ``at`` and ``delay`` (as in ScheduleRequest)."""

    at: int | str | None = Field(None, examples=["2026-11-22T10:00:00Z", 1795341600000])
    delay: int | str | None = Field(None, examples=[90000, "90s", "1h30m"])


class Rescheduled(BaseModel):
    id: str
    due_ms: int


class Cancelled(BaseModel):
    id: str
    outcome: str = Field(description="cancelled: it will not be delivered.")


class MessageStatusBody(BaseModel):
    """Where a message is. pending: ``due_ms``; delivered: ``dispatched_ms`` and the
    broker ``group``; dead_lettered: ``dispatched_ms`` (to DLQ.<subject>); cancelled:
    ``cancelled_ms``."""

    id: str
    status: str = Field(examples=["pending", "delivered", "dead_lettered", "cancelled"])
    due_ms: int | None = None
    dispatched_ms: int | None = None
    cancelled_ms: int | None = None
    group: str | None = None


class PullRequest(_Strict):
    consumer_id: Annotated[str, Field(min_length=1, max_length=255)] = Field(
        description="This consumer's id in the group, the same on every pull. A member "
        "that does not pull for the broker's heartbeat_timeout_ms leaves the group."
    )
    max_messages: int = Field(100, ge=1, le=MAX_PULL_MESSAGES)
    wait_ms: int = Field(
        10_000, ge=0, le=MAX_WAIT_MS, description="Long poll: wait this long for a message."
    )


class Offset(_Strict):
    """Commit point of one queue: every message below ``offset`` is consumed."""

    queue: int = Field(ge=0, le=65_535)
    offset: int = Field(ge=0, le=(1 << 63) - 1)


class ConsumedMessage(BaseModel):
    id: str
    subject: str
    key: str | None
    properties: dict[str, str]
    body: str | None = Field(description="The body as text, when it is valid UTF-8.")
    body_base64: str = Field(description="The body as base64, always.")
    queue: int
    queue_offset: int
    store_ms: int | None
    due_ms: int | None
    dispatched_ms: int | None


class PullResult(BaseModel):
    messages: list[ConsumedMessage]
    commit: list[Offset] = Field(
        description="Post these to .../commit once the messages are processed."
    )


class CommitRequest(_Strict):
    offsets: list[Offset] = Field(min_length=1, max_length=65_536)
    durable: bool = Field(False, description="Answer only once the commit is on the broker's disk.")


class Committed(BaseModel):
    committed: list[Offset]
    durable: bool
