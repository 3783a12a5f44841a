"""``delayd audit``: reconcile the logs of one or more delay servers on Spark.

    delayd audit --data /var/lib/delayd --out /tmp/audit [--master local[*]]
                 [--as-of 2026-11-22T10:00:00Z] [--grace 60s] [--late-after 5s]

Runs the job of job.py in a local SparkSession (or on ``--master``), writes the
Parquet tables and report.html/report.txt under ``--out``, prints the report. Exit 0
when clean, 1 when discrepancies or corrupt records were found (for cron), 2 when the
audit could not run. On a cluster, ``spark-submit "$(delayd audit --job-path)"`` takes
the same arguments (submit.py).

This module imports neither pyspark nor pyarrow until it runs: the ``delayd`` command
must work for the server without the ``audit`` extra.
"""

from __future__ import annotations

import argparse
import importlib.util
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
    parser.add_argument(
        "--job-path",
        action=_PrintJobPath,
        help="print the path of the Spark application to give spark-submit, and exit",
    )


class _PrintJobPath(argparse.Action):
    """Prints the installed path of submit.py and exits, before the required arguments
    are checked (as ``--version`` does): spark-submit takes a file, not a module."""

    def __init__(self, option_strings: list[str], dest: str, help: str) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        spec = importlib.util.find_spec("delayd.audit.submit")
        assert spec is not None and spec.origin is not None
        sys.stdout.write(spec.origin + "\n")
        parser.exit()


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
    from delayd.audit import files
    from delayd.audit.config import config_from_args

    try:
        config = config_from_args(args)
        conf = spark_conf(args.conf)
        for server in config.servers:  # before starting a JVM for nothing
            files.list_files(server.data_dir, files.SCHEDULE_LOG)
    except (ValueError, FileNotFoundError) as exc:
        print(f"delayd audit: {exc}", file=sys.stderr)
        return EXIT_FAILED
    try:
        from pyspark.sql import SparkSession

        from delayd.audit import session
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
    from delayd.audit import job, report

    try:
        result = job.run(spark, config)
    except FileNotFoundError as exc:
        print(f"delayd audit: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # a Spark failure: not a finding, so not exit status 1
        traceback.print_exc()
        print(f"delayd audit: the audit could not run: {exc}", file=sys.stderr)
        return EXIT_FAILED
    report.write(result)
    sys.stdout.write(report.console(result))
    sys.stdout.flush()
    return EXIT_CLEAN if result.clean else EXIT_DISCREPANCIES
