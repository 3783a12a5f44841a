"""The rows of the findings tables that a run of buckets yields, in Arrow: one
discrepancy per finding and record (a record late and dispatched twice has two), and
one corrupt record per problem a reader met.

Every finding about one record alone is made here, where the record was judged, with
its message id at hand. The ones that take other buckets — ``duplicate_id``,
``copy_missing``, ``duplicate_send``, ``cancelled_id_delivered`` and the message_log
check's — are the job's (spark/across_buckets.py, id_checks.py, spark/message_check.py), in the same
columns (schemas.FINDING, plus the server).
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from delayd.audit.kinds import (
    CANCELLED_AFTER_DISPATCH,
    COPY_MISSING,
    DEAD_LETTERED,
    DISPATCHED_AFTER_CANCEL,
    DUPLICATE_DISPATCH,
    DUPLICATE_ID,
    EARLY,
    ERROR,
    LATE,
    NOT_SCHEDULED,
    NOTICE,
    NOTICES,
    OVERDUE,
    SCHEDULED_TWICE,
    UNKNOWN_RECORD,
)
from delayd.audit.schemas import FINDING, PROBLEM
from delayd.logs import log_files
from delayd.logs.buckets import bucket_name

# The findings a record's own bucket decides (verdicts.py has a flag of the same name for
# each), and what their ``detail`` says: a text, or None.
RECORD_KINDS = {
    OVERDUE: None,
    DUPLICATE_DISPATCH: None,  # how many times: _detail()
    EARLY: None,  # by how much: _detail()
    LATE: None,
    DEAD_LETTERED: None,
    UNKNOWN_RECORD: "dispatch_log entry for an offset with no record",
    DISPATCHED_AFTER_CANCEL: "withdrawn (cancelled or moved), then sent",
    CANCELLED_AFTER_DISPATCH: "sent, then cancelled or moved",
}
# discrepancies/ and corrupt_records/: the structs with the server's name.
DISCREPANCIES = pa.schema([*list(FINDING)[:2], pa.field("server", pa.string()), *list(FINDING)[2:]])
CORRUPT_RECORDS = pa.schema([pa.field("server", pa.string()), *PROBLEM])
MESSAGE_KINDS = (NOT_SCHEDULED, SCHEDULED_TWICE)  # spark/message_check.py's
US_PER_MS = 1000


def severity(kind: str) -> str:
    """``notice`` for the kinds that do not fail the audit, ``error`` for the others."""
    return NOTICE if kind in NOTICES else ERROR


def record_findings(judged: pa.Table) -> pa.Table:
    """The FINDING rows of judge.judge's rows, kind by kind (RECORD_KINDS)."""
    parts = []
    for kind, text in RECORD_KINDS.items():
        rows = judged.filter(judged[kind])
        if not rows.num_rows:
            continue
        detail = _detail(kind, rows) if text is None else pa.repeat(text, rows.num_rows)
        parts.append(_findings(kind, rows, detail, pa.schema(list(FINDING))))
    return _concat(parts, FINDING)


def duplicate_id_findings(duplicates: pa.Table) -> pa.Table:
    """DISCREPANCIES rows of the records whose id was dispatched at more than one
    record (across_buckets.duplicates' rows)."""
    rows = duplicates.filter(pc.greater(duplicates["id_records"], 1))
    records = rows["id_records"].cast(pa.string())
    detail = pc.binary_join_element_wise("id dispatched at ", records, " records", "")
    return _findings(DUPLICATE_ID, rows, detail, DISCREPANCIES)


def copy_findings(copies: pa.Table) -> pa.Table:
    """DISCREPANCIES rows of the moved records whose copy is missing
    (across_buckets.missing_copies' rows)."""
    rows = copies.filter(copies["copy_missing"])
    detail = pa.repeat("rescheduled, but no later record of its id", rows.num_rows)
    return _findings(COPY_MISSING, rows, detail, DISCREPANCIES)


def _findings(kind: str, rows: pa.Table, detail: pa.Array, schema: pa.Schema) -> pa.Table:
    """``rows`` (records with what a finding shows) as findings of ``kind`` in
    ``schema`` (FINDING's fields, or DISCREPANCIES)."""
    count = rows.num_rows
    columns = {
        "kind": pa.repeat(kind, count),
        "severity": pa.repeat(severity(kind), count),
        "detail": detail,
    }
    return pa.Table.from_arrays(
        [columns[f.name] if f.name in columns else rows[f.name] for f in schema], schema=schema
    )


def _detail(kind: str, rows: pa.Table) -> pa.Array:
    """The detail of the kinds whose text depends on the record: how many dispatches, or
    the lateness with its sign (``%+d ms``); null for the others."""
    if kind == DUPLICATE_DISPATCH:
        times = rows["dispatches"].cast(pa.string())
        return pc.binary_join_element_wise("dispatched ", times, " times", "")
    if kind in (EARLY, LATE):
        lateness = rows["lateness_ms"]
        sign = pc.if_else(pc.greater_equal(lateness, 0), "+", "")
        return pc.binary_join_element_wise(sign, lateness.cast(pa.string()), " ms", "")
    return pa.nulls(rows.num_rows, pa.string())


def problems(judged: pa.Table, dispatch_problems: pa.Table) -> pa.Table:
    """The PROBLEM rows of a run: schedule_log's problem rows (in judge.judge's rows,
    at the byte where each is) and its dispatch_log files' (pairs.DISPATCH_PROBLEMS)."""
    schedule = judged.filter(pc.is_valid(judged["schedule_problem"])).select(
        ["bucket", "offset", "schedule_problem", "schedule_detail"]
    )
    parts = [
        _problem_rows(log_files.SCHEDULE_LOG, *schedule.columns),
        _problem_rows(
            log_files.DISPATCH_LOG,
            *dispatch_problems.select(["bucket", "position", "problem", "detail"]).columns,
        ),
    ]
    return _concat(parts, PROBLEM)


def _problem_rows(
    log: str,
    bucket: pa.ChunkedArray,
    position: pa.ChunkedArray,
    problem: pa.ChunkedArray,
    detail: pa.ChunkedArray,
) -> pa.Table:
    """PROBLEM rows of ``log``'s bucket files (few: a file's reading stops at its first
    bad frame)."""
    count = len(bucket)
    names = [bucket_name(us // US_PER_MS) for us in bucket.cast(pa.int64()).to_pylist()]
    kinds = problem.to_pylist()
    return pa.Table.from_arrays(
        [
            pa.repeat(pa.scalar(log), count),
            pa.array(names, pa.string()),
            position,
            problem,
            pa.array([severity(kind) for kind in kinds], pa.string()),
            detail,
        ],
        schema=pa.schema(list(PROBLEM)),
    )


def _concat(parts: list[pa.Table], struct: pa.StructType) -> pa.Table:
    schema = pa.schema(list(struct))
    return pa.concat_tables(parts) if parts else schema.empty_table()
