"""The audit's tables under ``--out``, and what the report shows of them.

``summary/`` (per bucket, per server, overall), ``discrepancies/`` (one row per
finding, with message ids) and ``corrupt_records/`` (file, position, kind), all
Parquet; the report (report/render.py) adds ``report.html`` and ``report.txt``.

Rows held on the driver are written by the driver (pyarrow, as Spark writes them:
snappy, INT96 timestamps): the summary, the corrupt records, the findings that crossed
buckets. The findings made where the buckets were read, and message_log's, are in
Spark, which writes them. Each table's directory is replaced.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from delayd.audit.config import AuditConfig
from delayd.audit.judge import findings
from delayd.audit.kinds import CANCELLED_ID_DELIVERED, COPY_MISSING, DUPLICATE_ID, DUPLICATE_SEND
from delayd.audit.report.result import ERROR, REPORT_ROWS, AuditResult
from delayd.audit.spark.queries import fetch, literal

SUMMARY = "summary"
DISCREPANCIES = "discrepancies"
CORRUPT_RECORDS = "corrupt_records"
TABLES = (SUMMARY, DISCREPANCIES, CORRUPT_RECORDS)
US_PER_MS = 1000
# the findings made on the driver
_LOCAL_KINDS = (DUPLICATE_ID, COPY_MISSING, DUPLICATE_SEND, CANCELLED_ID_DELIVERED)
_FINDING_ORDER = ("kind", "server", "bucket", "offset", "message_log_offset")
_PROBLEM_ORDER = ("server", "log", "file", "position")


def local_findings(duplicates: pa.Table, copies: pa.Table, same_id: pa.Table) -> pa.Table:
    """The discrepancies rows of what across_buckets.py found across buckets (``same_id``:
    id_checks' rows already)."""
    return pa.concat_tables(
        [findings.duplicate_id_findings(duplicates), findings.copy_findings(copies), same_id]
    )


def write(
    spark: SparkSession,
    config: AuditConfig,
    summary: pa.Table,
    found: DataFrame,
    local: pa.Table,
    problems: pa.Table,
    *,
    message_log_checked: bool,
) -> AuditResult:
    """Write the tables — ``summary`` (summary.SUMMARY), the findings (``found`` in
    Spark, ``local`` on the driver; findings.DISCREPANCIES) and ``problems``
    (findings.CORRUPT_RECORDS) — and return what the report shows: the whole summary,
    the number of findings and problems of each kind, and the first REPORT_ROWS of each
    table, errors first.

    A finding is a row of its kind's count: the counts are the summary's (overall row),
    but for the kinds made on the driver. Spark is asked for its first findings, and to
    write them, only when it has some."""
    paths = {name: os.path.join(config.out, name) for name in TABLES}
    total = next(r for r in summary.to_pylist() if r["server"] is None and r["bucket"] is None)
    counts = {}
    for kind in (*findings.RECORD_KINDS, *findings.MESSAGE_KINDS):
        if total.get(kind):
            counts[(kind, findings.severity(kind))] = total[kind]
    for kind in _LOCAL_KINDS:
        rows = pc.sum(pc.equal(local["kind"], kind)).as_py()
        if rows:
            counts[(kind, findings.severity(kind))] = rows
    first = local
    if any(n for (kind, _), n in counts.items() if kind not in _LOCAL_KINDS):
        order = [f"severity <> {literal(ERROR)}", *_FINDING_ORDER]
        ordered = found.sort(*(F.expr(column) for column in order)).limit(REPORT_ROWS)
        first = pa.concat_tables([fetch(ordered).cast(local.schema), local])
        # Few rows, each task's: one file.
        found.repartition(1).write.mode("overwrite").parquet(paths[DISCREPANCIES])
        _write_local(local, paths[DISCREPANCIES], replace=False)
    else:
        _write_local(local, paths[DISCREPANCIES])
    _write_local(summary, paths[SUMMARY])
    _write_local(problems, paths[CORRUPT_RECORDS])
    problem_counts: dict[tuple[str, str], int] = {}
    for row in problems.select(["problem", "severity"]).to_pylist():
        key = (row["problem"], row["severity"])
        problem_counts[key] = problem_counts.get(key, 0) + 1
    listed = sorted(_bucket_ms(first).to_pylist(), key=_order(_FINDING_ORDER))
    return AuditResult(
        config=config,
        summary=_bucket_ms(summary).to_pylist(),
        counts=counts,
        problem_counts=problem_counts,
        discrepancies=listed[:REPORT_ROWS],
        problems=sorted(problems.to_pylist(), key=_order(_PROBLEM_ORDER))[:REPORT_ROWS],
        message_log_checked=message_log_checked,
        paths=paths,
    )


def _write_local(table: pa.Table, path: str, *, replace: bool = True) -> None:
    """``table`` as a Parquet file in the directory ``path``, as Spark writes one (the
    directory replaced, unless ``replace`` is false: then the file is added, if there
    are rows)."""
    if replace:
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        open(os.path.join(path, "_SUCCESS"), "wb").close()
    elif not table.num_rows:
        return
    name = "part-00000-delayd.snappy.parquet" if replace else "part-driver.snappy.parquet"
    pq.write_table(
        table, os.path.join(path, name), compression="snappy", use_deprecated_int96_timestamps=True
    )


def _order(columns: tuple[str, ...]):
    """A sort key for rows as dicts: errors first, then ``columns``, nulls first (as
    Spark orders them)."""

    def key(row: dict[str, Any]) -> tuple:
        values = [row["bucket_ms" if c == "bucket" and "bucket_ms" in row else c] for c in columns]
        nulls_first = ((False,) if v is None else (True, v) for v in values)
        return (row["severity"] != ERROR, *nulls_first)

    return key


def _bucket_ms(table: pa.Table) -> pa.Table:
    """``table`` with its ``bucket`` as epoch ms (``bucket_ms``), as the report reads it."""
    at = table.schema.get_field_index("bucket")
    bucket_ms = pc.divide(table["bucket"].cast(pa.int64()), US_PER_MS)
    return table.set_column(at, "bucket_ms", bucket_ms)
