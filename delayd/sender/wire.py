"""A due message in the wire layout, made from its schedule_log record without decoding.

A SCHEDULED payload (delayd/logs/schedule_log.py) is the message_log offset (u64), then a
message_log record: a 39-byte head (due_ms, sequence, receive_ms, flags, five lengths)
and message_id, subject, key, properties and body. The wire's message (docs/protocol.md,
Message) holds the same id, subject, key and body bytes in the same order behind its own
14-byte head, with its integers after the body. So for a message without properties the
sender copies those bytes behind a new head and appends due_ms and dispatched_ms — the
bytes ``codec.encode_message`` gives for the decoded Message — instead of decoding the
record into a Message that the embedded broker then encodes again (docs/benchmarks.md,
Delivery). A message with properties takes the Message path: the wire counts
properties where message_log counts their bytes.
"""

from __future__ import annotations

import struct

from delayd.logs import message_log, schedule_log
from delayd.protocol.codec import MSG_DISPATCHED_MS, MSG_DUE_MS, MSG_HEAD, MSG_KEY

TEXT_AT = schedule_log.HEAD_SIZE  # 8 + 39: where message_id starts in a SCHEDULED payload
TAIL = struct.Struct("<qq")  # due_ms, dispatched_ms: the wire's last two integers
_HEAD_AT = schedule_log.PREFIX_SIZE
_HEAD = message_log.HEAD
_DELIVERED = MSG_DUE_MS | MSG_DISPATCHED_MS


class ScheduledHead:
    """What the sender needs of a SCHEDULED payload: due_ms, message_id, subject and key
    (decoded), and ``wire_head``, the wire head of its message (None when it has
    properties: it must be encoded from a Message)."""

    __slots__ = ("due_ms", "key", "message_id", "subject", "wire_head")

    def __init__(
        self, due_ms: int, message_id: str, subject: str, key: str | None, wire_head: bytes | None
    ) -> None:
        self.due_ms = due_ms
        self.message_id = message_id
        self.subject = subject
        self.key = key
        self.wire_head = wire_head


def read_head(payload: bytes) -> ScheduledHead | None:
    """The head of a SCHEDULED payload, or None when it is not a well-formed one (the
    caller then decodes it the full way, which says what is wrong). Raises nothing."""
    if len(payload) < TEXT_AT:
        return None
    due_ms, _, _, flags, id_len, subject_len, key_len, props_len, body_len = _HEAD.unpack_from(
        payload, _HEAD_AT
    )
    if flags & ~message_log.KNOWN_FLAGS or (key_len and not flags & message_log.FLAG_KEY):
        return None
    if TEXT_AT + id_len + subject_len + key_len + props_len + body_len != len(payload):
        return None
    subject_at = TEXT_AT + id_len
    key_at = subject_at + subject_len
    try:
        message_id = payload[TEXT_AT:subject_at].decode()
        subject = payload[subject_at:key_at].decode()
        key = payload[key_at : key_at + key_len].decode() if flags & message_log.FLAG_KEY else None
    except UnicodeDecodeError:
        return None
    wire_head = None
    if not props_len:
        mask = _DELIVERED | (MSG_KEY if key is not None else 0)
        wire_head = MSG_HEAD.pack(mask, id_len, subject_len, key_len, 0, body_len)
    return ScheduledHead(due_ms, message_id, subject, key, wire_head)
