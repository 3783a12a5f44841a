"""Turning the arguments of ``send`` and ``send_batch`` into protocol Messages."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, TypedDict, Unpack

from delayd.client._due import send_times
from delayd.message_ids import new_message_id
from delayd.protocol import Message

# Frames are split so that a huge send_batch neither makes one frame larger than the
# server accepts nor holds the whole batch up behind one fsync: a few frames in flight
# let the server's group commit cover several at once.
MAX_FRAME_MESSAGES = 1000
MAX_FRAME_BYTES = 4 * 1024 * 1024  # well under the 16 MiB default max_frame_size
_MESSAGE_OVERHEAD = 14 + 8 * 2  # fixed head of a message, and room for its two integers
_OPTION_NAMES = "subject, body, at, delay, at_ms, delay_ms, message_id, key and properties"


class SendOptions(TypedDict, total=False):
    """The keyword arguments of ``send`` (and the keys, besides subject and body, of a
    ``send_batch`` item given as a dict), each optional.

    When it is due: ``at`` (an aware datetime) or ``at_ms`` (epoch ms UTC), or ``delay``
    (a timedelta after the server receives it) or ``delay_ms``; at most one of the four,
    none: not delayed (delayd.client._due).
    Without ``message_id`` the client makes a unique, time-ordered one. ``key`` and
    ``properties`` travel with the message to its consumers.
    """

    at: datetime | None
    delay: timedelta | None
    at_ms: int | None
    delay_ms: int | None
    message_id: str | None
    key: str | None
    properties: Mapping[str, str] | None


def build_message(
    subject: str, body: bytes | bytearray | memoryview | str, **options: Unpack[SendOptions]
) -> Message:
    """The Message to send; a ``str`` body is sent as UTF-8.

    Raises TypeError for an option SendOptions does not name or a time of the wrong
    type, ValueError for two times at once, a naive datetime, a negative delay or a body
    that is not bytes or str.
    """
    unknown = sorted(set(options) - SendOptions.__optional_keys__)
    if unknown:
        raise TypeError(f"unexpected argument {unknown[0]!r}; send takes {_OPTION_NAMES}")
    at_ms, delay_ms = send_times(
        options.get("at"), options.get("delay"), options.get("at_ms"), options.get("delay_ms")
    )
    if isinstance(body, str):
        body = body.encode()
    elif isinstance(body, (bytearray, memoryview)):
        body = bytes(body)
    elif not isinstance(body, bytes):
        raise ValueError(f"body must be bytes or str, got {type(body).__name__}")
    message_id, properties = options.get("message_id"), options.get("properties")
    return Message(
        message_id=new_message_id() if message_id is None else message_id,
        subject=subject,
        key=options.get("key"),
        properties={} if properties is None else dict(properties),
        body=body,
        at_ms=at_ms,
        delay_ms=delay_ms,
    )


def coerce_batch(messages: Iterable[Any]) -> list[Message]:
    """The Messages of a ``send_batch`` argument.

    Each item is a ``delayd.protocol.Message``, a mapping of ``send``'s arguments
    (``{"subject": ..., "body": ..., "delay_ms": ...}``), or a ``(subject, body)`` pair.
    Raises ValueError for anything else (naming the item's index).
    """
    out: list[Message] = []
    for index, item in enumerate(messages):
        if isinstance(item, Message):
            out.append(item)
        elif isinstance(item, Mapping):
            try:
                out.append(build_message(**item))
            except TypeError as exc:
                raise ValueError(f"send_batch item {index}: {exc}") from None
        elif isinstance(item, tuple) and len(item) == 2:
            out.append(build_message(item[0], item[1]))
        else:
            raise ValueError(
                f"send_batch item {index} is a {type(item).__name__}; give a "
                "delayd.protocol.Message, a dict of send() arguments or a (subject, body) pair"
            )
    return out


def _size(m: Message) -> int:
    size = _MESSAGE_OVERHEAD + len(m.body) + len(m.message_id) * 4 + len(m.subject)
    if m.key:
        size += len(m.key) * 4
    for name, value in m.properties.items():
        size += 4 + (len(name) + len(value)) * 4  # up to 4 UTF-8 bytes per character
    return size


def split_frames(
    messages: list[Message],
    *,
    max_messages: int = MAX_FRAME_MESSAGES,
    max_bytes: int = MAX_FRAME_BYTES,
) -> list[list[Message]]:
    """``messages`` cut into runs of at most ``max_messages`` and about ``max_bytes``.

    A single message larger than ``max_bytes`` gets a frame of its own (the server then
    refuses it by size, per message, rather than the client refusing the whole batch).
    """
    frames: list[list[Message]] = []
    current: list[Message] = []
    current_bytes = 0
    for m in messages:
        # _size inlined for the message without key or properties: it runs per message
        if m.key or m.properties:
            size = _size(m)
        else:
            size = _MESSAGE_OVERHEAD + len(m.body) + len(m.message_id) * 4 + len(m.subject)
        if current and (len(current) >= max_messages or current_bytes + size > max_bytes):
            frames.append(current)
            current, current_bytes = [], 0
        current.append(m)
        current_bytes += size
    if current:
        frames.append(current)
    return frames
