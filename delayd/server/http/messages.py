"""From the API's JSON to delayd's Messages and back: due times, bodies, ids.

A due time is given as ``at`` (RFC 3339 with an offset, or epoch ms) or ``delay`` (ms,
or a duration such as ``90s`` or ``1h30m``); both become the wire's ``at_ms`` /
``delay_ms``, and the Receiver computes ``due_ms`` on receipt as for a binary send. A
message without an id gets one made as the Python clients make theirs
(delayd.message_ids), and the answer says which.
"""

from __future__ import annotations

import base64
import binascii

from delayd.durations import parse_duration_ms
from delayd.message_ids import new_message_id
from delayd.protocol import Message
from delayd.server.http.models import ConsumedMessage, ScheduleRequest
from delayd.server.http.problems import bad_input
from delayd.timestamps import parse_utc_ms

MAX_EPOCH_MS = (1 << 63) - 1  # the wire's i64
MAX_FIELD_BYTES = 65_535  # an id, subject or key: the wire's u16 length prefix


def at_ms(value: int | str, where: str) -> int:
    """``at`` as epoch ms. Raises ProblemError (422) naming ``where``."""
    if isinstance(value, int):
        if not 0 <= value <= MAX_EPOCH_MS:
            raise bad_input(f"{where}.at is {value}; give epoch milliseconds from 0 (1970)")
        return value
    try:
        ms = parse_utc_ms(value)
    except (OverflowError, ValueError) as exc:
        raise bad_input(f"{where}.at: {exc}", "invalid-delay") from None
    if not 0 <= ms <= MAX_EPOCH_MS:
        raise bad_input(f"{where}.at is {value!r}, before 1970", "invalid-delay")
    return ms


def delay_ms(value: int | str, where: str) -> int:
    """``delay`` as milliseconds. Raises ProblemError (422) naming ``where``."""
    if isinstance(value, int):
        ms = value
    else:
        try:
            ms = parse_duration_ms(value)
        except ValueError as exc:
            raise bad_input(f"{where}.delay: {exc}", "invalid-delay") from None
    if not 0 <= ms <= MAX_EPOCH_MS:
        raise bad_input(
            f"{where}.delay is {value!r}; a delay is 0 or more milliseconds "
            "(use at for an absolute time)",
            "invalid-delay",
        )
    return ms


def due(at: int | str | None, delay: int | str | None, where: str) -> tuple[int | None, int | None]:
    """(at_ms, delay_ms) of a request; at most one is set. Raises ProblemError."""
    if at is not None and delay is not None:
        raise bad_input(f"{where}: both at and delay are given; give one", "invalid-delay")
    return (
        None if at is None else at_ms(at, where),
        None if delay is None else delay_ms(delay, where),
    )


def body_bytes(request: ScheduleRequest, where: str) -> bytes:
    """The body: ``body`` as UTF-8, or ``body_base64`` decoded. Raises ProblemError."""
    if request.body is not None and request.body_base64 is not None:
        raise bad_input(f"{where}: both body and body_base64 are given; give one")
    if request.body_base64 is not None:
        try:
            return base64.b64decode(request.body_base64, validate=True)
        except (binascii.Error, ValueError):
            raise bad_input(
                f"{where}.body_base64 is not base64 (RFC 4648 alphabet, with padding)"
            ) from None
    return b"" if request.body is None else request.body.encode()


def _text(value: str, field: str, where: str) -> str:
    """``value`` if it fits a field of the wire (UTF-8, u16 length). The model
    refused text that is not Unicode (a lone surrogate) already."""
    size = len(value.encode())
    if size > MAX_FIELD_BYTES:
        raise bad_input(f"{where}.{field} takes {size:,} bytes, at most {MAX_FIELD_BYTES:,}")
    return value


def to_message(request: ScheduleRequest, where: str) -> Message:
    """The Message the intake takes for ``request``. Raises ProblemError (422)."""
    at, delay = due(request.at, request.delay, where)
    properties = {
        _text(name, "properties", where): _text(value, "properties", where)
        for name, value in request.properties.items()
    }
    key = None if request.key is None else _text(request.key, "key", where)
    return Message(
        message_id=new_message_id() if request.id is None else _text(request.id, "id", where),
        subject=_text(request.subject, "subject", where),
        key=key,
        properties=properties,
        body=body_bytes(request, where),
        at_ms=at,
        delay_ms=delay,
    )


def consumed(message: Message) -> ConsumedMessage:
    """A message a pull returns, as JSON: the body as text when it is UTF-8, and always
    as base64."""
    try:
        text: str | None = message.body.decode()
    except UnicodeDecodeError:
        text = None
    assert message.queue is not None and message.queue_offset is not None
    return ConsumedMessage(
        id=message.message_id,
        subject=message.subject,
        key=message.key,
        properties=message.properties,
        body=text,
        body_base64=base64.b64encode(message.body).decode(),
        queue=message.queue,
        queue_offset=message.queue_offset,
        store_ms=message.store_ms,
        due_ms=message.due_ms,
        dispatched_ms=message.dispatched_ms,
    )
