"""A due message in the wire layout, made from its schedule_log record without decoding.

A SCHEDULED payload (delayd/logs/schedule_log.py) is the message_log offset (u64), then a
message_log record: a 39-byte head (due_ms, sequence, receive_ms, flags, five lengths)
and message_id, subject, key, properties and body. The wire's message (docs/protocol.md,
Message) holds the same id, subject, key and body bytes in the same order behind its own
14-byte head, with its integers after the body. So for a message without properties the
sender copies those bytes behind a new head and appends due_ms and dispatched_ms — the
bytes ``message_layout.encode_message`` gives for the decoded Message — instead of
decoding the record into a Message that the embedded broker then encodes again (docs/benchmarks.md,
Delivery). A message with properties takes the Message path: the wire counts
properties where message_log counts their bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from delayd.logs import message_log, schedule_log
from delayd.protocol import EncodedMessages
from delayd.protocol.message_layout import DELIVERED_TAIL, delivered_head, encode_message

if TYPE_CHECKING:
    from delayd.sender.ledger import Item

TEXT_AT = schedule_log.HEAD_SIZE  # where message_id starts in a SCHEDULED payload
TAIL = DELIVERED_TAIL  # due_ms, dispatched_ms: the wire's last two integers


def wire_head(head: message_log.MessageHead) -> bytes | None:
    """The wire head of the message whose message_log head is ``head`` (read at
    schedule_log.PREFIX_SIZE of a SCHEDULED payload), as delivered: None when it has
    properties (it must be encoded from a Message)."""
    if head.properties_len:
        return None
    return delivered_head(head.id_len, head.subject_len, head.key_len, head.body_len)


def encode_batch(batch: Sequence[Item], dispatched_ms: int) -> EncodedMessages:
    """The batch in the wire encoding, as ``encode_message`` of each item's Message
    would give it, mostly copied from the schedule_log payloads."""
    out = bytearray()
    bounds = [0]
    tail = TAIL.pack
    for item in batch:
        head = item.wire_head
        if head is None or item.dead:
            out += encode_message(item.message(dispatched_ms))
        else:
            out += head
            out += memoryview(item.payload)[TEXT_AT:]
            out += tail(item.due_ms, dispatched_ms)
        bounds.append(len(out))
    return EncodedMessages(bytes(out), tuple(bounds))
