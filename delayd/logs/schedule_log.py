"""schedule_log: one file of records per UTC time bucket, holding what delivery needs.

``<data>/delay/schedule_log/yyyyMMddHHmm`` is a storage RecordFile (CRC-framed records,
torn tail cut on open) named by its bucket's UTC start (delayd.logs.buckets). The
replayer appends one SCHEDULED record per message_log record, in message_log order;
the wheel (delayd.wheel) loads a bucket shortly before it is due and reads bodies
from it, so message_log can be deleted once replayed. This module is the one codec of
the format; docs/delay-formats.md has the grammar and a worked example.

Payload of a record of type SCHEDULED (little-endian)::

    scheduled := message_log_offset:u64 message

where ``message`` is the message_log MESSAGE payload (delayd.logs.message_log), byte
for byte: due_ms, sequence, receive_ms, id, subject, key, properties, body (a
reschedule's copy differs in two fields: docs/cancel.md). QMQ's
ScheduleLog appender copies the message_log record in the same way, behind
schedule_time, sequence and lengths. Keeping the message_log offset is what makes
replay idempotent: after a crash the replayer cuts every record whose
message_log_offset is at or past its checkpoint and appends those again
(docs/replay.md). Keeping the bytes identical makes that re-append land every record at
the offset it had before, so (bucket, offset) names the same message across crashes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from delayd.logs import message_log
from delayd.logs.message_log import MessageRecord, RecordFormatError
from storage.framing import FIRST_USER_TYPE

TYPE_SCHEDULED = FIRST_USER_TYPE  # 2: a scheduled message, layout above
# 3..255 are free for later kinds. Cancels and moves need none: they are tombstones in
# message_log and entries in dispatch_log (docs/cancel.md).

PREFIX = struct.Struct("<Q")
PREFIX_SIZE = PREFIX.size  # 8: message_log_offset
assert PREFIX_SIZE == 8
DUE_MS_AT = PREFIX_SIZE  # due_ms is the first field of the embedded message
HEAD_SIZE = PREFIX_SIZE + message_log.HEAD_SIZE  # 8 + 39 = 47 bytes before the id


@dataclass(frozen=True, slots=True)
class ScheduleRecord:
    """One decoded schedule_log record: where it came from, and the message."""

    message_log_offset: int
    message: MessageRecord


def encode_scheduled(message_log_offset: int, message_payload: bytes) -> bytes:
    """The SCHEDULED payload for the message_log record at ``message_log_offset`` whose
    payload is ``message_payload`` (copied unchanged)."""
    return PREFIX.pack(message_log_offset) + message_payload


def message_log_offset_of(payload: bytes | memoryview) -> int:
    """The message_log offset of a SCHEDULED payload, without decoding the rest."""
    return PREFIX.unpack_from(payload, 0)[0]


def due_ms_of(payload: bytes | memoryview) -> int:
    """The due_ms (epoch ms) of a SCHEDULED payload, without decoding the rest."""
    return message_log.due_ms_of(payload, DUE_MS_AT)


def decode_scheduled(payload: bytes) -> ScheduleRecord:
    """The ScheduleRecord of a SCHEDULED payload. Raises RecordFormatError."""
    if len(payload) < PREFIX_SIZE:
        raise RecordFormatError(
            f"schedule record of {len(payload)} bytes is shorter than its "
            f"{PREFIX_SIZE}-byte message_log offset"
        )
    return ScheduleRecord(
        message_log_offset_of(payload), message_log.decode_message(payload, PREFIX_SIZE)
    )


def check_type(rtype: int, path: str, offset: int) -> None:
    """Raise RecordFormatError unless ``rtype`` is a record type this version reads."""
    if rtype != TYPE_SCHEDULED:
        raise RecordFormatError(
            f"{path}@{offset}: schedule_log record of type {rtype} is not supported by "
            "this version of delayd"
        )
