"""Counting the judged records: per bucket, in the task that judged them, and exact
lateness percentiles that add up across buckets and servers.

A bucket is read whole by one task, so its counts and its percentiles are exact there.
Percentiles of a server, or of all servers, need every lateness of them: a task hands
over a histogram of its run of buckets — how many dispatched records have each lateness
(a whole number of milliseconds; a run's dispatches take few distinct values) — and
the job adds the histograms up and reads the percentiles off the merged one.

Percentiles are by nearest rank: p is the smallest lateness with at least ``ceil(p *
n)`` of the ``n`` dispatched records at or below it, in integer arithmetic.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc

from delayd.audit.schemas import BUCKET_SUMMARY, COUNTS, LATENESS, PERCENTILES

PERCENT = (50, 99)  # lateness_p50_ms, lateness_p99_ms; then lateness_max_ms
_NOT_FLAGS = ("dispatched", "dispatch_entries")  # counts that are not verdicts.py's flags


def rank(percent: int, count: int) -> int:
    """The nearest rank (1-based) of the ``percent`` percentile of ``count`` values."""
    return -(-percent * count // 100)


def bucket_counts(judged: pa.Table, buckets: pa.Array) -> pa.Table:
    """One row (BUCKET_SUMMARY's fields) per bucket of ``buckets`` — the run's, also
    those with no judged rows (all counts 0) — from judge.judge's rows: the COUNTS and
    the bucket's exact PERCENTILES (null when nothing was dispatched)."""
    # Each count is the flag of the same name, but ``dispatched`` counts records (the
    # flag is set on entries with no record too) and ``dispatch_entries`` entries.
    dispatched = pc.and_(judged["scheduled"], judged["dispatched"])
    counted = {name: judged[name] for name in COUNTS if name not in _NOT_FLAGS}
    counted.update(dispatched=dispatched, dispatch_entries=judged["dispatches"])
    flags = pa.table({"bucket": judged["bucket"], **counted})
    sums = flags.group_by("bucket", use_threads=False).aggregate([(name, "sum") for name in COUNTS])
    everything = pa.table({"bucket": pc.unique(buckets)})
    table = everything.join(sums, "bucket", use_threads=False)
    table = table.join(_percentiles(judged.filter(dispatched)), "bucket", use_threads=False)
    columns = [table["bucket"]]
    for name in COUNTS:
        columns.append(pc.fill_null(table[f"{name}_sum"].cast(pa.int64()), 0))
    columns += [table[name] for name in PERCENTILES]
    return pa.Table.from_arrays(columns, schema=pa.schema(list(BUCKET_SUMMARY))).sort_by("bucket")


def _percentiles(dispatched: pa.Table) -> pa.Table:
    """bucket and PERCENTILES of the ``dispatched`` records' lateness, per bucket: in a
    table sorted by (bucket, lateness), each bucket is a run whose k-th smallest is at
    the run's start + k - 1."""
    ordered = dispatched.select(["bucket", "lateness_ms"]).sort_by(
        [("bucket", "ascending"), ("lateness_ms", "ascending")]
    )
    if not ordered.num_rows:
        return pa.table(
            {
                "bucket": ordered["bucket"],
                **{name: pa.array([], pa.int64()) for name in PERCENTILES},
            }
        )
    lateness = ordered["lateness_ms"].combine_chunks()
    runs = pc.run_end_encode(ordered["bucket"].combine_chunks(), run_end_type=pa.int64())
    ends = runs.run_ends
    starts = pa.concat_arrays([pa.array([0], pa.int64()), ends.slice(0, len(ends) - 1)])
    count = pc.subtract(ends, starts)
    columns = {"bucket": runs.values}
    for name, percent in zip(PERCENTILES[:2], PERCENT, strict=True):
        at = pc.add(starts, pc.subtract(_rank(percent, count), 1))
        columns[name] = lateness.take(at)
    columns[PERCENTILES[-1]] = lateness.take(pc.subtract(ends, 1))
    return pa.table(columns)


def _rank(percent: int, count: pa.Int64Array) -> pa.Int64Array:
    """rank() of every count (integer division of non-negative numbers)."""
    return pc.divide(pc.add(pc.multiply(count, percent), 99), 100)


def histogram(judged: pa.Table) -> pa.Table:
    """LATENESS rows of the dispatched records of judge.judge's rows: each lateness and
    how many have it."""
    dispatched = judged.filter(pc.and_(judged["scheduled"], judged["dispatched"]))
    counts = dispatched.group_by("lateness_ms", use_threads=False).aggregate(
        [("lateness_ms", "count")]
    )
    return pa.Table.from_arrays(
        [counts["lateness_ms"], counts["lateness_ms_count"]], schema=pa.schema(list(LATENESS))
    )


def percentiles(histogram_rows: Iterable[tuple[int, int]]) -> dict[str, int | None]:
    """PERCENTILES of the (lateness_ms, records) pairs of histograms added up (a lateness
    may come in several pairs); None for no records."""
    merged: dict[int, int] = {}
    for lateness, records in histogram_rows:
        merged[lateness] = merged.get(lateness, 0) + records
    total = sum(merged.values())
    result: dict[str, int | None] = dict.fromkeys(PERCENTILES)
    if not total:
        return result
    wanted = [
        (name, rank(percent, total)) for name, percent in zip(PERCENTILES[:2], PERCENT, strict=True)
    ]
    below = 0
    for lateness in sorted(merged):
        below += merged[lateness]
        while wanted and below >= wanted[0][1]:
            result[wanted.pop(0)[0]] = lateness
    result[PERCENTILES[-1]] = max(merged)
    return result
