"""The summary table: counts per (server, bucket), per server and overall, with exact
lateness percentiles — from one pass over the per-record status.

That pass groups the records by (server, bucket, lateness_ms) and counts each flag:
lateness is a whole number of milliseconds, and a bucket's dispatches take few distinct
values, so the result is small (thousands of rows for millions of records). Every level
is then added up from it: the counts by summing, the percentiles by reading p50 and p99
off the cumulative counts of each level's lateness histogram — exactly, by nearest
rank: the smallest lateness with at least ``ceil(p * n)`` of the level's ``n``
dispatched records at or below it. (``percentile_approx`` per server and overall folds
millions of values into one sketch each, which cost more than the rest of the summary.)
"""

from __future__ import annotations

from pyspark import StorageLevel
from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

LEVELS = ["server", "bucket"]
FLAGS = (  # counted as they are
    "scheduled",
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
    "copy_missing",
)
COUNTS = ("dispatched", "dispatch_entries", *FLAGS)


def _attach(table: DataFrame, extra: DataFrame) -> DataFrame:
    """``table`` with the columns of ``extra``, matched on (server, bucket) where null
    means "all" on both sides."""
    extra = extra.withColumnsRenamed({"server": "_server", "bucket": "_bucket"})
    on = table["server"].eqNullSafe(extra["_server"]) & table["bucket"].eqNullSafe(extra["_bucket"])
    return table.join(extra, on, "left").drop("_server", "_bucket")


def bucket_summary(status: DataFrame, duplicates: DataFrame) -> DataFrame:
    """Rows per (server, bucket), per server (bucket null) and overall (both null).
    ``status`` is with_duplicate_ids' output, ``duplicates`` duplicate_ids'."""
    grouped = (
        status.groupBy(*LEVELS, "lateness_ms")
        .agg(
            F.count_if(F.col("scheduled") & F.col("dispatched")).alias("dispatched"),
            F.sum("dispatches").alias("dispatch_entries"),
            *(F.count_if(F.col(flag)).alias(flag) for flag in FLAGS),
        )
        .persist(StorageLevel.MEMORY_AND_DISK)
    )
    counts = grouped.rollup(*LEVELS).agg(*(F.sum(c).alias(c) for c in COUNTS))
    by_id = duplicates.rollup(*LEVELS).agg(F.count_distinct("message_id").alias("duplicate_by_id"))
    table = _attach(_attach(counts, by_id), lateness_percentiles(grouped))
    return table.select(
        *LEVELS,
        "scheduled",
        "dispatched",
        "dispatch_entries",
        "duplicate_dispatch",
        F.coalesce("duplicate_by_id", F.lit(0)).alias("duplicate_by_id"),
        *(flag for flag in FLAGS if flag not in ("scheduled", "duplicate_dispatch")),
        "lateness_p50_ms",
        "lateness_p99_ms",
        "lateness_max_ms",
    )


def lateness_percentiles(grouped: DataFrame) -> DataFrame:
    """p50, p99 and max lateness of the dispatched records per (server, bucket), per
    server and overall, from bucket_summary's grouped counts."""
    per_bucket = grouped.where(F.col("dispatched") > 0).select(
        *LEVELS, "lateness_ms", F.col("dispatched").alias("n")
    )
    per_server = per_bucket.groupBy("server", "lateness_ms").agg(F.sum("n").alias("n"))
    overall = per_bucket.groupBy("lateness_ms").agg(F.sum("n").alias("n"))
    histograms = per_bucket.unionByName(per_server, allowMissingColumns=True).unionByName(
        overall, allowMissingColumns=True
    )
    level = Window.partitionBy(*LEVELS)
    running = level.orderBy("lateness_ms").rowsBetween(Window.unboundedPreceding, 0)
    ranked = histograms.withColumns(
        {"below": F.sum("n").over(running), "total": F.sum("n").over(level)}
    )

    def at(p: float) -> Column:
        return F.min(F.when(F.col("below") >= F.ceil(F.col("total") * p), F.col("lateness_ms")))

    return ranked.groupBy(*LEVELS).agg(
        at(0.5).alias("lateness_p50_ms"),
        at(0.99).alias("lateness_p99_ms"),
        F.max("lateness_ms").alias("lateness_max_ms"),
    )
