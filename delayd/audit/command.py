"""``delayd audit``: reconcile the logs of one or more delay servers on Spark.

    delayd audit --data /var/lib/delayd --out /tmp/audit [--master local[*]]
                 [--as-of 2026-11-22T10:00:00Z] [--grace 60s] [--late-after 5s]

Runs the job of spark/job.py in a local SparkSession (or on ``--master``), writes the
Parquet tables and report.html/report.txt under ``--out``, prints the report. Exit 0
when clean, 1 when discrepancies or corrupt records were found (for cron), 2 when the
audit could not run. ``spark-submit tools/audit_job.py`` takes the same arguments.

This module imports neither pyspark nor pyarrow until it runs: the ``delayd`` command
must work for the server without the ``audit`` extra.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import TYPE_CHECKING

from delayd.audit.config import (
    EXIT_CLEAN,
    EXIT_DISCREPANCIES,
    EXIT_FAILED,
    AuditConfig,
    add_arguments,
)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "audit",
        help="check on Spark that every accepted message was dispatched once, on time",
        description=__doc__.split("\n\n")[0],
    )
    add_arguments(parser)
    parser.add_argument(
        "--master", default="local[*]", help="Spark master (default local[*]: this machine)"
    )
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting, e.g. spark.driver.memory=4g (repeatable)",
    )


def spark_conf(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` settings as a dict. Raises ValueError for anything else."""
    conf = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--conf {pair!r} is not KEY=VALUE")
        conf[key] = value
    return conf


def run(args: argparse.Namespace) -> int:
    from delayd.audit.config import config_from_args
    from delayd.logs import log_files

    try:
        config = config_from_args(args)
        conf = spark_conf(args.conf)
        for server in config.servers:  # before starting a JVM for nothing
            log_files.list_files(server.data_dir, log_files.SCHEDULE_LOG)
    except (ValueError, FileNotFoundError) as exc:
        print(f"delayd audit: {exc}", file=sys.stderr)
        return EXIT_FAILED
    try:
        from pyspark.sql import SparkSession

        from delayd.audit.spark import session
    except ModuleNotFoundError as exc:
        print(
            f"delayd audit needs pyspark and pyarrow ({exc.name} is missing): "
            "pip install 'delayd[audit]'",
            file=sys.stderr,
        )
        return EXIT_FAILED
    # A session already running in this process (a test's) is used as it is and left
    # running; otherwise one is started for this audit and stopped after it.
    existing = SparkSession.getActiveSession()
    spark = existing if existing is not None else session.local_session(args.master, conf)
    try:
        return execute(spark, config)
    finally:
        if existing is None:
            spark.stop()


def execute(spark: SparkSession, config: AuditConfig) -> int:
    """Run the audit on ``spark``, write and print the report; the exit status."""
    from delayd.audit.report import render
    from delayd.audit.spark import job

    try:
        result = job.run(spark, config)
    except FileNotFoundError as exc:
        print(f"delayd audit: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # a Spark failure: not a finding, so not exit status 1
        traceback.print_exc()
        print(f"delayd audit: the audit could not run: {exc}", file=sys.stderr)
        return EXIT_FAILED
    render.write(result)
    sys.stdout.write(render.console(result))
    sys.stdout.flush()
    return EXIT_CLEAN if result.clean else EXIT_DISCREPANCIES
