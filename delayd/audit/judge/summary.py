"""The summary table: counts per (server, bucket), per server and overall, with exact
lateness percentiles — added up on the driver from the small tables the tasks hand over.

Each bucket's counts and percentiles were made where it was read (counting.py). What
crosses buckets is added here: ids dispatched more than once (``duplicate_by_id``: the
distinct ids among a bucket's, a server's or all records), moved records whose copy is
missing (``copy_missing``; ``unverified`` instead where the copy may be in a file that
could not be read whole), later sends of an id (``duplicate_send``) and delivered
records of an id whose cancel was answered CANCELLED (``cancelled_id_delivered``),
each counted in the bucket of its record, and message_log's counts (on server and
overall rows). A server's and the overall percentiles come from the runs' lateness
histograms added up (counting.percentiles): percentiles of buckets do not add.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from delayd.audit.judge import counting
from delayd.audit.kinds import CANCELLED_ID_DELIVERED, DUPLICATE_SEND
from delayd.audit.schemas import BUCKET_TYPE, COUNTS, PERCENTILES

MESSAGE_COUNTS = (
    "message_log_records",
    "message_log_cancels",
    "message_log_reschedules",
    "not_scheduled",
    "scheduled_twice",
    "message_unverified",
)
_KEY = ["server", "bucket"]
SAME_ID_KINDS = (DUPLICATE_SEND, CANCELLED_ID_DELIVERED)  # id_checks.py's, counted by kind
SUMMARY = pa.schema(
    [
        pa.field("server", pa.string()),
        pa.field("bucket", BUCKET_TYPE),
        *(
            pa.field(name, pa.int64())
            for name in (
                *COUNTS[:4],  # scheduled, dispatched, dispatch_entries, duplicate_dispatch
                "duplicate_by_id",
                *COUNTS[4:],
                "copy_missing",
                *SAME_ID_KINDS,
                *PERCENTILES,
                *MESSAGE_COUNTS,
            )
        ),
    ]
)


def summary(
    buckets: pa.Table,
    histograms: pa.Table,
    duplicates: pa.Table,
    copies: pa.Table,
    same_id: pa.Table,
    messages: dict[str | None, dict[str, int]] | None,
) -> pa.Table:
    """The SUMMARY rows: per (server, bucket) in that order, then per server (bucket
    null), then overall (both null).

    ``buckets``: server and schemas.BUCKET_SUMMARY's fields, a row per server and
    bucket; ``histograms``: server, lateness_ms, records (counting.histogram's, of every
    run); ``duplicates``: server, bucket, message_id of the records whose id was
    dispatched more than once (across_buckets.duplicates); ``copies``: server, bucket,
    copy_missing, copy_unverified of the moved records whose copy was not found
    (across_buckets.missing_copies); ``same_id``: id_checks' findings (server, bucket,
    kind among others); ``messages``: MESSAGE_COUNTS per server and overall
    (key None), or None when no message_log was left to check (they stay null).
    """
    parts = [_bucket_rows(buckets, duplicates, copies, same_id)]
    servers = sorted(set(buckets["server"].to_pylist()))
    for server in [*servers, None]:
        row: dict[str, Any] = {"server": server, "bucket": None}
        mine = _of(buckets, server)
        row.update({name: pc.sum(mine[name]).as_py() or 0 for name in COUNTS})
        moved = _of(copies, server)
        row["unverified"] += pc.sum(moved["copy_unverified"]).as_py() or 0
        row["copy_missing"] = pc.sum(moved["copy_missing"]).as_py() or 0
        row["duplicate_by_id"] = len(pc.unique(_of(duplicates, server)["message_id"]))
        kinds = _of(same_id, server)["kind"]
        row.update({kind: pc.sum(pc.equal(kinds, kind)).as_py() or 0 for kind in SAME_ID_KINDS})
        lateness = _of(histograms, server)
        values = lateness["lateness_ms"].to_pylist(), lateness["records"].to_pylist()
        row.update(counting.percentiles(zip(*values, strict=True)))
        if messages is not None:
            row.update(messages.get(server, dict.fromkeys(MESSAGE_COUNTS, 0)))
        parts.append(pa.Table.from_pylist([row], schema=SUMMARY))
    return pa.concat_tables(parts)


def _bucket_rows(
    buckets: pa.Table, duplicates: pa.Table, copies: pa.Table, same_id: pa.Table
) -> pa.Table:
    """The rows of each server and bucket, in that order."""
    by_id = duplicates.group_by(_KEY, use_threads=False).aggregate(
        [("message_id", "count_distinct")]
    )
    moved = copies.group_by(_KEY, use_threads=False).aggregate(
        [("copy_missing", "sum"), ("copy_unverified", "sum")]
    )
    kinds = {
        kind: same_id.filter(pc.equal(same_id["kind"], kind))
        .group_by(_KEY, use_threads=False)
        .aggregate([("kind", "count")])
        .rename_columns({"kind_count": kind})
        for kind in SAME_ID_KINDS
    }
    table = buckets.join(by_id, _KEY, use_threads=False).join(moved, _KEY, use_threads=False)
    for counted in kinds.values():
        table = table.join(counted, _KEY, use_threads=False)
    columns = {name: table[name] for name in table.column_names}
    for kind in SAME_ID_KINDS:
        columns[kind] = _zero(table[kind])
    columns["duplicate_by_id"] = _zero(table["message_id_count_distinct"])
    columns["copy_missing"] = _zero(table["copy_missing_sum"])
    columns["unverified"] = pc.add(table["unverified"], _zero(table["copy_unverified_sum"]))
    rows = pa.table(
        [
            columns[f.name] if f.name in columns else pa.nulls(table.num_rows, f.type)
            for f in SUMMARY
        ],
        schema=SUMMARY,
    )
    return rows.sort_by([("server", "ascending"), ("bucket", "ascending")])


def _of(table: pa.Table, server: str | None) -> pa.Table:
    """The rows of ``server``; all of them for None."""
    return table if server is None else table.filter(pc.equal(table["server"], server))


def _zero(counts: pa.ChunkedArray) -> pa.ChunkedArray:
    return pc.fill_null(counts.cast(pa.int64()), 0)
