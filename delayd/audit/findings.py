"""The findings tables: discrepancies (one row per finding and record, with the message
id) and corrupt records (one row per problem a reader met)."""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from delayd.audit.kinds import TORN_TAIL
from delayd.audit.reconcile import (
    CANCELLED_AFTER_DISPATCH,
    COPY_MISSING,
    DEAD_LETTERED,
    DISPATCHED_AFTER_CANCEL,
    DUPLICATE_DISPATCH,
    DUPLICATE_ID,
    EARLY,
    LATE,
    NOT_SCHEDULED,
    NOTICES,
    OVERDUE,
    SCHEDULED_TWICE,
    UNKNOWN_RECORD,
)
from delayd.audit.result import ERROR, NOTICE

DISCREPANCY_COLUMNS = [
    "kind",
    "severity",
    "server",
    "bucket",
    "offset",
    "message_log_offset",
    "message_id",
    "due_ms",
    "dispatched_ms",
    "dispatches",
    "lateness_ms",
    "detail",
]
RECORD_KINDS = (
    OVERDUE,
    DUPLICATE_DISPATCH,
    DUPLICATE_ID,
    EARLY,
    LATE,
    DEAD_LETTERED,
    UNKNOWN_RECORD,
    DISPATCHED_AFTER_CANCEL,
    CANCELLED_AFTER_DISPATCH,
    COPY_MISSING,
)


def _kinds(*kinds: str) -> Column:
    """The kinds whose flag column (same name) is true, as an array."""
    return F.array_compact(F.array(*(F.when(F.col(kind), F.lit(kind)) for kind in kinds)))


def record_findings(status: DataFrame) -> DataFrame:
    """One row per finding and schedule_log record (a record late and dispatched twice
    has two rows); notices (dead_lettered) included, marked by severity. ``status`` is
    with_duplicate_ids' output. No message ids yet: inputs.with_message_ids adds them."""
    kind = F.col("kind")
    detail = (
        F.when(kind == DUPLICATE_DISPATCH, F.format_string("dispatched %d times", "dispatches"))
        .when(kind == DUPLICATE_ID, F.format_string("id dispatched at %d records", "id_records"))
        .when(kind.isin(EARLY, LATE), F.format_string("%+d ms", "lateness_ms"))
        .when(kind == UNKNOWN_RECORD, F.lit("dispatch_log entry for an offset with no record"))
        .when(kind == DISPATCHED_AFTER_CANCEL, F.lit("withdrawn (cancelled or moved), then sent"))
        .when(kind == CANCELLED_AFTER_DISPATCH, F.lit("sent, then cancelled or moved"))
        .when(kind == COPY_MISSING, F.lit("rescheduled, but no later record of its id"))
    )
    return (
        status.withColumn("kind", F.explode(_kinds(*RECORD_KINDS)))
        .withColumns(
            {"severity": F.when(kind.isin(*NOTICES), NOTICE).otherwise(ERROR), "detail": detail}
        )
        .select(*(c for c in DISCREPANCY_COLUMNS if c != "message_id"))
    )


def message_findings(checked: DataFrame) -> DataFrame:
    """One row per message_log record not in schedule_log, or in it more often than it
    can be."""
    return (
        checked.withColumn("kind", F.explode(_kinds(NOT_SCHEDULED, SCHEDULED_TWICE)))
        .withColumns(
            {
                "severity": F.lit(ERROR),
                "detail": F.format_string("%s in schedule_log %d times", "record_kind", "copies"),
                "bucket": F.lit(None).cast("timestamp"),
                "offset": F.lit(None).cast("long"),
                "dispatched_ms": F.lit(None).cast("long"),
                "dispatches": F.lit(None).cast("long"),
                "lateness_ms": F.lit(None).cast("long"),
            }
        )
        .select(*DISCREPANCY_COLUMNS)
    )


def problems(
    log: str, frame: DataFrame, file: Column, position: Column, problem: str, detail: str
) -> DataFrame:
    """The problem rows of ``frame`` (those whose column ``problem`` is set), as rows of
    the corrupt_records table."""
    kind = F.col(problem)
    return frame.where(kind.isNotNull()).select(
        "server",
        F.lit(log).alias("log"),
        file.alias("file"),
        position.alias("position"),
        kind.alias("problem"),
        F.when(kind == TORN_TAIL, NOTICE).otherwise(ERROR).alias("severity"),
        F.col(detail).alias("detail"),
    )
