"""Where message_log is still present: every accepted message is in schedule_log once.

Each message_log record is looked up by its offset among the schedule_log records'
``message_log_offset`` (the replayer copies the offset into every record it writes;
docs/replay.md). A MESSAGE must be found once. A rescheduled message has more records,
but only its first carries the MESSAGE's offset: each copy carries the offset of the
RESCHEDULE tombstone that moved it (docs/cancel.md), so a RESCHEDULE is found once or
not at all — not at all when there was nothing to move (the id was unknown, cancelled
or already delivered: the server writes no copy and, as the tombstone says nothing of
the answer, the audit checks the converse instead: every RESCHEDULED record has its
copy, reconcile.missing_copies). A CANCEL is never found.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from delayd.audit.config import AuditConfig
from delayd.audit.reconcile import flag, is_record
from delayd.logs.buckets import MAX_SEGMENT_SCALE, bucket_width_ms
from delayd.logs.message_log import TYPE_CANCEL, TYPE_MESSAGE, TYPE_RESCHEDULE, describe_type

# message_log's ``kind`` column (decode_messages names record types with describe_type).
MESSAGE = describe_type(TYPE_MESSAGE)
CANCEL = describe_type(TYPE_CANCEL)
RESCHEDULE = describe_type(TYPE_RESCHEDULE)


def message_check(
    joined_rows: DataFrame, stops: DataFrame, messages: DataFrame, config: AuditConfig
) -> DataFrame:
    """One row per message_log row (its problem rows too, unjudged) with ``record_kind``
    (message_log's ``kind``), ``copies`` (how many schedule_log records name its offset)
    and its judgement: ``not_scheduled`` (a message found in none, and received before
    the cutoff: a newer one may not be replayed yet), ``scheduled_twice`` (found more
    often than it can be: a message or a reschedule more than once, a cancel at all).
    ``stops`` is reconcile.schedule_stops of the rows.

    A record not found whose due time lies in a bucket where reading schedule_log
    stopped early may be in the part that could not be read: it is ``unverified``. Which
    bucket a due time falls in depends on the data directory's segment_scale; the check
    takes the widest bucket (60 minutes), so it needs no scale.
    """
    copies = (
        joined_rows.where(F.col("due_ms").isNotNull())
        .groupBy("server", "message_log_offset")
        .agg(F.count("*").alias("copies"))
    )
    records = messages.select(
        "server",
        F.col("offset").alias("message_log_offset"),
        F.col("kind").alias("record_kind"),
        "message_id",
        "due_ms",
        "receive_ms",
        "file",
        "problem",
        "detail",
    )
    widest_ms = bucket_width_ms(MAX_SEGMENT_SCALE)
    stops = stops.select(
        F.col("server").alias("stop_server"), F.unix_millis("bucket").alias("stop_from_ms")
    )
    in_stopped_bucket = (
        (F.col("server") == F.col("stop_server"))
        & (F.col("due_ms") >= F.col("stop_from_ms"))
        & (F.col("due_ms") < F.col("stop_from_ms") + widest_ms)
    )
    maybe_unread = records.join(F.broadcast(stops), in_stopped_bucket, "left_semi").select(
        "server", "message_log_offset", F.lit(True).alias("maybe_unread")
    )
    joined = records.join(copies, ["server", "message_log_offset"], "left").join(
        maybe_unread, ["server", "message_log_offset"], "left"
    )
    found = F.coalesce(F.col("copies"), F.lit(0))
    record = is_record(messages)
    message = F.col("record_kind") == MESSAGE
    missing = record & message & (found == 0) & (F.col("receive_ms") < config.cutoff_ms)
    too_many = F.when(F.col("record_kind") == CANCEL, found > 0).otherwise(found > 1)
    maybe = F.coalesce(F.col("maybe_unread"), F.lit(False))
    return joined.select(
        "server",
        "message_log_offset",
        "record_kind",
        "message_id",
        "due_ms",
        "file",
        "problem",
        "detail",
        found.alias("copies"),
        flag("not_scheduled", missing & ~maybe),
        flag("unverified", missing & maybe),
        flag("scheduled_twice", record & too_many),
    )
