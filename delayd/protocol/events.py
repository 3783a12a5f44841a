"""The message model and one frozen, slotted event class per request and response kind.

Events are plain data (h11's ``Request``, ``Response``...): they know their command code
but nothing of bytes; bodies.py turns them into frame bodies and back. Sequences given as
lists are stored as tuples so that an event, once built, cannot change under the sender.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import ClassVar

from delayd.errors import ProtocolError
from delayd.protocol.codes import CancelOutcome, Command, ErrorCode, RescheduleOutcome, ResultCode
from delayd.protocol.frames import DEFAULT_MAX_FRAME_SIZE

# The command set spoken inside frames, negotiated in HELLO: the client offers
# [min_version, max_version], the server picks the highest version both speak.
# Version 2: HEARTBEAT may end with the queues the consumer still holds (the
# hand-over of a rebalance, docs/protocol.md); everything of version 1 is unchanged.
# Version 3: JOIN_GROUP may end with them too (a broker that begins to lead its group
# gives them back to the consumers that rejoin); HELD_IDS, which ids a delay server
# holds (a producer over a cluster asks a group that may hold an id before it sends the
# id elsewhere, docs/cluster.md); everything of version 2 is unchanged.
PROTOCOL_VERSION = 3
MIN_PROTOCOL_VERSION = 1
# The first version whose HEARTBEAT carries the queues the consumer holds.
HELD_QUEUES_VERSION = 2
# The first version whose JOIN_GROUP carries them.
JOIN_HELD_VERSION = 3
# The first version with HELD_IDS: a client never sends it to an older server, which
# would answer UNKNOWN_COMMAND and close the connection.
HELD_IDS_VERSION = 3

MAX_SUBJECT_LENGTH = 255
_SUBJECT_CHAR = re.compile(r"[A-Za-z0-9._\-]")
_SUBJECT = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9._\-]{0,254}")
assert MAX_SUBJECT_LENGTH == 1 + 254


def validate_subject(subject: str) -> str | None:
    """Why ``subject`` is not a valid subject, or None when it is.

    A subject is 1 to 255 characters, each an ASCII letter, digit, ``.``, ``_`` or
    ``-``, and does not start with ``.``. The rule exists because a subject becomes a
    directory name (``consumequeue/<subject>/``) on every file system a broker may run
    on: ASCII only, no ``/`` or ``\\``, no ``.``/``..``/hidden names, and well inside
    the usual 255-byte name limit. Subjects are case-sensitive; two subjects that differ
    only in case must not be used on a case-insensitive file system.
    """
    if _SUBJECT.fullmatch(subject):
        return None
    if not subject:
        return "subject is empty"
    if len(subject) > MAX_SUBJECT_LENGTH:
        return f"subject is {len(subject)} characters long, at most {MAX_SUBJECT_LENGTH} allowed"
    if subject[0] == ".":
        return f"subject {subject!r} starts with '.'"
    index, char = next((i, c) for i, c in enumerate(subject) if not _SUBJECT_CHAR.fullmatch(c))
    return (
        f"subject {subject!r} contains {char!r} at index {index}; allowed are ASCII letters, "
        "digits, '.', '_' and '-'"
    )


@dataclass(frozen=True, slots=True)
class Message:
    """One message, as a producer sends it and as a consumer receives it.

    ``message_id`` must be non-empty (a server answers EMPTY_ID otherwise) and is the
    deduplication key. A producer sets at most one of ``at_ms`` (absolute due time, epoch
    ms UTC) and ``delay_ms`` (relative to the server's receipt); the server computes
    ``due_ms`` once on receipt (STYLE.md #6). The broker fills ``store_ms`` (epoch ms),
    ``commitlog_offset``, ``queue`` and ``queue_offset`` on delivered messages;
    ``due_ms`` and ``dispatched_ms`` (epoch ms) are None for messages that were not
    delayed. The encoder checks encodability only; the rules above are the server's.
    """

    message_id: str
    subject: str
    key: str | None = None
    properties: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    at_ms: int | None = None
    delay_ms: int | None = None
    store_ms: int | None = None
    commitlog_offset: int | None = None
    queue: int | None = None
    queue_offset: int | None = None
    due_ms: int | None = None
    dispatched_ms: int | None = None


@dataclass(frozen=True, slots=True)
class EncodedMessages:
    """Messages in their wire encoding (docs/protocol.md, Message), back to back.

    Message ``i`` is ``data[bounds[i]:bounds[i + 1]]``; there are ``len(bounds) - 1`` of
    them and ``data`` may hold other bytes before ``bounds[0]`` or after ``bounds[-1]``
    (a decoded SEND_BATCH keeps its whole frame body). This lets the broker store what a
    producer sent, and answer a PULL with what it stored, without building Messages.
    The bytes are trusted to be well-formed: the decoder made them, or the broker.
    """

    data: bytes
    bounds: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @classmethod
    def join(cls, parts: list[bytes]) -> EncodedMessages:
        """One block of the encoded messages ``parts`` (each one message)."""
        bounds = [0]
        position = 0
        for part in parts:
            position += len(part)
            bounds.append(position)
        return cls(b"".join(parts), tuple(bounds))


@dataclass(frozen=True, slots=True)
class SendResult:
    """The outcome of one message of a SEND_BATCH, in the order of the batch.

    ``reason`` explains a refusal in words a user can act on ("" for OK). For a stored
    message (OK, DUPLICATE) the server may fill in where and when it stored it, and
    ``due_ms`` (epoch ms) for a delayed one.
    """

    code: ResultCode
    reason: str = ""
    store_ms: int | None = None
    commitlog_offset: int | None = None
    queue: int | None = None
    queue_offset: int | None = None
    due_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Event:
    """Base of everything Connection.next_event returns and Connection.send takes.

    ``request_id`` pairs a response with its request; the client picks it
    (Connection.next_request_id), the server copies it into the answer. 0 is reserved
    for ERRORs about the whole connection. It is keyword-only so each event's own
    fields can be positional.
    """

    request_id: int = field(default=0, kw_only=True)


@dataclass(frozen=True, slots=True)
class Request(Event):
    """An event a client sends and a server receives."""

    command: ClassVar[Command]


@dataclass(frozen=True, slots=True)
class Response(Event):
    """An event a server sends and a client receives."""

    command: ClassVar[Command]


def _freeze(obj: object, name: str) -> None:
    value = getattr(obj, name)
    if not isinstance(value, tuple):
        object.__setattr__(obj, name, tuple(value))


@dataclass(frozen=True, slots=True)
class Hello(Request):
    """First request on every connection: protocol versions offered, and the token.

    The token is left out of repr() so that it never reaches a log.
    """

    command: ClassVar[Command] = Command.HELLO
    token: str | None = field(default=None, repr=False)
    client_name: str = ""
    min_version: int = MIN_PROTOCOL_VERSION
    max_version: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class HelloOk(Response):
    """The server's answer to a good HELLO: the version it picked and its frame limit."""

    command: ClassVar[Command] = Command.HELLO_OK
    version: int
    server_name: str = ""
    max_frame_size: int = DEFAULT_MAX_FRAME_SIZE  # bytes, header included


@dataclass(frozen=True, slots=True)
class SendBatch(Request):
    """Messages to store, answered by one SendResult each.

    ``encoded`` is set by the decoder: the bytes the messages arrived in, one span per
    message, so that a broker can store them without encoding them again. Senders leave
    it None (the encoder ignores it); it takes no part in comparisons.
    """

    command: ClassVar[Command] = Command.SEND_BATCH
    messages: tuple[Message, ...]
    encoded: EncodedMessages | None = field(default=None, kw_only=True, compare=False, repr=False)

    def __post_init__(self) -> None:
        _freeze(self, "messages")


@dataclass(frozen=True, slots=True)
class SendBatchResult(Response):
    """One SendResult per message of the SEND_BATCH, in the same order."""

    command: ClassVar[Command] = Command.SEND_BATCH_RESULT
    results: tuple[SendResult, ...]

    def __post_init__(self) -> None:
        _freeze(self, "results")


@dataclass(frozen=True, slots=True)
class Pull(Request):
    """Up to ``max_messages`` from the queues assigned to ``consumer_id``.

    The broker holds the request up to ``wait_ms`` milliseconds when nothing is there
    (long polling; 0 answers at once).
    """

    command: ClassVar[Command] = Command.PULL
    subject: str
    group: str
    consumer_id: str
    max_messages: int = 32
    wait_ms: int = 0


@dataclass(frozen=True, slots=True)
class PullResult(Response):
    """The messages a PULL got, in delivery order.

    A server may give them already encoded instead (``encoded``, ``messages`` left
    empty): a broker answers with the bytes it stored. A decoded PullResult always has
    ``messages`` and no ``encoded``.
    """

    command: ClassVar[Command] = Command.PULL_RESULT
    messages: tuple[Message, ...] = ()
    encoded: EncodedMessages | None = field(default=None, kw_only=True, compare=False, repr=False)

    def __post_init__(self) -> None:
        _freeze(self, "messages")


@dataclass(frozen=True, slots=True)
class CommitOffset(Request):
    """``group`` has consumed ``queue`` of ``subject`` up to, not including, ``offset``.

    ``durable``: answer only once the offset is on disk (a kill -9 of the broker after
    the answer does not forget it); otherwise the broker answers from memory.
    """

    command: ClassVar[Command] = Command.COMMIT_OFFSET
    group: str
    subject: str
    queue: int
    offset: int
    durable: bool = False


@dataclass(frozen=True, slots=True)
class CommitOffsetOk(Response):
    command: ClassVar[Command] = Command.COMMIT_OFFSET_OK


@dataclass(frozen=True, slots=True)
class _AsMember(Request):
    """A request a consumer makes as a member of ``group`` on ``subject``."""

    group: str
    subject: str
    consumer_id: str


@dataclass(frozen=True, slots=True)
class _Assignment(Response):
    """The queues of the subject assigned to the consumer that asked."""

    queues: tuple[int, ...]

    def __post_init__(self) -> None:
        _freeze(self, "queues")


@dataclass(frozen=True, slots=True)
class JoinGroup(_AsMember):
    """``held``: the queues the consumer still holds when it joins again, so a broker
    that has just begun to lead gives them back to it (protocol version 3; None: not
    said, versions 1 and 2)."""

    command: ClassVar[Command] = Command.JOIN_GROUP
    held: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.held is not None:
            _freeze(self, "held")


@dataclass(frozen=True, slots=True)
class JoinGroupResult(_Assignment):
    """The queues of the subject now assigned to the consumer that joined."""

    command: ClassVar[Command] = Command.JOIN_GROUP_RESULT


@dataclass(frozen=True, slots=True)
class Heartbeat(_AsMember):
    """``held``: the queues the consumer still holds, so the broker hands those it lost
    and let go of to their new owner (protocol version 2; None: not said, version 1)."""

    command: ClassVar[Command] = Command.HEARTBEAT
    held: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.held is not None:
            _freeze(self, "held")


@dataclass(frozen=True, slots=True)
class HeartbeatResult(_Assignment):
    """The consumer's current assignment, which changes when members join or leave."""

    command: ClassVar[Command] = Command.HEARTBEAT_RESULT


@dataclass(frozen=True, slots=True)
class Query(Request):
    """Look up stored messages of ``subject`` by exactly one of message_id and key."""

    command: ClassVar[Command] = Command.QUERY
    subject: str
    message_id: str | None = None
    key: str | None = None


@dataclass(frozen=True, slots=True)
class QueryResult(Response):
    """The stored messages a QUERY found; ``encoded`` as in PullResult."""

    command: ClassVar[Command] = Command.QUERY_RESULT
    messages: tuple[Message, ...] = ()
    encoded: EncodedMessages | None = field(default=None, kw_only=True, compare=False, repr=False)

    def __post_init__(self) -> None:
        _freeze(self, "messages")


@dataclass(frozen=True, slots=True)
class Stats(Request):
    command: ClassVar[Command] = Command.STATS


@dataclass(frozen=True, slots=True)
class StatsResult(Response):
    """Flat named values ("wheel.loaded_entries": 12345); units belong in the names."""

    command: ClassVar[Command] = Command.STATS_RESULT
    stats: dict[str, str | int | float]


@dataclass(frozen=True, slots=True)
class Cancel(Request):
    """Cancel a pending delayed message: it will not be delivered, unless it already
    was (CancelResult says which; docs/cancel.md)."""

    command: ClassVar[Command] = Command.CANCEL
    message_id: str


@dataclass(frozen=True, slots=True)
class CancelResult(Response):
    """``dispatched_ms`` (epoch ms) is set when the outcome is ALREADY_DELIVERED."""

    command: ClassVar[Command] = Command.CANCEL_RESULT
    outcome: CancelOutcome
    dispatched_ms: int | None = None


@dataclass(frozen=True, slots=True)
class CancelBatch(Request):
    """Cancel several delayed messages: the CANCELs of ``message_ids`` in one frame,
    answered together by one CANCEL_BATCH_RESULT."""

    command: ClassVar[Command] = Command.CANCEL_BATCH
    message_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        _freeze(self, "message_ids")


@dataclass(frozen=True, slots=True)
class CancelBatchResult(Response):
    """One (outcome, dispatched_ms) per id of the CANCEL_BATCH, in its order;
    ``dispatched_ms`` (epoch ms) is set when the outcome is ALREADY_DELIVERED."""

    command: ClassVar[Command] = Command.CANCEL_BATCH_RESULT
    results: tuple[tuple[CancelOutcome, int | None], ...]

    def __post_init__(self) -> None:
        _freeze(self, "results")


@dataclass(frozen=True, slots=True)
class HeldIds(Request):
    """Which of ``message_ids`` the delay server holds (read-only: as a SEND_BATCH of
    them would decide DUPLICATE, storing nothing), answered by one HELD_IDS_RESULT."""

    command: ClassVar[Command] = Command.HELD_IDS
    message_ids: tuple[str, ...]

    def __post_init__(self) -> None:
        _freeze(self, "message_ids")


@dataclass(frozen=True, slots=True)
class HeldIdsResult(Response):
    """One entry per id of the HELD_IDS, in its order: the held message's due time
    (epoch ms; after a reschedule, the new one) — what a SEND_BATCH of the id would be
    answered DUPLICATE with — or None when the server does not hold the id."""

    command: ClassVar[Command] = Command.HELD_IDS_RESULT
    due_ms: tuple[int | None, ...]

    def __post_init__(self) -> None:
        _freeze(self, "due_ms")


@dataclass(frozen=True, slots=True)
class Reschedule(Request):
    """Move a pending delayed message to ``at_ms`` (epoch ms): it is delivered then
    instead of at its old time, never both (docs/cancel.md)."""

    command: ClassVar[Command] = Command.RESCHEDULE
    message_id: str
    at_ms: int


@dataclass(frozen=True, slots=True)
class RescheduleResult(Response):
    """``dispatched_ms`` (epoch ms) is set when the outcome is ALREADY_DELIVERED."""

    command: ClassVar[Command] = Command.RESCHEDULE_RESULT
    outcome: RescheduleOutcome
    dispatched_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Error(Response):
    """The answer to a request that failed as a whole, or (request_id 0) to none.

    ``close`` means the sender closes the connection after this frame; every request
    still waiting for an answer on it is lost.
    """

    command: ClassVar[Command] = Command.ERROR
    code: ErrorCode
    reason: str
    close: bool = False

    MAX_REASON_LENGTH: ClassVar[int] = 1000  # characters; reasons are for humans

    @classmethod
    def for_exception(cls, exc: ProtocolError) -> Error:
        """The closing ERROR to send after ``exc`` was raised by next_event."""
        code = ErrorCode(exc.code) if exc.code is not None else ErrorCode.MALFORMED
        reason = str(exc)[: cls.MAX_REASON_LENGTH]
        return cls(code, reason, close=True, request_id=exc.request_id)


@dataclass(frozen=True, slots=True)
class ConnectionClosed(Event):
    """Not a frame: the peer closed its end (``receive_data(b"")``) between frames."""
