"""The audit as a Spark application, for clusters: the file spark-submit runs.

    spark-submit --master spark://host:7077 "$(delayd audit --job-path)" \\
        --data eu-1=/mnt/delayd/eu-1 --data eu-2=/mnt/delayd/eu-2 --out /mnt/audit/today

``delayd audit --job-path`` prints where this file is installed (spark-submit takes a
file, not a module); ``tools/audit_job.py`` is the same entry in a checkout. Same
arguments as ``delayd audit`` (docs/audit.md); ``--master``/``--conf`` given here
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


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Parse ``argv`` (default: the command line), run the audit on the SparkSession
    spark-submit configured; the exit status."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_audit_arguments(parser)
    parser.add_argument("--master", default=None, help="Spark master (default: spark-submit's)")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
        conf = spark_conf(args.conf)
    except (ValueError, FileNotFoundError) as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return EXIT_FAILED

    try:
        from pyspark.sql import SparkSession
    except ModuleNotFoundError as exc:
        print(f"{parser.prog}: {exc.name} is missing: pip install 'delayd[audit]'", file=sys.stderr)
        return EXIT_FAILED

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
