"""What the audit job reads of the logs, through the data sources of sources.py.

The job reads each log once, in narrow form: the columns the reconciliation needs, and
a message id only as its hash; schedule_log and dispatch_log together, each bucket's
two files joined where they are read (pairs.py). The few files that turn out to matter
later — buckets holding findings, dispatch_log files with problems — are read again,
alone (the sources' ``files`` option), for what the narrow pass left out: message ids,
and the text of each problem.
"""

from __future__ import annotations

from functools import reduce

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from delayd.audit import files
from delayd.audit.config import AuditConfig, Server
from delayd.audit.schemas import select
from delayd.audit.sources import SOURCES, PairedSource, spark_schema

# What the one pass reads of message_log. schedule_log and dispatch_log are read
# together, paired per bucket (read_paired); dispatch_log's problems are only counted
# there, so their position and text are left for the reread.
MESSAGE_COLUMNS = ["file", "offset", "kind", "message_id", "due_ms", "receive_ms", "detail"]


def bucket_file() -> Column:
    """The name of a bucket's file (``yyyyMMddHHmm``, UTC) from its ``bucket`` column."""
    return F.date_format("bucket", "yyyyMMddHHmm")


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
    )
    if only is not None:
        reader = reader.option("files", ",".join(only))
    return reader.load(server.data_dir)


def read_paired(spark: SparkSession, server: Server, config: AuditConfig) -> DataFrame:
    """One server's schedule_log records paired with their dispatch_log entries
    (``delayd.paired``: pairs.py)."""
    return (
        spark.read.format(PairedSource.name())
        .option("verify", config.verify)
        .option("partitionBytes", str(config.partition_bytes))
        .load(server.data_dir)
    )


def has_message_log(config: AuditConfig) -> bool:
    """Whether any server still has message_log segments (retention may have removed
    them all)."""
    return any(files.list_files(s.data_dir, files.MESSAGE_LOG) for s in config.servers)


def _files_of(keys: DataFrame) -> dict[str, list[str]]:
    """The bucket files named by the (server, bucket) of ``keys``, per server."""
    found: dict[str, set[str]] = {}
    for row in keys.select("server", bucket_file().alias("file")).distinct().collect():
        found.setdefault(row["server"], set()).add(row["file"])
    return {server: sorted(names) for server, names in found.items()}


def reread(
    spark: SparkSession, config: AuditConfig, log: str, keys: DataFrame, columns: list[str]
) -> DataFrame | None:
    """``columns`` of the files of ``log`` that the (server, bucket) of ``keys`` name,
    with a ``server`` column; None when ``keys`` names none."""
    wanted = _files_of(keys)
    frames = [
        read_log(spark, log, server, config, columns, wanted[server.name]).withColumn(
            "server", F.lit(server.name)
        )
        for server in config.servers
        if server.name in wanted
    ]
    return reduce(DataFrame.unionByName, frames) if frames else None


def with_message_ids(spark: SparkSession, config: AuditConfig, rows: DataFrame) -> DataFrame:
    """``rows`` (keyed by server, bucket, offset) with the ``message_id`` of the
    schedule_log record at their key (null where there is none), read from only the
    buckets ``rows`` name."""
    key = ["server", "bucket", "offset"]
    names = reread(spark, config, files.SCHEDULE_LOG, rows, ["bucket", "offset", "message_id"])
    if names is None:
        return rows.withColumn("message_id", F.lit(None).cast("string"))
    names = names.where(F.col("problem").isNull()).select(*key, "message_id")
    return rows.join(names, key, "left")
