"""Check on Spark that every message the delay servers accepted was dispatched once,
on time: the logs of one or more servers are reconciled.

    delayd audit --data /var/lib/delayd --out /tmp/audit [--master local[*]]
                 [--as-of 2026-11-22T10:00:00Z] [--grace 60s] [--late-after 5s]
    delayd audit --etcd http://10.0.0.5:2379 [--cluster-prefix /delayd] --out /tmp/audit

Several delay groups are reconciled as one, each from one copy of its logs
(delayd/audit/groups.py): directories given the same --data name, or the members'
data directories etcd lists.

Runs the audit in a local Spark session (or on --master), writes the Parquet tables
and report.html and report.txt under --out, and prints the report. Needs the audit
extra (pip install 'delayd[audit]') and Java 17. "spark-submit tools/audit_job.py"
takes the same arguments.

Exit status: 0 when clean; 1 when discrepancies or corrupt records were found (for
cron); 2 when the audit could not run (bad arguments, a missing directory, no Java,
Spark not starting).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import time
import traceback
from typing import TYPE_CHECKING

from delayd.audit.config import (
    DEFAULT_GRACE_MS,
    DEFAULT_LATE_MS,
    EXIT_CLEAN,
    EXIT_DISCREPANCIES,
    EXIT_FAILED,
    AuditConfig,
    Server,
)
from delayd.audit.kinds import HEAD, VERIFY_MODES
from delayd.audit.read.partitions import DEFAULT_PARTITION_BYTES
from delayd.cli.args import duration_ms, etcd_endpoints, non_negative_count, utc_time_ms
from delayd.cluster.members import DEFAULT_PREFIX

# Neither pyspark nor pyarrow is imported until the audit runs: `delayd` works for the
# server without the audit extra.
if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from delayd.audit.groups import Copy


def server_data(text: str) -> Server:
    """``DIR`` or ``NAME=DIR``; the name defaults to the directory as given."""
    name, sep, data_dir = text.partition("=")
    if not sep or os.sep in name:
        name, data_dir = text.rstrip(os.sep) or text, text
    if not name or not data_dir:
        raise argparse.ArgumentTypeError(f"{text!r} is not DIR or NAME=DIR")
    return Server(name, data_dir)


def as_of_ms(text: str) -> int:
    """Epoch milliseconds (all digits) or an ISO-8601 time with a UTC offset."""
    stripped = text.strip()
    if stripped.isascii() and stripped.isdigit():
        return int(stripped)
    return utc_time_ms(stripped)


def add_audit_arguments(parser: argparse.ArgumentParser) -> None:
    """What the audit judges, on ``parser``: shared with tools/audit_job.py."""
    parser.add_argument(
        "--data",
        action="append",
        default=[],
        type=server_data,
        metavar="[NAME=]DIR",
        help="a delay server's data directory (repeat to audit several servers as one); "
        "rows carry NAME, by default DIR; directories with the same NAME are copies of one "
        "group's logs, of which the one that holds most is read",
    )
    parser.add_argument(
        "--etcd",
        type=etcd_endpoints,
        metavar="URL[,URL]",
        help="audit every delay group etcd lists, each from a member's data directory "
        "(the leader's when readable here); --data NAME=DIR overrides group NAME",
    )
    parser.add_argument(
        "--cluster-prefix",
        default=DEFAULT_PREFIX,
        metavar="PREFIX",
        help=f"the groups' key prefix in etcd ([cluster] prefix; default {DEFAULT_PREFIX})",
    )
    parser.add_argument("--out", required=True, help="directory for the Parquet tables and report")
    parser.add_argument(
        "--as-of",
        type=as_of_ms,
        default=None,
        metavar="TIME",
        help="judge the logs as of this time: ISO-8601 UTC (2026-11-22T10:00:00Z) or epoch "
        "ms (default: now)",
    )
    parser.add_argument(
        "--grace",
        type=duration_ms,
        default=DEFAULT_GRACE_MS,
        metavar="DURATION",
        help="a message due less than this before --as-of is not yet overdue (default 60s)",
    )
    parser.add_argument(
        "--late-after",
        type=duration_ms,
        default=DEFAULT_LATE_MS,
        metavar="DURATION",
        help="a dispatch more than this after its due time is late (default 5s)",
    )
    parser.add_argument(
        "--partition-bytes",
        type=non_negative_count,
        default=DEFAULT_PARTITION_BYTES,
        metavar="BYTES",
        help="pack the bucket files into Spark tasks of about this many bytes, fewer when "
        "that would leave cores idle (default 67_108_864: 64 MiB); 0: a task per file",
    )
    parser.add_argument(
        "--verify",
        choices=VERIFY_MODES,
        default=HEAD,
        help="head: decode what the audit needs (default); full: decode every record "
        "with the codec, properties included (slower)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_audit_arguments(parser)
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
    """Prints the installed path of spark_submit/audit_job.py and exits, before the required
    arguments are checked (as ``--version`` does): spark-submit takes a file, not a
    module."""

    def __init__(self, option_strings: list[str], dest: str, help: str) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        spec = importlib.util.find_spec("delayd.cli.spark_submit.audit_job")
        assert spec is not None and spec.origin is not None
        sys.stdout.write(spec.origin + "\n")
        parser.exit()


def config_from_args(args: argparse.Namespace) -> AuditConfig:
    """The AuditConfig of parsed arguments: the servers of ``--data`` and the delay
    groups ``--etcd`` lists, one copy of each group (delayd.audit.groups). Raises
    ValueError when there is nothing to audit, etcd cannot be read or two groups would
    be read from one directory, groups.CopyMissingError when no copy of a group is
    readable here."""
    from delayd.audit import groups

    if not args.data and not args.etcd:
        raise ValueError("say what to audit: --data [NAME=]DIR (repeatable) or --etcd URL")
    given = {server.name for server in args.data}
    copies = [groups.Copy(server.name, server.data_dir) for server in args.data]
    if args.etcd:
        listed = etcd_copies(args.etcd, args.cluster_prefix)
        copies += [copy for copy in listed if copy.group not in given]
        if not copies:
            raise ValueError(f"etcd lists no delay group under {args.cluster_prefix}/groups/")
    as_of = args.as_of if args.as_of is not None else int(time.time() * 1000)
    return AuditConfig(
        servers=groups.servers(copies, socket.gethostname()),
        out=args.out,
        as_of_ms=as_of,
        grace_ms=args.grace,
        late_ms=args.late_after,
        verify=args.verify,
        partition_bytes=args.partition_bytes,
    )


def etcd_copies(endpoints: tuple[str, ...], prefix: str) -> list[Copy]:
    """Every member of every delay group (a group whose members serve intake: standalone
    broker groups hold no delay logs) under ``prefix`` in etcd, as copies of its group's
    logs. Raises ValueError when etcd cannot be read."""
    import trio

    from delayd.audit.groups import Copy
    from delayd.cluster.etcd import EtcdClient
    from delayd.cluster.group_state import read_groups
    from delayd.errors import EtcdError

    async def read() -> list:
        async with EtcdClient(endpoints) as etcd:
            return await read_groups(etcd, prefix)

    try:
        states = trio.run(read)
    except EtcdError as exc:
        raise ValueError(
            f"cannot read the groups from etcd at {','.join(endpoints)}: {exc}"
        ) from None
    leader_of = {state.group: state.leader.member_id for state in states if state.leader}
    return [
        Copy(
            state.group,
            m.data_dir,
            m.member_id,
            m.hostname,
            m.member_id == leader_of.get(state.group),
        )
        for state in states
        if any(m.intake for m in state.members)
        for m in state.members
    ]


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
    from delayd.logs import log_files

    try:
        config = config_from_args(args)
        conf = spark_conf(args.conf)
        for data in config.servers:  # before starting a JVM for nothing
            log_files.list_files(data.data_dir, log_files.SCHEDULE_LOG)
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
    try:
        spark = existing if existing is not None else session.local_session(args.master, conf)
    except session.SparkStartError as exc:
        print(f"delayd audit: {exc}", file=sys.stderr)
        return EXIT_FAILED
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
