"""What the audit job reads of the logs, through the data sources of sources.py.

Per server, schedule_log and dispatch_log are read once, together: each bucket's two
files reconciled where they are read (``delayd.reconciled``: judge/bucket_runs.py), which
leaves a few rows per bucket and per task. message_log, when it is still there, is read
once in narrow form. The few buckets that hold records whose id is
in question (across_buckets.py) are read again, alone (the sources' ``files`` option), for
those records.
"""

from __future__ import annotations

from functools import reduce

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

from delayd.audit.config import AuditConfig, Server
from delayd.audit.judge.bucket_runs import ALL
from delayd.audit.schemas import select
from delayd.audit.spark.queries import literal
from delayd.audit.spark.sources import SOURCES, ReconciledSource, spark_schema
from delayd.logs import log_files
from delayd.logs.buckets import bucket_name

# What the one pass reads of message_log.
MESSAGE_COLUMNS = ["file", "offset", "kind", "message_id", "due_ms", "receive_ms", "detail"]
US_PER_MS = 1000


def read_log(
    spark: SparkSession,
    log: str,
    server: Server,
    config: AuditConfig,
    columns: list[str],
    only: list[str] | None = None,
) -> DataFrame:
    """``columns`` and ``problem`` of one server's ``log`` (of the files named in
    ``only``, if given)."""
    source = SOURCES[log]
    reader = (
        spark.read.format(source.name())
        .schema(spark_schema(select(source.arrow_schema, [*columns, "problem"])))
        .option("verify", config.verify)
        .option("partitionBytes", str(config.partition_bytes))
        .option("minPartitions", str(spark.sparkContext.defaultParallelism))
    )
    if only is not None:
        reader = reader.option("files", ",".join(only))
    return reader.load(server.data_dir)


def read_reconciled(
    spark: SparkSession,
    server: Server,
    config: AuditConfig,
    records: str,
    only: list[str] | None = None,
) -> DataFrame:
    """One server's buckets (those named in ``only``, if given) reconciled where they
    are read (``delayd.reconciled``: judge/bucket_runs.py), with the rows per record
    ``records`` asks for (bucket_runs.RECORD_MODES)."""
    reader = (
        spark.read.format(ReconciledSource.name())
        .option("cutoffMs", str(config.cutoff_ms))
        .option("lateMs", str(config.late_ms))
        .option("records", records)
        .option("verify", config.verify)
        .option("partitionBytes", str(config.partition_bytes))
        .option("minPartitions", str(spark.sparkContext.defaultParallelism))
    )
    if only is not None:
        reader = reader.option("files", ",".join(only))
    return reader.load(server.data_dir)


def has_message_log(config: AuditConfig) -> bool:
    """Whether any server still has message_log segments (retention may have removed
    them all)."""
    return any(log_files.list_files(s.data_dir, log_files.MESSAGE_LOG) for s in config.servers)


def records(spark: SparkSession, config: AuditConfig, buckets: pa.Table) -> DataFrame:
    """Every schedule_log record of ``buckets`` (server, bucket), read again with what a
    finding shows of it (schemas.RECORD) and ``server``."""
    wanted: dict[str, set[str]] = {}
    for server, bucket_us in zip(
        buckets["server"].to_pylist(), buckets["bucket"].cast(pa.int64()).to_pylist(), strict=True
    ):
        wanted.setdefault(server, set()).add(bucket_name(bucket_us // US_PER_MS))
    frames = [
        read_reconciled(spark, server, config, ALL, sorted(wanted[server.name]))
        .where("record IS NOT NULL")
        .selectExpr(f"{literal(server.name)} AS server", "record.*")
        for server in config.servers
        if server.name in wanted
    ]
    return reduce(DataFrame.unionByName, frames)
