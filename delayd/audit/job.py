"""One audit run on a SparkSession: read the logs of every server once, reconcile,
write the Parquet tables, and hand back what the report shows.

Output (``--out``): ``summary/`` (per bucket, per server, overall), ``discrepancies/``
(one row per finding, with message ids), ``corrupt_records/`` (file, position, kind),
all Parquet; the report (report.py) adds ``report.html`` and ``report.txt``.

Each log is decoded once: schedule_log and dispatch_log are joined bucket by bucket
as they are read (pairs.py) and the result is cached (reconcile.py says how the
problem rows travel with it), message_log in one check whose result is cached; every
table is computed from those two.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import reduce

import pyarrow as pa
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from delayd.audit import files, findings, inputs, reconcile
from delayd.audit.config import AuditConfig
from delayd.audit.message_check import CANCEL, MESSAGE, RESCHEDULE, message_check
from delayd.audit.result import ERROR, REPORT_ROWS, AuditResult
from delayd.audit.session import prepare
from delayd.audit.summary import bucket_summary

SUMMARY = "summary"
DISCREPANCIES = "discrepancies"
CORRUPT_RECORDS = "corrupt_records"
TABLES = (SUMMARY, DISCREPANCIES, CORRUPT_RECORDS)
BYPASS_PARTIAL_AGGREGATION = "spark.sql.execution.bypassPartialAggregation"
LEVEL = StorageLevel.MEMORY_AND_DISK
BROADCAST_ROWS = 100_000  # a small table up to this size is held on the driver


def run(spark: SparkSession, config: AuditConfig) -> AuditResult:
    """Audit ``config.servers`` and write the tables under ``config.out``. Raises
    FileNotFoundError for a data directory that is not one."""
    started = time.monotonic()
    prepare(spark)
    for server in config.servers:
        files.list_files(server.data_dir, files.SCHEDULE_LOG)  # fail early, with the path
    joined, cached, marks = _join_logs(spark, config)
    stops = reconcile.schedule_stops(marks)
    damaged = reconcile.damaged_dispatch_logs(marks)
    problems = [
        findings.problems(
            files.SCHEDULE_LOG,
            marks,
            inputs.bucket_file(),
            F.col("offset"),
            "schedule_problem",
            "schedule_detail",
        ),
        *_dispatch_problems(spark, config, damaged),
    ]
    checked = None
    if inputs.has_message_log(config):
        checked = _check_message_log(spark, config, joined, stops)
        cached.append(checked)
        position = F.col("message_log_offset") - F.col("file").cast("long")  # in the segment
        problems.append(
            findings.problems(
                files.MESSAGE_LOG, checked, F.col("file"), position, "problem", "detail"
            )
        )
    duplicates = _duplicates(spark, config, joined)
    copies = _missing_copies(spark, config, joined, marks)
    judged = reconcile.judge(joined, stops, damaged, config)
    full = reconcile.with_copies(reconcile.with_duplicate_ids(judged, duplicates), copies)
    found = findings.record_findings(full).persist(LEVEL)
    cached += [duplicates, copies, found]
    found = inputs.with_message_ids(spark, config, found)
    if checked is not None:
        found = found.unionByName(findings.message_findings(checked))

    # The tables are cached as they are written: the report is read from them.
    tables = {
        CORRUPT_RECORDS: reduce(DataFrame.unionByName, problems).repartition(1),
        SUMMARY: _with_message_counts(bucket_summary(full, duplicates), checked).coalesce(1),
        DISCREPANCIES: found,
    }
    paths = {name: os.path.join(config.out, name) for name in TABLES}
    for name, table in tables.items():
        table.persist(LEVEL).write.mode("overwrite").parquet(paths[name])
    result = _collect(config, tables, paths, checked is not None)
    for frame in (*cached, *tables.values()):
        frame.unpersist()
    result.seconds = time.monotonic() - started
    return result


def _join_logs(
    spark: SparkSession, config: AuditConfig
) -> tuple[DataFrame, list[DataFrame], DataFrame]:
    """reconcile.joined for every server — the one pass over all the records — cached
    per server; the union of them with a ``server`` column; and its problem rows
    (reconcile.problem_rows), held on the driver."""
    per_server = [
        reconcile.joined(inputs.read_paired(spark, server, config)).persist(LEVEL)
        for server in config.servers
    ]
    named = [
        rows.select(F.lit(server.name).alias("server"), "*")
        for server, rows in zip(config.servers, per_server, strict=True)
    ]
    # Fetching the problem rows is what computes (and caches) each server's rows.
    marks = [reconcile.problem_rows(rows) for rows in named]
    tables = [frame.toArrow() for frame in marks]
    marks_schema = marks[0].schema
    local_marks = spark.createDataFrame(pa.concat_tables(tables), schema=marks_schema)
    return reduce(DataFrame.unionByName, named), per_server, local_marks


def _check_message_log(
    spark: SparkSession, config: AuditConfig, joined: DataFrame, stops: DataFrame
) -> DataFrame:
    """message_check over every server's message_log, cached."""
    messages = reduce(
        DataFrame.unionByName,
        (
            inputs.read_log(
                spark, files.MESSAGE_LOG, server, config, inputs.MESSAGE_COLUMNS
            ).withColumn("server", F.lit(server.name))
            for server in config.servers
        ),
    )
    return message_check(joined, stops, messages, config).persist(LEVEL)


def _duplicates(spark: SparkSession, config: AuditConfig, joined: DataFrame) -> DataFrame:
    """reconcile.duplicate_ids, cached. Ids are read again only for the records whose id
    hash was dispatched more than once — none, in a clean audit."""
    with _spark_conf(spark, BYPASS_PARTIAL_AGGREGATION, "true"):
        hashes = reconcile.duplicate_hashes(joined).persist(LEVEL)
        count = hashes.count()
    if count == 0:
        hashes.unpersist()
        return spark.createDataFrame([], reconcile.DUPLICATES_SCHEMA)
    if count <= BROADCAST_ROWS:
        small = _local(spark, hashes)
        hashes.unpersist()
        hashes = F.broadcast(small)
    candidates = reconcile.duplicate_candidates(joined, hashes)
    named = inputs.with_message_ids(spark, config, candidates)
    return reconcile.duplicate_ids(named).persist(LEVEL)


def _missing_copies(
    spark: SparkSession, config: AuditConfig, joined: DataFrame, marks: DataFrame
) -> DataFrame:
    """reconcile.missing_copies: held on the driver and broadcast when there are few
    moved records (so that joining it to the records shuffles nothing), else cached.
    The records of moved messages are looked for only when there are moved records.
    Counting them costs little: the filter is on the cached ``fate`` byte, and the
    cache's per-batch statistics skip every batch without a RESCHEDULED fate, so an
    audit without reschedules reads next to nothing."""
    moved = reconcile.moved(joined)
    count = moved.count()
    if count == 0:
        return spark.createDataFrame([], reconcile.COPIES_SCHEMA)
    unread = marks.where(F.col("schedule_problem").isNotNull()).select("server")
    if count > BROADCAST_ROWS:
        return reconcile.missing_copies(joined, moved, unread, config).persist(LEVEL)
    moved = F.broadcast(_local(spark, moved))
    return F.broadcast(_local(spark, reconcile.missing_copies(joined, moved, unread, config)))


def _dispatch_problems(
    spark: SparkSession, config: AuditConfig, damaged: DataFrame
) -> list[DataFrame]:
    """The problem rows of the ``damaged`` dispatch_log files, read again (only those
    files) for where each problem is and what it is."""
    rows = inputs.reread(
        spark, config, files.DISPATCH_LOG, damaged, ["bucket", "position", "detail"]
    )
    if rows is None:
        return []
    position = F.col("position")
    return [
        findings.problems(
            files.DISPATCH_LOG, rows, inputs.bucket_file(), position, "problem", "detail"
        )
    ]


def _local(spark: SparkSession, frame: DataFrame) -> DataFrame:
    """``frame`` (small) computed now and held on the driver: every query that uses it
    later reads these rows rather than computing them again. Through Arrow, so that
    timestamps keep their UTC values (collect() would make local-time datetimes)."""
    return spark.createDataFrame(frame.toArrow(), schema=frame.schema)


@contextmanager
def _spark_conf(spark: SparkSession, key: str, value: str) -> Iterator[None]:
    """``key`` set to ``value`` for the queries run inside, as it was afterwards."""
    before = spark.conf.get(key, None)
    spark.conf.set(key, value)
    try:
        yield
    finally:
        if before is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, before)


def _with_message_counts(summary: DataFrame, checked: DataFrame | None) -> DataFrame:
    """The summary with message_log counts on its server and overall rows (null on
    bucket rows, and everywhere when no message_log was left to check)."""
    names = [
        "message_log_records",
        "message_log_cancels",
        "message_log_reschedules",
        "not_scheduled",
        "scheduled_twice",
        "message_unverified",
    ]
    if checked is None:
        return summary.withColumns({name: F.lit(None).cast("long") for name in names})
    record_kind = F.col("record_kind")
    counts = (
        checked.rollup("server")
        .agg(
            F.count_if(record_kind == MESSAGE).alias(names[0]),
            F.count_if(record_kind == CANCEL).alias(names[1]),
            F.count_if(record_kind == RESCHEDULE).alias(names[2]),
            F.count_if(F.col("not_scheduled")).alias(names[3]),
            F.count_if(F.col("scheduled_twice")).alias(names[4]),
            F.count_if(F.col("unverified")).alias(names[5]),
        )
        .withColumnRenamed("server", "message_server")
    )
    on = summary["bucket"].isNull() & summary["server"].eqNullSafe(counts["message_server"])
    return summary.join(counts, on, "left").drop("message_server")


def _collect(
    config: AuditConfig, tables: dict[str, DataFrame], paths: dict[str, str], checked: bool
) -> AuditResult:
    """What the report shows, from the tables just written: the whole summary, the
    number of findings and problems of each kind, the first few of each."""
    # Buckets leave Spark as epoch ms: collect() would turn timestamps into naive
    # datetimes in the local time zone of this process.
    bucket_ms = F.unix_millis(F.col("bucket")).alias("bucket_ms")
    summary = tables[SUMMARY].select("*", bucket_ms).drop("bucket")
    found = tables[DISCREPANCIES].select("*", bucket_ms).drop("bucket")
    corrupt = tables[CORRUPT_RECORDS]
    tallies = (
        found.groupBy(F.lit(DISCREPANCIES).alias("table"), "kind", "severity")
        .count()
        .unionByName(
            corrupt.groupBy(
                F.lit(CORRUPT_RECORDS).alias("table"), F.col("problem").alias("kind"), "severity"
            ).count()
        )
        .collect()
    )
    counts, problem_counts = {}, {}
    for row in tallies:
        tally = counts if row["table"] == DISCREPANCIES else problem_counts
        tally[(row["kind"], row["severity"])] = row["count"]
    errors_first = F.when(F.col("severity") == ERROR, 0).otherwise(1)
    listed = (
        found.orderBy(errors_first, "kind", "server", "bucket_ms", "offset", "message_log_offset")
        .limit(REPORT_ROWS)
        .collect()
    )
    problems = corrupt.orderBy(errors_first, "server", "log", "file").limit(REPORT_ROWS).collect()
    rows = summary.orderBy(F.col("server").asc_nulls_last(), F.col("bucket_ms").asc_nulls_last())
    return AuditResult(
        config=config,
        summary=[row.asDict() for row in rows.collect()],
        counts=counts,
        problem_counts=problem_counts,
        discrepancies=[row.asDict() for row in listed],
        problems=[row.asDict() for row in problems],
        message_log_checked=checked,
        paths=paths,
    )
