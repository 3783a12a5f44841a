"""The SparkSession of an audit: local mode for ``delayd audit``, whatever spark-submit
built for ``tools/audit_job.py``; either way with the delayd formats registered."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from pyspark.sql import SparkSession

from delayd.audit.spark import sources

# Quiet defaults for one machine; --conf overrides any of them. The audit caches its
# one pass over the records (job.py): uncompressed, which halves the cost of building
# the cache (measured) for memory a machine running the audit has.
LOCAL_DEFAULTS = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "8",
    "spark.driver.memory": "4g",
    "spark.sql.inMemoryColumnarStorage.compressed": "false",
}


def prepare_environment() -> None:
    """Make pyspark start from a plain shell: Python workers run this interpreter (which
    has delayd and pyarrow), and a local session binds to the loopback address rather
    than whatever the host name resolves to. Values already set are kept."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def local_session(master: str = "local[*]", conf: Mapping[str, str] | None = None) -> SparkSession:
    """A session on ``master`` (``local[N]`` or a cluster URL) for ``delayd audit``."""
    prepare_environment()
    builder = SparkSession.builder.master(master).appName("delayd audit")
    for key, value in {**LOCAL_DEFAULTS, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return prepare(spark)


def prepare(spark: SparkSession) -> SparkSession:
    """Register the delayd formats and set what the audit relies on: times in UTC."""
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    sources.register(spark)
    return spark
