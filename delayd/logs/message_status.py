"""Where a message is, by id: pending, delivered, dead-lettered, cancelled, or unknown.

The answer comes from what cancel already reads (delayd.server.cancels), without
changing anything:

    id ─▶ KnownIds (accepted, not yet replayed: pending with its due time)
       ─▶ id index ─▶ the current schedule_log record (highest message_log offset: a
          reschedule's copy beats the original)
       ─▶ its dispatch_log entry: DISPATCHED (with the time and the broker group),
          DEAD_LETTERED, CANCELLED; none yet: pending, due at the record's due time

A message the sender holds in a batch has no entry yet, so it is pending until the
broker's ack is recorded. Once retention removed a delivered bucket (docs/operations.md,
"Retention") its records are gone and the id is unknown.

Reads files synchronously, as a cancel does, on the thread that runs the replayer (the
index and the dispatch_log files are used by one thread at a time). A query on the
logs, below every listener: the HTTP API asks it, and the binary protocol could.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from delayd.logs import moves
from delayd.logs.dispatch_files import DispatchFiles
from delayd.logs.dispatch_log import DispatchEntry, EntryKind, find_entry
from delayd.logs.id_index import IdIndex, Location
from delayd.logs.known_ids import KnownIds


class MessageState(enum.Enum):
    PENDING = "pending"
    DELIVERED = "delivered"
    DEAD_LETTERED = "dead_lettered"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class MessageStatus:
    """``due_ms``: when it is (or was) due, epoch ms; ``at_ms``: when it was dispatched,
    dead-lettered or cancelled; ``group``: the broker group that took it (delivered)."""

    state: MessageState
    due_ms: int | None = None
    at_ms: int | None = None
    group: str | None = None


UNKNOWN = MessageStatus(MessageState.UNKNOWN)
_FATES = {
    EntryKind.DISPATCHED: MessageState.DELIVERED,
    EntryKind.DEAD_LETTERED: MessageState.DEAD_LETTERED,
    EntryKind.CANCELLED: MessageState.CANCELLED,
}


def message_status(
    message_id: str, index: IdIndex, dispatch: DispatchFiles, known: KnownIds | None
) -> MessageStatus:
    """The state of the message with ``message_id``; see the module docstring.
    Raises CorruptionError for a damaged index chain or dispatch_log entry."""
    locations = index.lookup(message_id)
    if not locations:
        # Accepted and durable, not in the index until the replayer reaches it.
        due_ms = None if known is None else known.held_due_ms(message_id.encode())
        return UNKNOWN if due_ms is None else MessageStatus(MessageState.PENDING, due_ms)
    files = dispatch.files  # reads see entries not yet flushed: they are pwritten

    def entry_of(at: Location) -> DispatchEntry | None:
        return find_entry(files.fs, files.path(at.bucket_ms), at.offset)

    current = moves.current(locations, entry_of)
    if current is None:  # only void copies are left (the original went with retention)
        return UNKNOWN
    entry = entry_of(current)
    state = None if entry is None else _FATES.get(entry.kind)
    if entry is None or state is None:
        return MessageStatus(MessageState.PENDING, current.due_ms)
    group = entry.group or None if state is MessageState.DELIVERED else None
    return MessageStatus(state, current.due_ms, entry.at_ms, group)
