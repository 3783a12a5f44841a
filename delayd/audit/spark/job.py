"""One audit run on a SparkSession: read the logs of every server once, reconcile,
write the Parquet tables, and hand back what the report shows.

Each bucket's two files are reconciled where they are read (judge/bucket_runs.py), which
leaves few rows: per bucket its counts, per task the findings, the problems, the moved
records, and what crosses buckets packed by id hash range. They are cached; the small
tables among them are fetched at once and held on the driver. Then the ranges are added
up (across_buckets.py; with judge/id_checks.py: ids sent twice, delivered though cancelled),
message_log is checked if there is one (message_check.py), the summary is added up on
the driver (judge/summary.py) and the tables are written (outputs.py). A clean audit of
servers without message_log runs three Spark jobs: the one pass over the logs, and the
two stages that move and add up the id ranges.
Queries are DataFrame methods with SQL text (queries.py says why).
"""

from __future__ import annotations

import time
from functools import reduce

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import StorageLevel
from pyspark.sql import DataFrame, SparkSession

from delayd.audit.config import AuditConfig
from delayd.audit.judge import summary
from delayd.audit.judge.bucket_runs import NONE, OFFSETS
from delayd.audit.judge.findings import CORRUPT_RECORDS, DISCREPANCIES
from delayd.audit.kinds import CORRUPT, TORN_TAIL
from delayd.audit.report.result import AuditResult
from delayd.audit.schemas import SIDE_TABLES
from delayd.audit.spark import across_buckets, inputs, message_check, outputs
from delayd.audit.spark.queries import fetch, literal
from delayd.audit.spark.session import prepare
from delayd.logs import log_files
from delayd.logs.buckets import parse_bucket_name

LEVEL = StorageLevel.MEMORY_AND_DISK
_SIDE = ["summary", "lateness", "problem"]  # fetched to the driver at once
_MAP_SIDE_FINDINGS = [
    "server" if f.name == "server" else f"finding.{f.name}" for f in DISCREPANCIES
]


def run(spark: SparkSession, config: AuditConfig) -> AuditResult:
    """Audit ``config.servers`` and write the tables under ``config.out``. Raises
    FileNotFoundError for a data directory that is not one."""
    started = time.monotonic()
    prepare(spark)
    for server in config.servers:
        log_files.list_files(server.data_dir, log_files.SCHEDULE_LOG)  # fail early, with the path
    message_log = inputs.has_message_log(config)
    # The message_log check needs every record's message_log offset; nothing else does.
    records = OFFSETS if message_log else NONE
    cached = [
        inputs.read_reconciled(spark, server, config, records).persist(LEVEL)
        for server in config.servers
    ]
    rows = reduce(
        DataFrame.unionByName,
        (
            frame.selectExpr(f"{literal(server.name)} AS server", "*")
            for server, frame in zip(config.servers, cached, strict=True)
        ),
    )
    side = _side_tables(rows)  # this computes (and caches) every server's rows
    problems = side["problem"]
    unread = set(_of_log(problems, log_files.SCHEDULE_LOG)["server"].to_pylist())
    duplicates, copies, same_id = across_buckets.cross_buckets(spark, config, rows, unread)

    found = [rows.where("finding IS NOT NULL").selectExpr(*_MAP_SIDE_FINDINGS)]
    messages = checked = None
    if message_log:
        checked = _check_message_log(spark, config, rows, problems)
        messages, message_problems = _message_counts(checked)
        problems = pa.concat_tables([problems, message_problems])
        found.append(message_check.findings(checked))
    result = outputs.write(
        spark,
        config,
        summary.summary(side["summary"], side["lateness"], duplicates, copies, same_id, messages),
        reduce(DataFrame.unionByName, found),
        outputs.local_findings(duplicates, copies, same_id),
        problems,
        message_log_checked=checked is not None,
    )
    for frame in (*cached, checked):
        if frame is not None:
            frame.unpersist()
    result.seconds = time.monotonic() - started
    return result


def _side_tables(rows: DataFrame) -> dict[str, pa.Table]:
    """The small tables of every server's rows (_SIDE of schemas.SIDE_TABLES: not the
    findings, which stay in Spark — there may be many), each with a ``server`` column;
    fetched at once."""
    wanted = " OR ".join(f"{name} IS NOT NULL" for name in _SIDE)
    fetched = fetch(rows.where(wanted).select(["server", *_SIDE]))
    tables = {}
    for name in _SIDE:
        mine = fetched.filter(pc.is_valid(fetched[name]))
        schema = pa.schema([pa.field("server", pa.string()), *SIDE_TABLES[name]])
        struct = mine[name].combine_chunks()
        tables[name] = pa.Table.from_arrays(
            [mine["server"].combine_chunks(), *struct.flatten()], schema=schema
        )
    return tables


def _check_message_log(
    spark: SparkSession, config: AuditConfig, rows: DataFrame, problems: pa.Table
) -> DataFrame:
    """message_check over every server's message_log, cached."""
    messages = reduce(
        DataFrame.unionByName,
        (
            inputs.read_log(
                spark, log_files.MESSAGE_LOG, server, config, inputs.MESSAGE_COLUMNS
            ).selectExpr(f"{literal(server.name)} AS server", "*")
            for server in config.servers
        ),
    )
    stopped = _of_log(problems, log_files.SCHEDULE_LOG)
    stopped = stopped.filter(pc.is_in(stopped["problem"], pa.array([TORN_TAIL, CORRUPT])))
    stops = [
        (server, parse_bucket_name(name))
        for server, name in zip(
            stopped["server"].to_pylist(), stopped["file"].to_pylist(), strict=True
        )
    ]
    scheduled = rows.where("scheduled_offset IS NOT NULL").selectExpr(
        "server", "scheduled_offset AS message_log_offset"
    )
    return message_check.message_check(scheduled, stops, messages, config).persist(LEVEL)


def _message_counts(checked: DataFrame) -> tuple[dict[str | None, dict[str, int]], pa.Table]:
    """message_check's counts per server and overall (None), and its problem rows as
    corrupt_records rows, in one Spark job."""
    fetched = message_check.counts_and_problems(checked)
    counts: dict[str | None, dict[str, int]] = {}
    for row in fetched.drop_columns(["problems"]).to_pylist():
        counts[row.pop("server")] = row
    servers = list(counts.values())
    counts[None] = {name: sum(row[name] for row in servers) for name in summary.MESSAGE_COUNTS}
    listed = fetched.select(["server", "problems"]).to_pylist()
    rows = [{"server": row["server"], **problem} for row in listed for problem in row["problems"]]
    return counts, pa.Table.from_pylist(rows, schema=CORRUPT_RECORDS)


def _of_log(problems: pa.Table, log: str) -> pa.Table:
    """The problem rows of ``log``."""
    return problems.filter(pc.equal(problems["log"], log))
