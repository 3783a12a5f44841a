"""schedule_log records paired with what dispatch_log says about each offset, in Arrow,
in the task that reads the two logs' files of the same buckets.

A record and its entries always sit in bucket files of the same name (the server
appends an entry to the dispatch_log file of the record's bucket), so pairing them
needs no shuffle: a task reads both files of a run of buckets and joins them there
(Arrow's group_by and hash join, in C++), one row per record, which the same task then
judges (bucket_runs.py). Joining in Spark instead meant sending both logs to the JVM,
aggregating the entries, shuffling both sides and sorting them for a full outer join:
more than half of the audit's time (docs/benchmarks.md, "Audit").

Per (bucket, offset), of the entries that are records and not COMPLETE marks:
``dispatches``, ``dead_letters``, ``withdrawals`` (CANCELLED or RESCHEDULED), ``fate``
(the EntryKind value of the first entry by position: delayd.logs.dispatch_log),
``dispatched_ms`` (the earliest DISPATCHED entry's time) and ``first_entry_ms`` (the
earliest of all). Every schedule_log row meets the entries of its offset — its problem
rows too (``schedule_problem``, ``schedule_detail``): a problem row stands where a
record could not be read, so entries for that offset are about that record. Entries for
an offset with no schedule_log row get a row of their own. dispatch_log's problem rows
are handed over beside the pairs (``Run.dispatch_problems``).

Buckets are paired a run at a time, about BATCH_ROWS records: Arrow's joins cost
~1 ms each to set up, more than pairing a quiet bucket. Memory: a task holds one run,
or one bucket when a bucket is bigger, at about 100 bytes per record and per offset
with entries.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from delayd.audit.kinds import HEAD
from delayd.audit.read.batches import BATCH_ROWS, ReadOptions
from delayd.audit.read.dispatch import dispatch_batches
from delayd.audit.read.messages import schedule_batches
from delayd.audit.schemas import DISPATCH_LOG, PAIRED, SCHEDULE_LOG, select
from delayd.logs.dispatch_log import EntryKind
from delayd.logs.log_files import LogFile

# What each log's reader is asked for.
_SCHEDULE = select(
    SCHEDULE_LOG,
    [
        "bucket",
        "offset",
        "message_log_offset",
        "due_ms",
        "message_id",
        "sequence",
        "problem",
        "detail",
    ],
)
_DISPATCH = select(
    DISPATCH_LOG, ["bucket", "position", "kind", "offset", "at_ms", "problem", "detail"]
)
# dispatch_log's problem rows of a run (Run.dispatch_problems).
DISPATCH_PROBLEMS = select(DISPATCH_LOG, ["bucket", "position", "problem", "detail"])
_KEY = ["bucket", "offset"]


def _name(kind: EntryKind) -> str:
    """The ``kind`` column's name of an entry kind (read/dispatch.py writes these)."""
    return kind.name.lower()


_KIND_NAMES = pa.array([_name(kind) for kind in EntryKind], pa.string())
_KIND_VALUES = pa.array([kind.value for kind in EntryKind], pa.int8())
# Entries that answered "done" to a cancel or reschedule. NOT_MOVED answers nothing: a
# reschedule replayed after a crash may void a copy that the run before delivered.
_WITHDRAWALS = pa.array([_name(EntryKind.CANCELLED), _name(EntryKind.RESCHEDULED)])

# (column, aggregation) per (bucket, offset), and the name of the result in PAIRED.
# "first" is in input order (use_threads=False): the entries are sorted by position.
_PER_OFFSET = {
    ("dispatches", "sum"): "dispatches",
    ("dead_letters", "sum"): "dead_letters",
    ("withdrawals", "sum"): "withdrawals",
    ("fate", "first"): "fate",
    ("dispatched_ms", "min"): "dispatched_ms",
    ("at_ms", "min"): "first_entry_ms",
}


@dataclass(frozen=True, slots=True)
class BucketFiles:
    """One bucket's schedule_log and dispatch_log files; either may be missing (a
    bucket with nothing dispatched yet, entries for a bucket whose records are gone)."""

    schedule: LogFile | None
    dispatch: LogFile | None

    @property
    def size(self) -> int:
        """Bytes to read, for partitions.pack."""
        return sum(f.size for f in (self.schedule, self.dispatch) if f is not None)

    @property
    def name(self) -> str:
        """The bucket's file name (both files have it)."""
        return (self.schedule or self.dispatch).name  # type: ignore[union-attr]


def bucket_pairs(schedule: list[LogFile], dispatch: list[LogFile]) -> list[BucketFiles]:
    """The files of both logs paired by bucket (file name), in bucket order."""
    by_name: dict[str, list[LogFile | None]] = {}
    for log_file in schedule:
        by_name.setdefault(log_file.name, [None, None])[0] = log_file
    for log_file in dispatch:
        by_name.setdefault(log_file.name, [None, None])[1] = log_file
    return [BucketFiles(*by_name[name]) for name in sorted(by_name)]


@dataclass(frozen=True, slots=True)
class Run:
    """A run of buckets paired: ``paired`` (PAIRED rows, one chunk) and the problem rows
    of their dispatch_log files (DISPATCH_PROBLEMS)."""

    paired: pa.Table
    dispatch_problems: pa.Table


def paired_runs(
    buckets: list[BucketFiles], *, verify: str = HEAD, batch_rows: int = BATCH_ROWS
) -> Iterator[Run]:
    """``buckets`` paired a run at a time: consecutive buckets of about ``batch_rows``
    records in all (a bigger bucket is a run of its own)."""
    schedule_options = ReadOptions(verify, columns=_SCHEDULE.names)
    dispatch_options = ReadOptions(verify, columns=_DISPATCH.names)
    records: list[pa.RecordBatch] = []
    entries: list[pa.RecordBatch] = []
    rows = 0
    for bucket in buckets:
        if bucket.schedule is not None:
            records += schedule_batches(bucket.schedule, "", schedule_options)
        if bucket.dispatch is not None:
            entries += dispatch_batches(bucket.dispatch, "", dispatch_options)
        rows = sum(batch.num_rows for batch in records)
        if rows >= batch_rows:
            yield pair(records, entries)
            records, entries = [], []
    if records or entries:
        yield pair(records, entries)


def pair(records: list[pa.RecordBatch], entries: list[pa.RecordBatch]) -> Run:
    """The Run of whole files: ``records`` of schedule_log files and ``entries`` of the
    dispatch_log files of the same buckets (as the readers yield them, with
    ``_SCHEDULE``'s and ``_DISPATCH``'s columns)."""
    schedule = pa.Table.from_batches(records, schema=_SCHEDULE).rename_columns(
        {"problem": "schedule_problem", "detail": "schedule_detail"}
    )
    dispatch = pa.Table.from_batches(entries, schema=_DISPATCH)
    is_entry = pc.is_null(dispatch["problem"])
    counted = dispatch.filter(
        pc.and_(is_entry, pc.not_equal(dispatch["kind"], _name(EntryKind.COMPLETE)))
    )
    paired = schedule.join(_per_offset(counted), _KEY, join_type="full outer", use_threads=False)
    problems = dispatch.filter(pc.invert(is_entry)).select(DISPATCH_PROBLEMS.names)
    return Run(_conform(paired).combine_chunks(), problems.combine_chunks())


def _per_offset(entries: pa.Table) -> pa.Table:
    """The entries (records, no COMPLETE marks) added up per (bucket, offset)."""
    # The decoder's slow path may yield entries out of order.
    entries = entries.sort_by([("bucket", "ascending"), ("position", "ascending")])
    kind = entries["kind"]
    dispatched = pc.equal(kind, _name(EntryKind.DISPATCHED))
    flags = pa.table(
        {
            "bucket": entries["bucket"],
            "offset": entries["offset"],
            "dispatches": dispatched.cast(pa.int64()),
            "dead_letters": pc.equal(kind, _name(EntryKind.DEAD_LETTERED)).cast(pa.int64()),
            "withdrawals": pc.is_in(kind, _WITHDRAWALS).cast(pa.int64()),
            "fate": pc.take(_KIND_VALUES, pc.index_in(kind, _KIND_NAMES)),
            "dispatched_ms": pc.if_else(dispatched, entries["at_ms"], None),
            "at_ms": entries["at_ms"],
        }
    )
    grouped = flags.group_by(_KEY, use_threads=False).aggregate(list(_PER_OFFSET))
    columns = {name: grouped[name] for name in _KEY}
    for (column, aggregation), name in _PER_OFFSET.items():
        columns[name] = grouped[f"{column}_{aggregation}"]
    return pa.table(columns)


def _conform(part: pa.Table) -> pa.Table:
    """``part`` with PAIRED's columns, null where it has none."""
    columns = [
        part[field.name] if field.name in part.column_names else pa.nulls(part.num_rows, field.type)
        for field in PAIRED
    ]
    return pa.Table.from_arrays(columns, schema=PAIRED)
