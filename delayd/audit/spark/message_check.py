"""Where message_log is still present: every accepted message is in schedule_log once.

Each message_log record is looked up by its offset among the schedule_log records'
``message_log_offset`` (the replayer copies the offset into every record it writes;
docs/replay.md). A MESSAGE must be found once. A rescheduled message has more records,
but only its first carries the MESSAGE's offset: each copy carries the offset of the
RESCHEDULE tombstone that appended it (docs/cancel.md), so a RESCHEDULE is found once
or not at all — not at all when the id had no record, or, for a tombstone of type 4
(written before replication), when there was nothing to move (cancelled or already
delivered: that version wrote no copy and, as the tombstone says nothing of the answer,
the audit checks the converse instead: every moved record has its copy,
across_buckets.py). A type 5 tombstone's copy is there whatever the answer, void
(NOT_MOVED) when it was not moved. A CANCEL is never found.

A record not found whose due time lies in a bucket where reading schedule_log stopped
early may be in the part that could not be read: it is ``unverified``. Which bucket a
due time falls in depends on the data directory's segment_scale; the check takes the
widest bucket (60 minutes), so it needs no scale.
"""

from __future__ import annotations

from functools import reduce

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from delayd.audit.config import AuditConfig
from delayd.audit.kinds import ERROR, NOT_SCHEDULED, NOTICE, SCHEDULED_TWICE, TORN_TAIL
from delayd.audit.spark.queries import fetch, literal
from delayd.logs import log_files
from delayd.logs.buckets import MAX_SEGMENT_SCALE, bucket_width_ms
from delayd.logs.message_log import TYPE_CANCEL, TYPE_MESSAGE, TYPE_RESCHEDULE, describe_type

# message_log's ``kind`` column (read/messages.py names record types with describe_type).
MESSAGE = describe_type(TYPE_MESSAGE)
CANCEL = describe_type(TYPE_CANCEL)
RESCHEDULE = describe_type(TYPE_RESCHEDULE)
# What message_check keeps of a message_log row.
_COLUMNS = [
    "server",
    "message_log_offset",
    "record_kind",
    "message_id",
    "due_ms",
    "file",
    "problem",
    "detail",
]


def message_check(
    records: DataFrame,
    stops: list[tuple[str, int]],
    messages: DataFrame,
    config: AuditConfig,
) -> DataFrame:
    """One row per message_log row (its problem rows too, unjudged) with ``record_kind``
    (message_log's ``kind``), ``copies`` (how many schedule_log records name its offset)
    and its judgement: ``not_scheduled`` (a message found in none, and received before
    the cutoff: a newer one may not be replayed yet), ``scheduled_twice`` (found more
    often than it can be: a message or a reschedule more than once, a cancel at all),
    ``unverified`` (not found, but maybe in a part that could not be read).
    ``records`` are the schedule_log records (server, message_log_offset) of every
    server; ``stops`` (server, the bucket's start in ms) the buckets where reading
    schedule_log stopped early (few: each is a torn or corrupt file)."""
    copies = records.groupBy("server", "message_log_offset").agg(F.expr("count(*) AS copies"))
    rows = messages.selectExpr(
        "server",
        "offset AS message_log_offset",
        "kind AS record_kind",
        "message_id",
        "due_ms",
        "receive_ms",
        "file",
        "problem",
        "detail",
    ).join(copies, ["server", "message_log_offset"], "left")
    widest_ms = bucket_width_ms(MAX_SEGMENT_SCALE)
    in_stopped = [
        f"(server = {literal(server)} AND due_ms >= {start_ms} AND due_ms < {start_ms + widest_ms})"
        for server, start_ms in stops
    ]
    judged = rows.selectExpr(*_COLUMNS, "receive_ms", "coalesce(copies, 0) AS copies")
    missing = (
        f"problem IS NULL AND record_kind = {literal(MESSAGE)} AND copies = 0 "
        f"AND receive_ms < {config.cutoff_ms}"
    )
    maybe_unread = f"coalesce({' OR '.join(in_stopped) or 'false'}, false)"
    too_many = f"IF(record_kind = {literal(CANCEL)}, copies > 0, copies > 1)"
    return judged.selectExpr(
        *_COLUMNS,
        "copies",
        f"coalesce({missing} AND NOT {maybe_unread}, false) AS not_scheduled",
        f"coalesce({missing} AND {maybe_unread}, false) AS unverified",
        f"coalesce(problem IS NULL AND {too_many}, false) AS scheduled_twice",
    )


def counts_and_problems(checked: DataFrame) -> pa.Table:
    """Per server: summary.MESSAGE_COUNTS of message_check's rows, and ``problems``, its
    problem rows as corrupt_records rows (a list; their position is the byte in the
    segment: the offset less the segment's base, its name)."""
    problem = (
        f"named_struct('log', {literal(log_files.MESSAGE_LOG)}, 'file', file, "
        "'position', message_log_offset - CAST(file AS BIGINT), 'problem', problem, "
        f"'severity', IF(problem = {literal(TORN_TAIL)}, {literal(NOTICE)}, {literal(ERROR)}), "
        "'detail', detail)"
    )
    counts = [
        f"count_if(record_kind = {literal(MESSAGE)}) AS message_log_records",
        f"count_if(record_kind = {literal(CANCEL)}) AS message_log_cancels",
        f"count_if(record_kind = {literal(RESCHEDULE)}) AS message_log_reschedules",
        "count_if(not_scheduled) AS not_scheduled",
        "count_if(scheduled_twice) AS scheduled_twice",
        "count_if(unverified) AS message_unverified",
        f"collect_list(IF(problem IS NULL, NULL, {problem})) AS problems",
    ]
    return fetch(checked.groupBy("server").agg(*(F.expr(c) for c in counts)))


def findings(checked: DataFrame) -> DataFrame:
    """One discrepancy row per message_log record not in schedule_log, or in it more
    often than it can be."""
    shown = [
        f"{literal(ERROR)} AS severity",
        "server",
        "CAST(NULL AS TIMESTAMP) AS bucket",
        "CAST(NULL AS BIGINT) AS offset",
        "message_log_offset",
        "message_id",
        "due_ms",
        "CAST(NULL AS BIGINT) AS dispatched_ms",
        "CAST(NULL AS BIGINT) AS dispatches",
        "CAST(NULL AS BIGINT) AS lateness_ms",
        "format_string('%s in schedule_log %d times', record_kind, copies) AS detail",
    ]
    return reduce(
        DataFrame.unionByName,
        (
            checked.where(kind).selectExpr(f"{literal(kind)} AS kind", *shown)
            for kind in (NOT_SCHEDULED, SCHEDULED_TWICE)
        ),
    )
