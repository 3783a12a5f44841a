"""The columns of the three log data sources, as Arrow schemas (the Spark schemas are
derived from these, so the batches a reader yields always match what Spark expects).

Every data column is nullable because a file's problems travel in the same rows: a
row whose ``problem`` is set (kinds.PROBLEMS: ``torn_tail``, ``corrupt``, ``format``)
names the file and the byte where reading stopped or the record that could not be
decoded, and its data columns are null — as Spark's own file sources keep
``_corrupt_record`` rows in PERMISSIVE mode. Times are epoch milliseconds, UTC, with
the unit in the name; a bucket is its UTC start as a timestamp.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

BUCKET_TYPE = pa.timestamp("us", tz="UTC")  # what Spark's TimestampType is in Arrow

_WHERE = [
    pa.field("server", pa.string()),  # the data directory's name in this audit
    pa.field("file", pa.string()),  # the file's name in its log directory
]
_MESSAGE = [
    pa.field("due_ms", pa.int64()),
    pa.field("sequence", pa.int64()),
    pa.field("receive_ms", pa.int64()),
    pa.field("message_id", pa.string()),
    pa.field("subject", pa.string()),
    pa.field("key", pa.string()),
    pa.field("body_size", pa.int64()),
]
_PROBLEM = [
    pa.field("problem", pa.string()),  # null for a record
    pa.field("detail", pa.string()),  # what is wrong, for a problem row
]

# schedule_log: one row per SCHEDULED record; offset is its byte offset in the bucket
# file, which with (server, bucket) names the message for good (docs/replay.md).
SCHEDULE_LOG = pa.schema(
    [
        *_WHERE,
        pa.field("bucket", BUCKET_TYPE),
        pa.field("offset", pa.int64()),
        pa.field("message_log_offset", pa.int64()),
        *_MESSAGE,
        *_PROBLEM,
    ]
)

# dispatch_log: one row per entry. ``kind`` is its EntryKind in lower case
# (``dispatched``, ``dead_lettered``, ``cancelled``, ``complete``, ``rescheduled``);
# ``position`` the entry's byte offset in the dispatch_log file (entries about one
# offset are in the order written: the first is its fate); ``offset`` the schedule_log
# offset it is about (for a ``complete`` mark: the schedule_log length it covers);
# ``at_ms`` the time of the event (for a ``dispatched`` entry, the dispatched_ms the
# broker acknowledged).
DISPATCH_LOG = pa.schema(
    [
        *_WHERE,
        pa.field("bucket", BUCKET_TYPE),
        pa.field("position", pa.int64()),
        pa.field("kind", pa.string()),
        pa.field("offset", pa.int64()),
        pa.field("at_ms", pa.int64()),
        pa.field("group", pa.string()),
        *_PROBLEM,
    ]
)

# message_log: one row per record; offset is its logical message_log offset (what
# schedule_log's message_log_offset points at). ``kind`` is the record's type as
# message_log.describe_type names it: ``message``, or a ``cancel`` / ``reschedule``
# tombstone (docs/cancel.md), whose row has ``message_id``, ``receive_ms`` and, for a
# reschedule, the new ``due_ms``; its other message columns are null.
MESSAGE_LOG = pa.schema(
    [
        *_WHERE,
        pa.field("offset", pa.int64()),
        pa.field("kind", pa.string()),
        *_MESSAGE,
        *_PROBLEM,
    ]
)


# delayd.paired (pairs.py): one row per schedule_log row of a bucket, with what that
# bucket's dispatch_log file says about its offset; also one row per offset with
# entries and no schedule_log row, and one per dispatch_log file with problems.
PAIRED = pa.schema(
    [
        pa.field("bucket", BUCKET_TYPE),
        pa.field("offset", pa.int64()),  # null on a dispatch_log file's problem count
        pa.field("message_log_offset", pa.int64()),
        pa.field("due_ms", pa.int64()),
        pa.field("message_id", pa.string()),
        pa.field("schedule_problem", pa.string()),
        pa.field("schedule_detail", pa.string()),
        pa.field("dispatches", pa.int64()),  # DISPATCHED entries
        pa.field("dead_letters", pa.int64()),  # DEAD_LETTERED entries
        pa.field("withdrawals", pa.int64()),  # CANCELLED and RESCHEDULED entries
        pa.field("fate", pa.int8()),  # the first entry's EntryKind value
        pa.field("dispatched_ms", pa.int64()),  # the first DISPATCHED entry's at_ms
        pa.field("first_entry_ms", pa.int64()),
        pa.field("dispatch_problems", pa.int64()),
    ]
)


def select(schema: pa.Schema, columns: Sequence[str] | None) -> pa.Schema:
    """The fields of ``schema`` named in ``columns``, in that order (all when None): what
    a reader yields when Spark is given a narrower schema (``.schema(...)``), so that
    columns nobody reads are never converted. ``problem`` must be among them: without it
    a problem row would pass for a record. Raises ValueError."""
    if columns is None:
        return schema
    unknown = [name for name in columns if name not in schema.names]
    if unknown:
        raise ValueError(f"no column {', '.join(unknown)}; the columns are {schema.names}")
    if "problem" not in columns:
        raise ValueError("a narrower schema must keep the problem column")
    return pa.schema([schema.field(name) for name in columns])
