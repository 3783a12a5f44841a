"""The audit as a Spark application, for clusters:

    spark-submit --master spark://host:7077 tools/audit_job.py \\
        --data eu-1=/mnt/delayd/eu-1 --data eu-2=/mnt/delayd/eu-2 --out /mnt/audit/today

Same arguments as ``delayd audit`` (docs/audit.md); ``--master``/``--conf`` given here
override spark-submit's. Every executor needs delayd installed (``pip install
'delayd[audit]'``) and the data directories mounted at the same paths; the driver
writes the report under ``--out``. Exit status as ``delayd audit``: 0 clean, 1
discrepancies, 2 could not run.
"""

from __future__ import annotations

import argparse
import sys

from delayd.audit.config import EXIT_FAILED
from delayd.cli.audit import add_audit_arguments, config_from_args, execute, spark_conf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="audit_job.py", description=__doc__.split("\n\n")[0])
    add_audit_arguments(parser)
    parser.add_argument("--master", default=None, help="Spark master (default: spark-submit's)")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        conf = spark_conf(args.conf)
    except ValueError as exc:
        print(f"audit_job.py: {exc}", file=sys.stderr)
        return EXIT_FAILED

    from pyspark.sql import SparkSession

    # Nothing of the local defaults of `delayd audit` (loopback address, this
    # interpreter for the workers): on a cluster spark-submit's settings decide.
    builder = SparkSession.builder.appName("delayd audit")
    if args.master is not None:
        builder = builder.master(args.master)
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    try:
        return execute(spark, config)
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
