"""The SparkSession of an audit: local mode for ``delayd audit``, whatever spark-submit
built for ``tools/audit_job.py``; either way with the delayd formats registered."""

from __future__ import annotations

import os
import shutil
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


class SparkStartError(RuntimeError):
    """Spark could not start; the message says what to install or set."""


INSTALL_JAVA = (
    "install Java 17 (Debian, Ubuntu: apt-get install openjdk-17-jre-headless) or set "
    "JAVA_HOME to a Java 17 installation"
)


def java_problem() -> str | None:
    """Why Spark's JVM cannot start here, or None when a ``java`` is there: Spark runs
    ``$JAVA_HOME/bin/java`` when JAVA_HOME is set, else ``java`` from the PATH. Found
    before starting Spark, whose own failure comes late and buried in its output."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home:
        java = os.path.join(java_home, "bin", "java")
        if not os.access(java, os.X_OK):
            return f"JAVA_HOME is {java_home!r}, which has no bin/java: {INSTALL_JAVA}"
        return None
    if shutil.which("java") is None:
        return f"no java on the PATH: {INSTALL_JAVA}"
    return None


def local_session(master: str = "local[*]", conf: Mapping[str, str] | None = None) -> SparkSession:
    """A session on ``master`` (``local[N]`` or a cluster URL) for ``delayd audit``.
    Raises SparkStartError when no JVM is found or Spark does not start."""
    problem = java_problem()
    if problem is not None:
        raise SparkStartError(f"Spark needs Java: {problem}")
    prepare_environment()
    builder = SparkSession.builder.master(master).appName("delayd audit")
    for key, value in {**LOCAL_DEFAULTS, **(conf or {})}.items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # pyspark raises its own kinds for a JVM that will not start
        raise SparkStartError(
            f"Spark did not start on {master!r} ({exc}); check the Java installation "
            f"(JAVA_HOME, java -version: Java 17) and the --conf settings"
        ) from exc
    spark.sparkContext.setLogLevel("ERROR")
    return prepare(spark)


def prepare(spark: SparkSession) -> SparkSession:
    """Register the delayd formats and set what the audit relies on: times in UTC."""
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    sources.register(spark)
    return spark
