"""Cancel and reschedule tombstones: message_log records of types CANCEL and RESCHEDULE.

A producer's CANCEL or RESCHEDULE is appended to message_log like a message, so it is
durable under the same flush policy and is replayed in log order: the replayer meets it
after every message acknowledged before it, resolves the message id through the id
index (delayd.logs.id_index) and withdraws the message (docs/cancel.md). Tombstones
take no sequence: sequences number messages only.

Payloads (little-endian, under the storage frame's CRC like every record)::

    cancel     := receive_ms:i64 id_len:u16 id:byte[id_len]                (type 3)
    reschedule := due_ms:i64 receive_ms:i64 id_len:u16 id:byte[id_len]     (type 5; 4)

A reschedule of type 5 (RESCHEDULE_COPY, written by this version) makes every replay
append the moved copy, whether or not the leader moves the message: schedule_log is
then a function of message_log alone, the same on every member of a group, and the
leader records a copy it did not move as NOT_MOVED in dispatch_log. Type 4, written
before, has the same payload; its copy was appended only when the message moved
(docs/cancel.md, "Reschedules and replication").

``due_ms`` is the new due time, computed once on receipt as for a message (a time in
the past is stored as ``receive_ms``: due at once). It comes first, at the offset where
a MESSAGE keeps its due time, so that recovery finds the bucket a reschedule may have
written to with the same read.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from delayd.logs.message_log import (
    MAX_TEXT_BYTES,
    TYPE_CANCEL,
    TYPE_RESCHEDULE,
    TYPE_RESCHEDULE_COPY,
    RecordFormatError,
)

CANCEL_HEAD = struct.Struct("<qH")
CANCEL_HEAD_SIZE = CANCEL_HEAD.size  # 8 + 2 = 10: receive_ms, id_len
assert CANCEL_HEAD_SIZE == 8 + 2
RESCHEDULE_HEAD = struct.Struct("<qqH")
RESCHEDULE_HEAD_SIZE = RESCHEDULE_HEAD.size  # 8 + 8 + 2 = 18: due_ms, receive_ms, id_len
assert RESCHEDULE_HEAD_SIZE == 8 + 8 + 2


@dataclass(frozen=True, slots=True)
class Tombstone:
    """A decoded tombstone. ``due_ms`` is the new due time (epoch ms) of a reschedule,
    None for a cancel. ``always_copies``: a reschedule whose replay appends the moved
    copy in any case (type 5); False for one of type 4 (see the module docstring)."""

    message_id: str
    receive_ms: int
    due_ms: int | None = None
    always_copies: bool = True

    @property
    def is_cancel(self) -> bool:
        return self.due_ms is None

    @property
    def rtype(self) -> int:
        if self.due_ms is None:
            return TYPE_CANCEL
        return TYPE_RESCHEDULE_COPY if self.always_copies else TYPE_RESCHEDULE


def _id_bytes(message_id: str) -> bytes:
    data = message_id.encode()
    if not data or len(data) > MAX_TEXT_BYTES:
        raise ValueError(f"message_id must be 1..{MAX_TEXT_BYTES} bytes of UTF-8")
    return data


def encode(tombstone: Tombstone) -> bytes:
    """The payload of ``tombstone`` (its frame type is ``tombstone.rtype``). Raises
    ValueError for an empty or oversized id."""
    data = _id_bytes(tombstone.message_id)
    if tombstone.due_ms is None:
        return CANCEL_HEAD.pack(tombstone.receive_ms, len(data)) + data
    return RESCHEDULE_HEAD.pack(tombstone.due_ms, tombstone.receive_ms, len(data)) + data


def decode(rtype: int, payload: bytes | memoryview) -> Tombstone:
    """The Tombstone of a record of type ``rtype``. Raises RecordFormatError."""
    if rtype == TYPE_CANCEL:
        head, due_ms = CANCEL_HEAD, None
    elif rtype in (TYPE_RESCHEDULE, TYPE_RESCHEDULE_COPY):
        head = RESCHEDULE_HEAD
    else:
        raise RecordFormatError(f"record type {rtype} is not a tombstone")
    if len(payload) < head.size:
        raise RecordFormatError(
            f"tombstone of {len(payload)} bytes is shorter than its {head.size}-byte head"
        )
    if rtype == TYPE_CANCEL:
        receive_ms, id_len = head.unpack_from(payload, 0)
    else:
        due_ms, receive_ms, id_len = head.unpack_from(payload, 0)
    if head.size + id_len != len(payload):
        raise RecordFormatError(
            f"tombstone id_len is {id_len}, the record has {len(payload) - head.size} bytes "
            "after its head"
        )
    try:
        message_id = bytes(payload[head.size :]).decode()
    except UnicodeDecodeError:
        raise RecordFormatError("tombstone message_id is not valid UTF-8") from None
    return Tombstone(message_id, receive_ms, due_ms, rtype != TYPE_RESCHEDULE)
