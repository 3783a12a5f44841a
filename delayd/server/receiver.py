"""The receiver: per-message validation, due times and sequences for SEND_BATCH.

Pure logic (STYLE.md #4): the clock and the load figures are arguments, the caller
appends the payloads to message_log and answers once they are durable. As QMQ's
Receiver it turns each received message into a message_log record; unlike QMQ it
refuses what it cannot honour instead of clamping or dropping it:

- due time in the past: accepted, due at once (``due_ms`` = receipt time), counted in
  ``past_due_total``;
- due beyond ``max_delay_ms`` from now: DELAY_TOO_LONG (QMQ clamps to 2 years);
- both ``at_ms`` and ``delay_ms``, a negative delay or a negative ``at_ms``: INVALID_DELAY;
- body over ``max_body_bytes``, or the whole record over ``max_record_bytes``:
  BODY_TOO_LARGE (QMQ acknowledges an oversized message and drops it);
- invalid subject, a reserved ``DLQ.`` subject, an empty id, an id that is not printable
  text (a NUL, a newline, any control character), properties over
  ``max_properties_bytes``: refused;
- an id the server already holds (``KnownIds``: scheduled, delivered or cancelled, in
  an earlier batch, earlier in this one, or before a restart): DUPLICATE with the held
  message's due time — never a second schedule (reschedule moves a message);
- server overloaded (acks waiting for fsync, or replay lag, beyond a limit): BUSY,
  retryable, for the whole batch — never an unbounded buffer.

One bad message never fails the others of its batch. ``due_ms`` is computed once,
here, on receipt (``at_ms``, or receipt time + ``delay_ms``) and stored; the wire's
relative delay never reaches the logs (STYLE.md #6). Sequences are dense and
increasing in message_log order, provided the caller appends an Intake's payloads
before it calls ``accept`` again.
"""

from __future__ import annotations

import datetime as _dt
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from delayd.logs import message_log
from delayd.logs.known_ids import KnownIds
from delayd.protocol import EncodedMessages, Message, ResultCode, SendResult, validate_subject
from delayd.protocol.bodies import new_send_result
from delayd.protocol.message_layout import MSG_HEAD, MSG_KEY
from delayd.sender.retry import DEAD_LETTER_PREFIX, MAX_DEAD_LETTERED_SUBJECT_LENGTH

MS_PER_DAY = 86_400_000
DEFAULT_MAX_DELAY_MS = 731 * MS_PER_DAY  # two years, counting a leap day
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_PROPERTIES_BYTES = 64 * 1024  # the encoded properties field
# Body, properties and the rest with room for long ids, subjects and keys.
DEFAULT_MAX_RECORD_BYTES = DEFAULT_MAX_BODY_BYTES + DEFAULT_MAX_PROPERTIES_BYTES + 256 * 1024
DEFAULT_MAX_PENDING_ACKS = 100_000  # messages appended, waiting for their fsync
DEFAULT_MAX_REPLAY_LAG_RECORDS = 1_000_000  # accepted, not yet in schedule_log
# Intake refuses (DISK_FULL) below this much free space, kept for replay and delivery.
DEFAULT_MIN_FREE_BYTES = 64 * 1024 * 1024
_SUBJECT_CACHE_SIZE = 10_000


@dataclass(frozen=True, slots=True)
class IntakeLimits:
    """What the receiver accepts. Sizes in bytes, times in milliseconds."""

    max_delay_ms: int = DEFAULT_MAX_DELAY_MS
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_properties_bytes: int = DEFAULT_MAX_PROPERTIES_BYTES
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    max_pending_acks: int = DEFAULT_MAX_PENDING_ACKS
    max_replay_lag_records: int = DEFAULT_MAX_REPLAY_LAG_RECORDS
    min_free_bytes: int = DEFAULT_MIN_FREE_BYTES

    def __post_init__(self) -> None:
        for name in self.__slots__:  # type: ignore[attr-defined]
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(slots=True)
class Intake:
    """The outcome of ``Receiver.accept`` for one batch.

    ``results`` has one entry per message: the refusal, or None for an accepted message
    whose payload is in ``payloads`` (in batch order, sequences from
    ``first_sequence``). Append ``payloads`` to message_log, then call
    ``Receiver.acknowledge`` for the answer.
    """

    results: list[SendResult | None]
    payloads: list[bytes] = field(default_factory=list)
    due_ms: list[int] = field(default_factory=list)
    first_sequence: int = 0
    message_ids: list[bytes] = field(default_factory=list)  # UTF-8, of each payload
    receive_ms: int = 0
    past_due: int = 0  # accepted messages whose due time had passed on receipt

    @property
    def last_sequence(self) -> int:
        """The sequence of the last accepted message (first_sequence - 1 when none)."""
        return self.first_sequence + len(self.payloads) - 1


def _utc(ms: int) -> str:
    try:
        moment = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC) + _dt.timedelta(milliseconds=ms)
    except OverflowError:
        return f"{ms} ms since the epoch"
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _days(ms: int) -> str:
    return f"{ms / MS_PER_DAY:,.1f} days"


def _id_problem(message_id: str) -> str:
    index, char = next((i, c) for i, c in enumerate(message_id) if not c.isprintable())
    return (
        f"message_id contains {char!r} at index {index}; an id is printable text "
        "(no NUL, newline or other control or separator character)"
    )


def _duplicate(held_due_ms: int) -> SendResult:
    return new_send_result(
        ResultCode.DUPLICATE,
        "a message with this id is already held (scheduled, delivered or cancelled); "
        "not scheduled again: due_ms is the held message's (reschedule moves a message)",
        None,
        None,
        None,
        None,
        held_due_ms,
    )


class Receiver:
    """Validates batches and numbers the accepted messages (see the module docstring).

    Counters for metrics: ``accepted_total``, ``refused_total`` (by ResultCode),
    ``duplicate_total``, ``past_due_total``.
    """

    def __init__(
        self, limits: IntakeLimits, next_sequence: int, known: KnownIds | None = None
    ) -> None:
        self.limits = limits
        self._next_sequence = next_sequence
        # None: no idempotency check (tools and tests that drive the receiver alone).
        self.known = known
        self.accepted_total = 0
        self.duplicate_total = 0
        self.refused_total: Counter[ResultCode] = Counter()
        self.past_due_total = 0
        self._subjects: dict[str, str | None] = {}  # subject -> why invalid, or None

    @property
    def last_sequence(self) -> int:
        """The sequence given to the last accepted message (0 before the first)."""
        return self._next_sequence - 1

    def resume_after(self, next_sequence: int) -> None:
        """Number the next message ``next_sequence`` or later: a promoted member's
        message_log holds records the old leader numbered."""
        self._next_sequence = max(self._next_sequence, next_sequence)

    def busy_reason(self, *, pending_acks: int, replay_lag_records: int) -> str | None:
        """Why the server should answer BUSY now, or None."""
        limits = self.limits
        if pending_acks >= limits.max_pending_acks:
            return (
                f"server busy: {pending_acks:,} messages are waiting for their fsync "
                f"(max_pending_acks is {limits.max_pending_acks:,}); retry with back-off"
            )
        if replay_lag_records >= limits.max_replay_lag_records:
            return (
                f"server busy: {replay_lag_records:,} accepted messages are not in "
                f"schedule_log yet (max_replay_lag_records is "
                f"{limits.max_replay_lag_records:,}); retry with back-off"
            )
        return None

    def accept(
        self,
        messages: Sequence[Message],
        now_ms: int,
        *,
        pending_acks: int = 0,
        replay_lag_records: int = 0,
        encoded: EncodedMessages | None = None,
    ) -> Intake:
        """Validate ``messages`` received at ``now_ms`` (epoch ms) and encode the
        accepted ones as message_log payloads, numbered from the next sequence.

        ``encoded``: the messages as they arrived (``SendBatch.encoded``); a message
        without properties then becomes its payload by one slice of those bytes, whose
        id, subject, key and body are laid out as message_log lays them out."""
        busy = self.busy_reason(pending_acks=pending_acks, replay_lag_records=replay_lag_records)
        if busy is not None:
            self.refused_total[ResultCode.BUSY] += len(messages)
            return Intake([SendResult(ResultCode.BUSY, busy)] * len(messages))
        intake = self._accept(messages, now_ms, encoded, None)
        known = self.known
        if known is None or not intake.payloads:
            return intake
        held = known.check(intake.message_ids, intake.due_ms)
        if held is None:
            return intake
        # Rare: some ids are held. Take the batch back and accept it again with those
        # answered DUPLICATE, so that sequences stay dense.
        accepted = [i for i, result in enumerate(intake.results) if result is None]
        self._take_back(intake)
        held_by_message = {accepted[position]: due for position, due in held.items()}
        self.duplicate_total += len(held_by_message)
        return self._accept(messages, now_ms, encoded, held_by_message)

    def _take_back(self, intake: Intake) -> None:
        """Undo the counting and numbering of ``intake``, the last batch accepted."""
        self._next_sequence = intake.first_sequence
        self.accepted_total -= len(intake.payloads)
        self.past_due_total -= intake.past_due

    def _accept(
        self,
        messages: Sequence[Message],
        now_ms: int,
        encoded: EncodedMessages | None,
        held: dict[int, int] | None,
    ) -> Intake:
        """``accept`` of ``messages`` whose ids are not held, but for those in ``held``
        (message index -> the held message's due time), answered DUPLICATE."""
        limits = self.limits
        latest_ms = now_ms + limits.max_delay_ms
        max_body = limits.max_body_bytes
        subjects = self._subjects
        results: list[SendResult | None] = []
        payloads: list[bytes] = []
        dues: list[int] = []
        ids: list[bytes] = []
        sequence = first_sequence = self._next_sequence
        wire = None if encoded is None else encoded.data
        bounds = () if encoded is None else encoded.bounds
        past_due_count = 0
        for i, m in enumerate(messages):
            if held and i in held:
                results.append(_duplicate(held[i]))
                continue
            refusal = None
            subject_problem = subjects.get(m.subject, "")
            if subject_problem == "":
                subject_problem = self._check_subject(m.subject)
            at_ms, delay_ms, text_id = m.at_ms, m.delay_ms, m.message_id
            if not text_id:
                refusal = SendResult(
                    ResultCode.EMPTY_ID,
                    "message_id is empty; every message needs a unique id "
                    "(the clients make one when none is given)",
                )
            elif not text_id.isprintable():
                refusal = SendResult(ResultCode.INVALID_ID, _id_problem(text_id))
            elif subject_problem is not None:
                refusal = SendResult(ResultCode.INVALID_SUBJECT, subject_problem)
            elif at_ms is not None and delay_ms is not None:
                refusal = SendResult(
                    ResultCode.INVALID_DELAY,
                    f"both at_ms ({at_ms}) and delay_ms ({delay_ms}) are set; give one",
                )
            elif delay_ms is not None and delay_ms < 0:
                refusal = SendResult(
                    ResultCode.INVALID_DELAY,
                    f"delay_ms is {delay_ms}; a delay cannot be negative "
                    "(use at_ms for an absolute time)",
                )
            elif at_ms is not None and at_ms < 0:
                refusal = SendResult(
                    ResultCode.INVALID_DELAY,
                    f"at_ms is {at_ms}, before 1970; give epoch milliseconds "
                    "(a time in the past is delivered at once)",
                )
            else:
                due_ms = at_ms if at_ms is not None else now_ms + (delay_ms or 0)
                if due_ms > latest_ms:
                    refusal = SendResult(ResultCode.DELAY_TOO_LONG, self._too_long(due_ms, now_ms))
                elif len(m.body) > max_body:
                    refusal = SendResult(
                        ResultCode.BODY_TOO_LARGE,
                        f"body of {len(m.body):,} bytes exceeds max_body_bytes ({max_body:,})",
                    )
                else:
                    past_due = due_ms < now_ms
                    if past_due:
                        due_ms = now_ms  # delivered at once; the receipt says when that is
                    if wire is not None and not m.properties:
                        refusal, record, message_id = self._encode_wire(
                            wire, bounds[i], due_ms, now_ms, sequence
                        )
                    else:
                        refusal, record, message_id = self._encode(m, due_ms, now_ms, sequence)
                    if refusal is None:
                        past_due_count += past_due
                        payloads.append(record)
                        dues.append(due_ms)
                        ids.append(message_id)
                        sequence += 1
                        results.append(None)
                        continue
            self.refused_total[refusal.code] += 1
            results.append(refusal)
        self._next_sequence = sequence
        self.accepted_total += len(payloads)
        self.past_due_total += past_due_count
        return Intake(results, payloads, dues, first_sequence, ids, now_ms, past_due_count)

    def _too_long(self, due_ms: int, now_ms: int) -> str:
        return (
            f"due at {_utc(due_ms)}, {_days(due_ms - now_ms)} from now; "
            f"max_delay is {_days(self.limits.max_delay_ms)} (refused, not clamped)"
        )

    def due_refusal(self, due_ms: int, now_ms: int) -> str | None:
        """Why a due time of ``due_ms`` is refused at ``now_ms`` (beyond max_delay: the
        DELAY_TOO_LONG reason a send gets), or None. A reschedule is checked with it."""
        if due_ms > now_ms + self.limits.max_delay_ms:
            return self._too_long(due_ms, now_ms)
        return None

    def _check_subject(self, subject: str) -> str | None:
        problem = validate_subject(subject)
        if problem is None and subject.startswith(DEAD_LETTER_PREFIX):
            target = subject[len(DEAD_LETTER_PREFIX) :]
            problem = (
                f"subject {subject!r} is reserved: {DEAD_LETTER_PREFIX}<subject> holds the "
                f"messages delayd could not deliver to <subject>; send to {target} itself"
            )
        elif problem is None and len(subject) > MAX_DEAD_LETTERED_SUBJECT_LENGTH:
            # A message that cannot be delivered must still have somewhere to go.
            problem = (
                f"subject is {len(subject)} characters long; a delayed message's subject is "
                f"at most {MAX_DEAD_LETTERED_SUBJECT_LENGTH}, so that its dead-letter "
                f"subject {DEAD_LETTER_PREFIX}<subject> is valid too"
            )
        if len(self._subjects) >= _SUBJECT_CACHE_SIZE:
            self._subjects.clear()  # bounded: a client cycling through subjects costs time
        self._subjects[subject] = problem
        return problem

    def _encode(
        self, m: Message, due_ms: int, now_ms: int, sequence: int
    ) -> tuple[SendResult | None, bytes, bytes]:
        """The message_log payload of ``m`` and its id's bytes, or the refusal of its
        properties or size."""
        limits = self.limits
        if m.properties:
            try:
                properties = message_log.encode_properties(m.properties)
            except ValueError as exc:
                return SendResult(ResultCode.PROPERTIES_TOO_LARGE, str(exc)), b"", b""
            if len(properties) > limits.max_properties_bytes:
                return (
                    SendResult(
                        ResultCode.PROPERTIES_TOO_LARGE,
                        f"properties take {len(properties):,} bytes encoded, more than "
                        f"max_properties_bytes ({limits.max_properties_bytes:,})",
                    ),
                    b"",
                    b"",
                )
        else:
            properties = b""
        message_id = m.message_id.encode()
        subject = m.subject.encode()
        key = None if m.key is None else m.key.encode()
        body = m.body
        size = message_log.encoded_size(
            len(message_id),
            len(subject),
            0 if key is None else len(key),
            len(properties),
            len(body),
        )
        if size > limits.max_record_bytes:
            return self._record_too_large(size), b"", b""
        record = message_log.encode_message(
            due_ms, sequence, now_ms, message_id, subject, key, properties, body
        )
        return None, record, message_id

    def _encode_wire(
        self, wire: bytes, start: int, due_ms: int, now_ms: int, sequence: int
    ) -> tuple[SendResult | None, bytes, bytes]:
        """``_encode`` of the message without properties encoded at ``wire[start:]``
        (the decoder checked it): its id, subject, key and body are already back to
        back there, as in a message_log payload after the head."""
        mask, id_len, subject_len, key_len, _, body_len = MSG_HEAD.unpack_from(wire, start)
        text_at = start + MSG_HEAD.size
        size = message_log.HEAD_SIZE + id_len + subject_len + key_len + body_len
        if size > self.limits.max_record_bytes:
            return self._record_too_large(size), b"", b""
        head = message_log.HEAD.pack(
            due_ms,
            sequence,
            now_ms,
            message_log.FLAG_KEY if mask & MSG_KEY else 0,
            id_len,
            subject_len,
            key_len,
            0,
            body_len,
        )
        end = text_at + size - message_log.HEAD_SIZE
        return None, head + wire[text_at:end], wire[text_at : text_at + id_len]

    def _record_too_large(self, size: int) -> SendResult:
        return SendResult(
            ResultCode.BODY_TOO_LARGE,
            f"the message takes {size:,} bytes as a record (id, subject, key, "
            f"properties and body), more than max_record_bytes "
            f"({self.limits.max_record_bytes:,})",
        )

    def acknowledge(self, intake: Intake) -> list[SendResult]:
        """The SEND_BATCH answer for ``intake`` once its payloads are durable.

        An accepted message's result carries ``due_ms`` and, in ``queue_offset``, its
        sequence (docs/protocol.md, "SEND_BATCH results").
        """
        dues = iter(intake.due_ms)
        sequence = intake.first_sequence
        out: list[SendResult] = []
        ok = ResultCode.OK
        for result in intake.results:
            if result is None:
                # The delay server reports the sequence in queue_offset (docs/protocol.md);
                # new_send_result skips the frozen dataclass's __init__, once per message.
                result = new_send_result(ok, "", None, None, None, sequence, next(dues))
                sequence += 1
            out.append(result)
        return out

    def refuse_accepted(self, intake: Intake, code: ResultCode, reason: str) -> Intake:
        """Take back ``intake``, the batch the last ``accept`` numbered, whose payloads
        message_log refused (a full disk: nothing of it was stored). Its accepted
        messages are answered ``code`` with ``reason`` and their sequences are given
        out again, so sequences stay dense; their ids were never held (IntakePath holds
        them once appended), so a retry is a new send. Call before the next
        ``accept``."""
        refusal = SendResult(code, reason)
        results = [refusal if result is None else result for result in intake.results]
        self._take_back(intake)
        self.refused_total[code] += len(intake.payloads)
        return Intake(results, receive_ms=intake.receive_ms)
