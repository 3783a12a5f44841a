"""What crosses buckets and servers: one id at several records, a moved record's copy.

Everything a record's own bucket decides was decided where it was read (judge/verdicts.py). Four
findings take other buckets, or other servers; all look for the records of one id, by
its 64-bit hash, a hash range at a time (id_ranges.py):

* duplicate_id: a message id whose DISPATCHED entries are at more than one record (a
  producer retry stored twice is two records with one id — on one server, also a
  duplicate_send — and the broker's dedupe is per broker). ``duplicate_by_id`` counts
  the ids with more than one DISPATCHED entry in all, so an id dispatched twice at one
  record counts there too. The hashes dispatched more than once are candidates (none,
  when nothing is wrong); the buckets that hold them are read again, and the ids
  themselves decide: a hash collision is never reported.
* copy_missing: a record withdrawn by RESCHEDULED before the cutoff (``moved``) with no
  record of the same message id (by hash) and a higher message_log offset on its
  server: the copy a reschedule appends in the same step is not there. The ranges find
  them (id_ranges.LOST); their buckets are read again for what the finding shows. Where a
  schedule_log file of the server could not be read whole, the copy may be in the part
  that was not read: ``unverified`` instead. A reschedule appends its copy behind the
  RESCHEDULE tombstone's message_log offset, higher than the moved record's; the
  server finds the current record of an id the same way (delayd.server.cancels). A
  later message reusing the id would hide a missing copy: ids are meant to be unique
  (docs/cancel.md, Limits).
* duplicate_send and cancelled_id_delivered (judge/id_checks.py): the hashes of one server
  whose records carry more than one sequence, or hold a cancelled and a delivered
  record, are candidates (none, when nothing is wrong); the buckets that hold their
  records are read again, and id_checks decides by the ids themselves.

The buckets of every kind of candidate are read again together, in one Spark job.

Only candidates reach the driver — what merge yields and the records of their buckets,
as Arrow tables — which are few unless the logs are badly wrong; a clean audit brings
none. A moved record is a candidate only when its copy was not found.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, Row, SparkSession

from delayd.audit.config import AuditConfig
from delayd.audit.judge import id_checks, id_ranges
from delayd.audit.schemas import BUCKET_TYPE, RECORD
from delayd.audit.spark import inputs
from delayd.audit.spark.queries import fetch, where_in
from delayd.logs.dispatch_log import EntryKind

SHOWN = ["server", *RECORD.names]  # what a finding shows of a record, and its id hash
SHOWN_SCHEMA = pa.schema([pa.field("server", pa.string()), *RECORD])
US_PER_MS = 1000


def cross_buckets(
    spark: SparkSession, config: AuditConfig, rows: DataFrame, unread: set[str]
) -> tuple[pa.Table, pa.Table, pa.Table]:
    """duplicates' and missing_copies' rows, and id_checks' findings (DISCREPANCIES),
    from the id ranges of delayd.reconciled's ``rows`` (with their ``server``) of every
    server: one Spark job, and one more to read again the buckets that hold candidates,
    if there are any. ``unread`` are the servers with a schedule_log problem row."""
    ranges = rows.where("ids IS NOT NULL").selectExpr("server", "ids.range", "ids.blob")
    # A range's blobs go to one task, which adds them all up (id_ranges.merge). Ranges are
    # spread over the tasks by a hash: several tasks per core even out what lands where.
    tasks = min(id_ranges.RANGES, 8 * spark.sparkContext.defaultParallelism)
    found = ranges.repartition(tasks, "range").rdd.mapPartitions(_merge).collect()
    # Candidates of every kind: (server, hash, bucket); their buckets are read again.
    buckets = sorted({(server, bucket_ms) for _, server, _, bucket_ms in found})
    records = reread(spark, config, buckets, {h for _, _, h, _ in found})
    hashes = pa.array(
        sorted({h for kind, _, h, _ in found if kind == id_ranges.CANDIDATE}), pa.int64()
    )
    same_id = {(server, h) for kind, server, h, _ in found if kind == id_ranges.SAME_ID}
    lost = {(server, h, ms) for kind, server, h, ms in found if kind == id_ranges.LOST}
    checked = id_checks.findings(_of_ids(records, same_id))
    return duplicates(records, hashes), missing_copies(records, lost, unread), checked


def _merge(rows: Iterable[Row]) -> Iterator[tuple]:
    return id_ranges.merge((row["server"], row["blob"]) for row in rows)


def reread(
    spark: SparkSession, config: AuditConfig, buckets: list[tuple[str, int]], hashes: set[int]
) -> pa.Table:
    """The records (SHOWN columns) of the candidate ``hashes`` in the ``buckets``
    (server, start in ms) that hold them, read again; none without a Spark job when
    there are no candidates."""
    if not buckets:
        return SHOWN_SCHEMA.empty_table()
    where = pa.table(
        {
            "server": [server for server, _ in buckets],
            "bucket": pa.array([ms * US_PER_MS for _, ms in buckets], BUCKET_TYPE),
        }
    )
    records = inputs.records(spark, config, where)
    wanted = pa.array(sorted(hashes), pa.int64())
    return fetch(where_in(spark, records, "id_hash", wanted)).cast(SHOWN_SCHEMA)


def duplicates(records: pa.Table, hashes: pa.Array) -> pa.Table:
    """The records whose id has more than one DISPATCHED entry over all servers (SHOWN
    columns), with ``id_dispatches`` (entries in all) and ``id_records`` (records
    dispatched): of the ``records`` read again, the dispatched ones of the candidate
    ``hashes``, decided by their ids."""
    dispatched = pc.and_(pc.greater(records["dispatches"], 0), pc.is_in(records["id_hash"], hashes))
    return _per_id(records.filter(dispatched))


def _of_ids(records: pa.Table, keys: set[tuple[str, int]]) -> pa.Table:
    """The ``records`` of the (server, id_hash) ``keys``: of each, every record of its
    server (the buckets read again hold them all), none of another."""
    wanted = pa.table(
        {
            "server": pa.array([server for server, _ in keys], pa.string()),
            "id_hash": pa.array([h for _, h in keys], pa.int64()),
        }
    )
    return records.join(wanted, ["server", "id_hash"], join_type="inner", use_threads=False)


def _per_id(candidates: pa.Table) -> pa.Table:
    """Of the ``candidates`` (SHOWN columns), the records whose id has more than one
    DISPATCHED entry, with ``id_dispatches`` and ``id_records``."""
    per_id = candidates.group_by("message_id", use_threads=False).aggregate(
        [("dispatches", "sum"), ("message_id", "count")]
    )
    per_id = per_id.filter(pc.greater(per_id["dispatches_sum"], 1)).rename_columns(
        {"dispatches_sum": "id_dispatches", "message_id_count": "id_records"}
    )
    return candidates.join(per_id, "message_id", join_type="inner", use_threads=False)


def missing_copies(
    records: pa.Table, lost: set[tuple[str, int, int]], unread: set[str]
) -> pa.Table:
    """The moved records whose copy was not found (SHOWN columns), with
    ``copy_missing`` and ``copy_unverified``: the latter on the servers in ``unread``
    (the copy may be the record that could not be read). ``lost`` are the (server,
    id_hash, bucket start in ms) the ranges found (id_ranges.LOST: no record of the id
    behind a moved one); ``records`` the records read again of those buckets, among
    which each is the one moved, at its id's highest message_log offset."""
    wanted = pa.table(
        {
            "server": pa.array([server for server, _, _ in lost], pa.string()),
            "id_hash": pa.array([h for _, h, _ in lost], pa.int64()),
            "bucket": pa.array([ms * US_PER_MS for _, _, ms in lost], BUCKET_TYPE),
        }
    )
    keys = ["server", "id_hash"]
    mine = records.join(wanted, [*keys, "bucket"], join_type="inner", use_threads=False)
    moved = mine.filter(pc.equal(mine["fate"], pa.scalar(EntryKind.RESCHEDULED.value, pa.int8())))
    latest = records.join(wanted.select(keys), keys, join_type="inner", use_threads=False)
    latest = latest.group_by(keys, use_threads=False).aggregate([("message_log_offset", "max")])
    moved = moved.join(latest, keys, use_threads=False)
    at_end = pc.equal(moved["message_log_offset"], moved["message_log_offset_max"])
    lost_rows = moved.filter(at_end).select(SHOWN).sort_by([(c, "ascending") for c in SHOWN[:3]])
    maybe = pc.is_in(lost_rows["server"], pa.array(sorted(unread), pa.string()))
    lost_rows = lost_rows.append_column("copy_missing", pc.invert(maybe))
    return lost_rows.append_column("copy_unverified", maybe)
