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


# judge/pairing.py: one row per schedule_log row of a bucket, with what that bucket's
# dispatch_log file says about its offset; also one row per offset with entries and no
# schedule_log row.
PAIRED = pa.schema(
    [
        pa.field("bucket", BUCKET_TYPE),
        pa.field("offset", pa.int64()),
        pa.field("message_log_offset", pa.int64()),
        pa.field("due_ms", pa.int64()),
        pa.field("message_id", pa.string()),
        pa.field("sequence", pa.int64()),
        pa.field("schedule_problem", pa.string()),
        pa.field("schedule_detail", pa.string()),
        pa.field("dispatches", pa.int64()),  # DISPATCHED entries
        pa.field("dead_letters", pa.int64()),  # DEAD_LETTERED entries
        pa.field("withdrawals", pa.int64()),  # CANCELLED and RESCHEDULED entries
        pa.field("fate", pa.int8()),  # the first entry's EntryKind value
        pa.field("dispatched_ms", pa.int64()),  # the first DISPATCHED entry's at_ms
        pa.field("first_entry_ms", pa.int64()),
    ]
)


# What a run of buckets hands the job (delayd.reconciled, judge/bucket_runs.py). Times are epoch
# ms; counts are records. Each row is one of:
#
# * a bucket's counts (``summary``), a lateness value and how many dispatched records of
#   the run have it (``lateness``), a finding (``finding``), a problem a reader met
#   (``problem``), or the run's records of one id hash range (``ids``: judge/id_ranges.py)
#   — one struct set, every other column null;
# * when asked (option ``records``): a schedule_log record (``record``) — the records of
#   a few buckets read again — or only its message_log offset (``scheduled_offset``),
#   for the message_log check.
COUNTS = (
    "scheduled",
    "dispatched",
    "dispatch_entries",
    "duplicate_dispatch",
    "dead_lettered",
    "cancelled",
    "rescheduled",
    "pending",
    "overdue",
    "unverified",
    "early",
    "late",
    "unknown_record",
    "dispatched_after_cancel",
    "cancelled_after_dispatch",
)
PERCENTILES = ("lateness_p50_ms", "lateness_p99_ms", "lateness_max_ms")
BUCKET_SUMMARY = pa.struct(
    [
        pa.field("bucket", BUCKET_TYPE),
        *(pa.field(name, pa.int64()) for name in (*COUNTS, *PERCENTILES)),
    ]
)
LATENESS = pa.struct([pa.field("lateness_ms", pa.int64()), pa.field("records", pa.int64())])
FINDING = pa.struct(  # a row of discrepancies/, but its server
    [
        pa.field("kind", pa.string()),
        pa.field("severity", pa.string()),
        pa.field("bucket", BUCKET_TYPE),
        pa.field("offset", pa.int64()),
        pa.field("message_log_offset", pa.int64()),
        pa.field("message_id", pa.string()),
        pa.field("due_ms", pa.int64()),
        pa.field("dispatched_ms", pa.int64()),
        pa.field("dispatches", pa.int64()),
        pa.field("lateness_ms", pa.int64()),
        pa.field("detail", pa.string()),
    ]
)
PROBLEM = pa.struct(  # a row of corrupt_records/, but its server
    [
        pa.field("log", pa.string()),
        pa.field("file", pa.string()),
        pa.field("position", pa.int64()),  # the byte in the file
        pa.field("problem", pa.string()),
        pa.field("severity", pa.string()),
        pa.field("detail", pa.string()),
    ]
)
RECORD = pa.struct(  # what a finding about a record shows, and its id's hash
    [
        pa.field("bucket", BUCKET_TYPE),
        pa.field("offset", pa.int64()),
        pa.field("message_log_offset", pa.int64()),
        pa.field("message_id", pa.string()),
        pa.field("id_hash", pa.int64()),  # id_ranges.id_hashes
        pa.field("due_ms", pa.int64()),
        pa.field("dispatched_ms", pa.int64()),  # the first DISPATCHED entry's at_ms
        pa.field("dispatches", pa.int64()),  # DISPATCHED entries
        pa.field("lateness_ms", pa.int64()),  # null when withdrawn (judge/verdicts.py)
        pa.field("sequence", pa.int64()),  # the send's (a reschedule's copy keeps it)
        pa.field("fate", pa.int8()),  # the first entry's EntryKind value, null for none
    ]
)
ID_RANGE = pa.struct([pa.field("range", pa.int32()), pa.field("blob", pa.binary())])
SIDE_TABLES = {
    "summary": BUCKET_SUMMARY,
    "lateness": LATENESS,
    "finding": FINDING,
    "problem": PROBLEM,
    "ids": ID_RANGE,
}
RECONCILED = pa.schema(
    [
        *(pa.field(name, type_) for name, type_ in SIDE_TABLES.items()),
        pa.field("record", RECORD),
        pa.field("scheduled_offset", pa.int64()),
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
