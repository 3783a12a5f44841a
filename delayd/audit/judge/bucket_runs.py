"""What the task that reads a run of buckets hands the audit job: everything that can be
decided inside those buckets, decided (``delayd.reconciled``; schemas.RECONCILED).

A record and its dispatch_log entries are always in same-named bucket files, read by one
task (pairing.py), so the verdict on each record (verdicts.py), each bucket's counts and
percentiles (counting.py), the findings with their message ids and the problems the readers
met (findings.py) are all made here, in Arrow. What crosses buckets and servers — one
id at several records, a moved record's copy — leaves as a few rows of Arrow IPC bytes
per task (id_ranges.py), the moved records among them. So the job gets small tables, not a
row per record: a row per bucket, a lateness histogram per run, a row per finding and per
problem.

Option ``records`` asks for rows per record as well: ``offsets``, the message_log offset
of each (the message_log check needs them all); ``all``, every record with what a
finding shows of it, and nothing else (the job reads the few buckets that hold
candidates again so).
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from delayd.audit.judge import counting, findings, id_ranges
from delayd.audit.judge.pairing import BucketFiles, paired_runs
from delayd.audit.judge.verdicts import judge
from delayd.audit.kinds import HEAD
from delayd.audit.read.batches import BATCH_ROWS
from delayd.audit.schemas import RECONCILED, RECORD

NONE = "none"
OFFSETS = "offsets"
ALL = "all"
RECORD_MODES = (NONE, OFFSETS, ALL)


def reconciled_batches(
    buckets: list[BucketFiles],
    *,
    cutoff_ms: int,
    late_ms: int,
    verify: str = HEAD,
    records: str = NONE,
    batch_rows: int = BATCH_ROWS,
) -> Iterator[pa.RecordBatch]:
    """The RECONCILED rows of ``buckets``, judged as of ``cutoff_ms`` with ``late_ms``
    (config.AuditConfig), with the rows per record ``records`` asks for (RECORD_MODES),
    in batches of up to ``batch_rows``."""
    if records not in RECORD_MODES:
        raise ValueError(f"records must be one of {', '.join(RECORD_MODES)}, got {records!r}")
    parts = []
    for run in paired_runs(buckets, verify=verify, batch_rows=batch_rows):
        judged = judge(run.paired, run.dispatch_problems, cutoff_ms, late_ms)
        scheduled = judged.filter(judged["scheduled"])
        scheduled = scheduled.append_column("id_hash", id_ranges.id_hashes(scheduled["message_id"]))
        if records == ALL:
            yield from _rows("record", scheduled.select(RECORD.names), batch_rows)
            continue
        if records == OFFSETS:
            offsets = scheduled.select(["message_log_offset"])
            yield from _rows("scheduled_offset", offsets, batch_rows)
        every_bucket = pa.chunked_array(
            [*judged["bucket"].chunks, *run.dispatch_problems["bucket"].chunks],
            type=judged.schema.field("bucket").type,
        )
        side = {
            "summary": counting.bucket_counts(judged, every_bucket),
            "lateness": counting.histogram(judged),
            "finding": findings.record_findings(judged),
            "problem": findings.problems(judged, run.dispatch_problems),
        }
        for name, table in side.items():
            yield from _rows(name, table, batch_rows)
        columns = ("id_hash", "dispatches", "bucket", "message_log_offset", "sequence", "fate")
        moved = pc.fill_null(scheduled["moved"], False)
        parts.append(id_ranges.part(*(scheduled[name] for name in columns), moved))
    if records != ALL:
        blobs = list(id_ranges.blobs(parts))
        table = pa.table(
            {
                "range": pa.array([range_ for range_, _ in blobs], pa.int32()),
                "blob": pa.array([blob for _, blob in blobs], pa.binary()),
            }
        )
        yield from _rows("ids", table, batch_rows)


def _rows(column: str, table: pa.Table, batch_rows: int) -> Iterator[pa.RecordBatch]:
    """``table`` as RECONCILED rows: in ``column`` (a struct of its columns, or its one
    column), every other column null."""
    field = RECONCILED.field(column)
    for batch in table.to_batches(max_chunksize=batch_rows):
        count = batch.num_rows
        if pa.types.is_struct(field.type):
            values = pa.StructArray.from_arrays(batch.columns, fields=list(field.type))
        else:
            values = batch.column(0)
        columns = [values if f.name == column else pa.nulls(count, f.type) for f in RECONCILED]
        yield pa.RecordBatch.from_arrays(columns, schema=RECONCILED)
