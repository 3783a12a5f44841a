"""The HTTP API's routes: schedule, cancel, reschedule, status, and consume.

Every request goes the way a binary one goes, on the same objects:

- a send through ``IntakePath`` (the Receiver's validation, message_log, the answer
  only after the flush policy made it durable; DUPLICATE for an id already held);
- a cancel or reschedule as a tombstone, answered once replay resolved it
  (docs/cancel.md);
- a pull as a member of the consumer group: the broker assigns it queues, a pull is
  its heartbeat, and it leaves the group when it stops pulling for
  ``heartbeat_timeout_ms`` (or says so with DELETE), as a binary consumer whose
  connection closed. A binary and an HTTP consumer of one group share its queues.

docs/http.md describes the API with curl examples; /openapi.json is the contract.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Annotated, Any

import trio
from fastapi import APIRouter, Depends, FastAPI, Path, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from delayd.broker import Broker
from delayd.errors import NotLeaderError, RejectedError
from delayd.logs.message_status import MessageState, MessageStatus
from delayd.protocol import CancelOutcome, Message, RescheduleOutcome, ResultCode, SendResult
from delayd.server.http import problems
from delayd.server.http.messages import consumed, due, to_message
from delayd.server.http.models import (
    MAX_BATCH_MESSAGES,
    BatchItem,
    BatchRequest,
    BatchResult,
    Cancelled,
    CommitRequest,
    Committed,
    MessageStatusBody,
    Offset,
    Problem,
    PullRequest,
    PullResult,
    Rescheduled,
    RescheduleRequest,
    Scheduled,
    ScheduleRequest,
)
from delayd.server.http.problems import ProblemError, bad_input, refusal
from delayd.server.intake import NotAcknowledged
from storage.errors import DiskFullError, StorageError

if TYPE_CHECKING:  # server.app imports this package: types only, no cycle at run time
    from delayd.server.cancels import Answer
    from delayd.server.intake import IntakePath
    from delayd.serving.membership import Membership

log = logging.getLogger(__name__)

API_VERSION = "1"


@dataclass(frozen=True, slots=True)
class HttpMember:
    """The 'connection' an HTTP consumer is bound to in the broker's group registry:
    one per (group, subject, consumer id), closed by DELETE on its member resource."""

    group: str
    subject: str
    consumer_id: str


@dataclass(slots=True)
class Backend:
    """What the routes serve from: the delay server's intake path, its embedded broker,
    the status lookup (delayd.logs.message_status), the token of ``[server]``, and
    ``on_storage_failure``, which stops the server on a log that cannot be written (as
    the binary listener does: nothing more may be acknowledged)."""

    intake: IntakePath
    broker: Broker
    status: Callable[[str], MessageStatus]
    token: str | None
    on_storage_failure: Callable[[StorageError], None]
    # A member of a group: only while it leads does it serve /v1 (None: it runs alone).
    membership: Membership | None = None
    # Long polls under way: cancelled when the server stops, answered with what they have.
    pulls: set[trio.CancelScope] = field(default_factory=set)

    def stop_pulls(self) -> None:
        for scope in self.pulls:
            scope.cancel()


def _problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {
        status: {"model": Problem, "content": {problems.MEDIA_TYPE: {}}}
        for status in (*statuses, 400, 401, 413, 422)
    }


_bearer = HTTPBearer(auto_error=False, description="[server] token, when one is set")


def build_app(backend: Backend) -> FastAPI:
    """The ASGI application serving ``backend``."""
    app = FastAPI(
        title="delayd",
        version=API_VERSION,
        summary="Durable delayed messages: schedule, cancel, reschedule, look up, consume.",
        docs_url=None,
        redoc_url=None,
    )
    problems.install(app)

    async def authorized(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> None:
        token = backend.token
        if token is None:
            return
        given = "" if credentials is None else credentials.credentials
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise ProblemError(
                HTTPStatus.UNAUTHORIZED,
                "unauthorized",
                "this server requires 'Authorization: Bearer <token>' with the token of "
                "[server] token" + (" (the one given is wrong)" if credentials else ""),
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def leading() -> None:
        check_leading(backend)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorized), Depends(leading)])
    _scheduling_routes(v1, backend)
    _consuming_routes(v1, backend)
    app.include_router(v1)
    return app


def check_leading(backend: Backend, *, acknowledged: bool = True) -> None:
    """Raise the NOT_LEADER problem unless this server may act as its group's leader now
    (and its group acknowledged the request's records): 421 naming the leader's HTTP
    API (``leader``), or 503 while no leader is known (docs/http.md). Asked before a
    request and again before its answer, so a leader that stepped down meanwhile does
    not acknowledge."""
    membership = backend.membership
    if membership is None or (acknowledged and membership.may_lead()):
        return
    reason = membership.refusal("http")
    leader = membership.leader_address("http")
    if leader is None:
        raise ProblemError(
            HTTPStatus.SERVICE_UNAVAILABLE, "not-leader", reason, code="NOT_LEADER", retryable=True
        )
    raise ProblemError(
        HTTPStatus.MISDIRECTED_REQUEST,
        "not-leader",
        reason,
        code="NOT_LEADER",
        extra={"leader": f"http://{leader}/v1"},
    )


def stopped_leading(backend: Backend, failure: Exception) -> bool:
    """Whether ``failure`` came from the member ceasing to lead while the request was
    under way (the group did not acknowledge it, its broker follows already, or the
    follower's cut replaced what the request was writing), however far its membership
    has caught up: the answer is then NOT_LEADER (``check_leading``), never the
    failure itself."""
    membership = backend.membership
    if membership is None:
        return False
    return (
        isinstance(failure, NotLeaderError) or backend.broker.following or not membership.may_lead()
    )


def _storage_failure(backend: Backend, exc: StorageError) -> ProblemError:
    """Stop the server (``on_storage_failure``); the problem for the request."""
    backend.on_storage_failure(exc)
    detail = f"message_log failed: {exc}; the server stops (see its log)"
    return ProblemError(HTTPStatus.SERVICE_UNAVAILABLE, "storage-failure", detail)


async def _send(backend: Backend, messages: list[Message]) -> list[SendResult]:
    try:
        results = await backend.intake.send_batch(messages)
    except StorageError as exc:
        raise _storage_failure(backend, exc) from None
    except NotAcknowledged:
        check_leading(backend, acknowledged=False)
        raise
    check_leading(backend)
    return results


def _scheduled(message: Message, result: SendResult) -> Scheduled:
    assert result.due_ms is not None
    duplicate = result.code is ResultCode.DUPLICATE
    return Scheduled(id=message.message_id, due_ms=result.due_ms, duplicate=duplicate)


MessageId = Annotated[str, Path(description="The message id given or made at schedule time.")]


def _scheduling_routes(router: APIRouter, backend: Backend) -> None:
    @router.post(
        "/messages",
        status_code=HTTPStatus.CREATED,
        responses={
            200: {"model": Scheduled, "description": "Already held (duplicate: true)."},
            **_problem_responses(503, 507),
        },
    )
    async def schedule(request: ScheduleRequest, response: Response) -> Scheduled:
        """Schedule one message. 201 once it is durable; 200 with ``duplicate: true``
        when a message with this id is already held (nothing new scheduled)."""
        message = to_message(request, "body")
        (result,) = await _send(backend, [message])
        if not result.code.is_success:
            raise refusal(result)
        response.headers["Location"] = f"/v1/messages/{message.message_id}"
        if result.code is ResultCode.DUPLICATE:
            response.status_code = HTTPStatus.OK
        return _scheduled(message, result)

    @router.post("/batches", responses=_problem_responses(503, 507))
    async def schedule_batch(request: BatchRequest) -> BatchResult:
        """Schedule up to 1000 messages in one durable append. One refused message does
        not fail the others: each has its result, in order. When the server refuses
        them all for its state (busy, disk full), the answer is that problem."""
        count = len(request.messages)
        if count > MAX_BATCH_MESSAGES:
            raise ProblemError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                "batch-too-large",
                f"{count:,} messages in one batch, at most {MAX_BATCH_MESSAGES:,}: split it",
            )
        messages = [to_message(m, f"body.messages.{i}") for i, m in enumerate(request.messages)]
        results = await _send(backend, messages)
        codes = {result.code for result in results}
        if len(codes) == 1 and codes.pop().is_retryable:
            raise refusal(results[0])
        items = []
        for message, result in zip(messages, results, strict=True):
            if result.code.is_success:
                items.append(BatchItem(scheduled=_scheduled(message, result)))
            else:
                items.append(BatchItem(problem=Problem(**refusal(result).body())))
        taken = sum(item.scheduled is not None for item in items)
        return BatchResult(results=items, scheduled=taken, refused=len(items) - taken)

    @router.get("/messages/{message_id:path}", responses=_problem_responses(404))
    async def status(message_id: MessageId) -> MessageStatusBody:
        """Where the message is: pending (due_ms), delivered (dispatched_ms, group),
        dead_lettered, cancelled (cancelled_ms); 404 when no message has this id."""
        found = backend.status(message_id)
        state = found.state
        if state is MessageState.UNKNOWN:
            raise _unknown(message_id)
        body = MessageStatusBody(id=message_id, status=state.value, due_ms=found.due_ms)
        if state is MessageState.CANCELLED:
            body.cancelled_ms = found.at_ms
        elif state is not MessageState.PENDING:
            body.dispatched_ms, body.group = found.at_ms, found.group
        return body

    @router.delete("/messages/{message_id:path}", responses=_problem_responses(404, 409, 507))
    async def cancel(message_id: MessageId) -> Cancelled:
        """Cancel the message: 200 when it will not be delivered (also when it was
        cancelled before), 409 when it was delivered already, 404 for no such id."""
        answer = await _tombstone(backend, message_id, None)
        if answer.outcome is CancelOutcome.CANCELLED:
            return Cancelled(id=message_id, outcome="cancelled")
        raise _not_pending(message_id, answer.outcome, answer.dispatched_ms)

    @router.patch("/messages/{message_id:path}", responses=_problem_responses(404, 409, 507))
    async def reschedule(message_id: MessageId, request: RescheduleRequest) -> Rescheduled:
        """Move a pending message to a new due time (``at`` or ``delay``, from now).
        409 when it was delivered already, 404 when no pending message has this id."""
        at_ms, delay_ms = due(request.at, request.delay, "body")
        if at_ms is None and delay_ms is None:
            raise bad_input("body: give the new due time as at or delay", "invalid-delay")
        intake = backend.intake
        wanted_ms = at_ms if at_ms is not None else intake.clock() + (delay_ms or 0)
        due_ms, why = intake.reschedule_due_ms(wanted_ms)
        if due_ms is None:
            raise bad_input(why, "delay-too-long")
        answer = await _tombstone(backend, message_id, due_ms)
        if answer.outcome is RescheduleOutcome.RESCHEDULED:
            return Rescheduled(id=message_id, due_ms=due_ms)
        raise _not_pending(message_id, answer.outcome, answer.dispatched_ms)


async def _tombstone(backend: Backend, message_id: str, due_ms: int | None) -> Answer:
    """Append a cancel (``due_ms`` None) or reschedule tombstone and wait for its
    resolution. Raises ProblemError (a full disk: 507, retryable)."""
    intake = backend.intake
    try:
        await intake.make_room()
        answer = intake.append_tombstone(message_id, due_ms)
        settled = await intake.settle(answer)
        check_leading(backend)
        return settled
    except NotAcknowledged:
        check_leading(backend, acknowledged=False)
        raise
    except DiskFullError as exc:
        raise ProblemError(
            HTTPStatus.INSUFFICIENT_STORAGE,
            "disk-full",
            str(exc),
            code="DISK_FULL",
            retryable=True,
        ) from None
    except ValueError as exc:  # an id the tombstone cannot carry
        raise bad_input(f"message id: {exc}", "invalid-id") from None
    except StorageError as exc:
        raise _storage_failure(backend, exc) from None


def _unknown(message_id: str) -> ProblemError:
    return ProblemError(
        HTTPStatus.NOT_FOUND,
        "unknown-message",
        f"no message with id {message_id!r} is held here (never scheduled on this server, "
        "or its records were removed by retention)",
    )


def _not_pending(message_id: str, outcome: Any, dispatched_ms: int | None) -> ProblemError:
    """The problem for a cancel or reschedule that found nothing pending."""
    if outcome in (CancelOutcome.ALREADY_DELIVERED, RescheduleOutcome.ALREADY_DELIVERED):
        return ProblemError(
            HTTPStatus.CONFLICT,
            "already-delivered",
            f"message {message_id!r} was handed to a broker at {dispatched_ms} (epoch ms): "
            "too late to change",
            extra={"dispatched_ms": dispatched_ms},
        )
    return ProblemError(
        HTTPStatus.NOT_FOUND,
        "not-pending",
        f"no pending message with id {message_id!r} (never scheduled, or cancelled)",
    )


Subject = Annotated[str, Path(description="The subject consumed.", max_length=255)]
Group = Annotated[str, Path(description="The consumer group.", max_length=255)]


def _consuming_routes(router: APIRouter, backend: Backend) -> None:
    broker = backend.broker
    base = "/subjects/{subject}/groups/{group}"

    @router.post(base + "/pull", responses=_problem_responses())
    async def pull(subject: Subject, group: Group, request: PullRequest) -> PullResult:
        """Up to ``max_messages`` messages of the queues the group assigns to this
        consumer; when there are none, wait up to ``wait_ms`` for one (long poll). The
        first pull joins the group; each pull is a heartbeat. Messages come again
        (at least once) until their offsets are committed."""
        member = HttpMember(group, subject, request.consumer_id)
        now_ms = broker.monotonic_ms()
        got: list[Message] = []
        try:
            if broker.groups.assignment(group, subject, request.consumer_id) is None:
                # It keeps no prefetch and cannot say what it holds: its lost queues
                # move at once (what it pulled uncommitted comes again).
                broker.join(group, subject, request.consumer_id, member, now_ms, confirms=False)
            with trio.CancelScope() as scope:
                backend.pulls.add(scope)
                try:
                    got = await broker.pull(
                        subject,
                        group,
                        request.consumer_id,
                        request.max_messages,
                        request.wait_ms,
                        member,
                    )
                finally:
                    backend.pulls.discard(scope)
        except RejectedError as exc:
            if stopped_leading(backend, exc):  # its broker follows: before its view says so
                check_leading(backend, acknowledged=False)
            raise bad_input(exc.reason, "rejected") from None
        ends: dict[int, int] = {}
        for message in got:
            assert message.queue is not None and message.queue_offset is not None
            ends[message.queue] = max(ends.get(message.queue, 0), message.queue_offset + 1)
        commit = [Offset(queue=q, offset=o) for q, o in sorted(ends.items())]
        return PullResult(messages=[consumed(m) for m in got], commit=commit)

    @router.post(base + "/commit", responses=_problem_responses(503))
    async def commit(subject: Subject, group: Group, request: CommitRequest) -> Committed:
        """Commit offsets: the group consumed every message below ``offset`` of each
        queue. Post a pull's ``commit`` list once its messages are processed. With
        ``durable`` the answer waits until the broker has the commit on disk; on a
        member of a replicated group it always waits, for its in-sync followers too."""
        try:
            for offset in request.offsets:
                broker.commit(group, subject, offset.queue, offset.offset)
            if request.durable or broker.gate is not None:  # a group: answered once it has it
                await broker.wait_commits_acknowledged()
        except Exception as exc:
            if stopped_leading(backend, exc):
                check_leading(backend, acknowledged=False)
            if isinstance(exc, RejectedError):
                raise bad_input(exc.reason, "rejected") from None
            if isinstance(exc, OSError):
                raise ProblemError(
                    HTTPStatus.SERVICE_UNAVAILABLE,
                    "offsets-not-durable",
                    f"the commit is in memory, not on disk yet: {exc}; retry",
                    retryable=True,
                ) from None
            raise
        return Committed(committed=request.offsets, durable=request.durable)

    @router.delete(
        base + "/members/{consumer_id}",
        status_code=HTTPStatus.NO_CONTENT,
        response_class=Response,
        responses=_problem_responses(),
    )
    async def leave(subject: Subject, group: Group, consumer_id: str) -> None:
        """Leave the group now (its queues go to the other members at once, instead of
        after heartbeat_timeout_ms). What it pulled and did not commit comes again."""
        broker.connection_closed(HttpMember(group, subject, consumer_id))
