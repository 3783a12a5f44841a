"""The records of one message id: the copy a reschedule appends, and the current one.

Every schedule_log record of an id holds the same message (id, sequence, body...) with
its own due time: the original, and one copy per RESCHEDULE tombstone replayed while
the id had a record. A copy carries its tombstone's message_log offset, so the order of
an id's records is the order of their message_log offsets (docs/cancel.md).

What replay appends is a function of message_log and the records before it: the copy's
bytes come from the latest record, whatever dispatch_log says about it, so every member
of a group derives the same bucket files. Whether the copy is the message's new home or
a void copy (NOT_MOVED: the leader refused the move) is the leader's decision, and it
is written to dispatch_log only; ``current`` reads it back.
"""

from __future__ import annotations

from collections.abc import Callable

from delayd.logs import message_log, schedule_log
from delayd.logs.dispatch_log import DispatchEntry, EntryKind
from delayd.logs.id_index import Location


def latest(locations: list[Location]) -> Location | None:
    """The record with the highest message_log offset (None for none)."""
    if len(locations) <= 1:  # the usual case: one record, never moved
        return locations[0] if locations else None
    return max(locations, key=lambda location: location.message_log_offset)


def moved_copy(locations: list[Location], due_ms: int) -> bytes | None:
    """The MESSAGE payload a reschedule to ``due_ms`` appends for an id with these
    records: the latest one's message with the new due time, which is its first field
    (the SCHEDULED prefix is the tombstone's to write). None when the id has no record:
    nothing to copy."""
    source = latest(locations)
    if source is None:
        return None
    message = source.payload[schedule_log.PREFIX_SIZE :]
    return message_log.DUE_MS.pack(due_ms) + message[message_log.DUE_MS.size :]


def current(
    locations: list[Location], entry_of: Callable[[Location], DispatchEntry | None]
) -> Location | None:
    """The record that holds the message now: the latest one that is not a NOT_MOVED
    copy (``entry_of`` gives a record's first dispatch_log entry). An id moved or
    rescheduled in vain has several records; only then is dispatch_log read. None when
    every record is a void copy (the original went with retention)."""
    if len(locations) <= 1:
        return locations[0] if locations else None
    for location in sorted(locations, key=lambda at: at.message_log_offset, reverse=True):
        entry = entry_of(location)
        if entry is None or entry.kind is not EntryKind.NOT_MOVED:
            return location
    return None
