"""Message ids across buckets and servers, found a hash range at a time.

Four findings depend on records of other buckets, or of other servers: an id
dispatched at more than one record (``duplicate_id``), a moved record's copy (the
record of the same id with a higher message_log offset: ``copy_missing``), an id sent
more than once (``duplicate_send``: its records on one server carry more than one
sequence number — a reschedule's copy keeps its message's) and a delivered record of
an id whose cancel was answered CANCELLED (``cancelled_id_delivered``: one server's
records of the id include one whose fate is CANCELLED and one whose fate is DISPATCHED
or DEAD_LETTERED). All look for records of one id, by its 64-bit hash (``id_hash``:
xxhash64 of the id's UTF-8 bytes).

Ten million records as Spark rows cost more than reading them (moving each row from
Python into the JVM, caching it, shuffling it: ~9 us a record on a core, measured).
So the task that reads a run of buckets keeps, of each record, only what these checks
need — id hash, DISPATCHED entries, bucket, message_log offset, sequence, fate, moved —
in an
Arrow table, and hands Spark one row per hash range (``RANGES``, by the hash's top
bits) holding that range's part as Arrow IPC bytes (``blobs``). Spark moves a few
hundred such rows to the task of their range (a shuffle of bytes), where ``merge`` adds
up all of a range at once, in Arrow: the hashes dispatched more than once, and those of
one server with several sequences or with a cancelled and a delivered record, with the
buckets that hold them; and the moved records with no record of their id behind them
(a higher message_log offset), with the buckets that hold them.

What a hash finds is decided by the ids themselves (spark/across_buckets.py): a hash collision is
never reported.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import xxhash

from delayd.logs.dispatch_log import EntryKind

RANGE_BITS = 6
RANGES = 1 << RANGE_BITS  # a merge task's share is a range; a run writes this many blobs
MS_PER_MINUTE = 60_000
# What a run keeps of each record (a bucket starts on a whole minute: UTC, 1..60 min).
PART = pa.schema(
    [
        pa.field("id_hash", pa.int64()),
        pa.field("dispatches", pa.int32()),  # DISPATCHED entries
        pa.field("bucket_minute", pa.int32()),  # the bucket's start, in minutes
        pa.field("message_log_offset", pa.int64()),
        pa.field("sequence", pa.int64()),
        pa.field("fate", pa.int8()),  # the first entry's EntryKind value, null for none
        pa.field("moved", pa.bool_()),  # moved before the cutoff: its copy is looked for
    ]
)
_COMPRESSED = pa.ipc.IpcWriteOptions(compression="zstd")
# What merge yields: a hash dispatched more than once and a bucket of one of its
# dispatched records (``candidate``), a hash of one server sent twice or cancelled and
# delivered and a bucket of one of its records there (``same_id``), or a hash of one
# server whose moved record has no record behind it, and that record's bucket (``lost``).
CANDIDATE = "candidate"
SAME_ID = "same_id"
LOST = "lost"
_CANCELLED = pa.scalar(EntryKind.CANCELLED.value, pa.int8())
_DELIVERED = pa.array([EntryKind.DISPATCHED.value, EntryKind.DEAD_LETTERED.value], pa.int8())


def id_hashes(message_ids: pa.Array | pa.ChunkedArray) -> pa.Int64Array:
    """The 64-bit hash of every id (xxhash64 of its UTF-8 bytes, as a signed integer)."""
    raw = message_ids.cast(pa.binary()).to_pylist()
    return pa.array(list(map(xxhash.xxh64_intdigest, raw)), pa.uint64()).view(pa.int64())


def part(
    id_hash: pa.Array,
    dispatches: pa.Array,
    bucket: pa.Array,
    offset: pa.Array,
    sequence: pa.Array,
    fate: pa.Array,
    moved: pa.Array,
) -> pa.Table:
    """A run's records as PART rows (``bucket`` the UTC start timestamps)."""
    minutes = pc.divide(bucket.cast(pa.int64()), 1000 * MS_PER_MINUTE).cast(pa.int32())
    return pa.Table.from_arrays(
        [id_hash, dispatches.cast(pa.int32()), minutes, offset, sequence, fate, moved],
        schema=PART,
    )


def blobs(parts: list[pa.Table]) -> Iterator[tuple[int, bytes]]:
    """PART rows split by hash range: (range, Arrow IPC stream of its rows), one per
    range that has any."""
    table = pa.concat_tables(parts) if parts else PART.empty_table()
    if not table.num_rows:
        return
    unsigned = table["id_hash"].combine_chunks().view(pa.uint64())
    ranges = pc.shift_right(unsigned, pa.scalar(64 - RANGE_BITS, pa.uint64())).cast(pa.int32())
    order = pc.sort_indices(ranges)
    table, ranges = table.take(order), ranges.take(order)
    runs = pc.run_end_encode(ranges, run_end_type=pa.int64())
    start = 0
    for range_, end in zip(runs.values.to_pylist(), runs.run_ends.to_pylist(), strict=True):
        yield range_, _ipc(table.slice(start, end - start))
        start = end


def merge(rows: Iterable[tuple[str, bytes]]) -> Iterator[tuple[str, str, int, int]]:
    """Of the blobs (server, blob) of whole ranges — every blob of each range they
    have, of every server — the CANDIDATE, SAME_ID and LOST results as (kind, server,
    id_hash, a bucket's start in ms)."""
    tables = []
    for server, blob in rows:
        table = pa.ipc.open_stream(blob).read_all()
        tables.append(table.append_column("server", pa.repeat(pa.scalar(server), table.num_rows)))
    if not tables:
        return
    records = pa.concat_tables(tables)
    dispatched = records.filter(pc.greater(records["dispatches"], 0))
    hashes = dispatched["id_hash"]
    # Adding up per hash is needed only when a hash repeats or a record was dispatched
    # twice; counting the distinct hashes says whether one does at half the cost (and
    # when nothing is wrong, none does).
    if (
        len(pc.unique(hashes)) < len(hashes)
        or pc.any(pc.greater(dispatched["dispatches"], 1)).as_py()
    ):
        per_hash = dispatched.group_by("id_hash", use_threads=False).aggregate(
            [("dispatches", "sum")]
        )
        twice = per_hash.filter(pc.greater(per_hash["dispatches_sum"], 1))["id_hash"]
        found = dispatched.filter(pc.is_in(dispatched["id_hash"], twice))
        found = found.group_by(["server", "id_hash", "bucket_minute"], use_threads=False)
        for row in found.aggregate([]).to_pylist():
            yield CANDIDATE, row["server"], row["id_hash"], row["bucket_minute"] * MS_PER_MINUTE
    yield from _same_id(records)
    yield from _lost(records)


def _lost(records: pa.Table) -> Iterator[tuple[str, str, int, int]]:
    """LOST results of ``records`` (PART rows with ``server``): each moved record with
    no record of the same (server, hash) at a higher message_log offset — where the
    reschedule's copy should be (across_buckets.py) — as its bucket. A moved record
    that has its copy is not the highest of its id, so only the highest can be lost."""
    moved = records.filter(records["moved"])
    if not moved.num_rows:
        return
    keys = ["server", "id_hash"]
    mine = records.filter(pc.is_in(records["id_hash"], moved["id_hash"]))
    latest = mine.group_by(keys, use_threads=False).aggregate([("message_log_offset", "max")])
    lost = moved.join(latest, keys, use_threads=False)
    lost = lost.filter(pc.equal(lost["message_log_offset"], lost["message_log_offset_max"]))
    for row in lost.select(["server", "id_hash", "bucket_minute"]).to_pylist():
        yield LOST, row["server"], row["id_hash"], row["bucket_minute"] * MS_PER_MINUTE


def _same_id(records: pa.Table) -> Iterator[tuple[str, str, int, int]]:
    """SAME_ID results of ``records`` (PART rows with ``server``): per (server, hash)
    with more than one sequence, or with a CANCELLED and a delivered fate, each bucket
    (its start in ms) that holds a record of it. Only hashes held by more than one
    record can be either; when nothing was sent twice or rescheduled, none is."""
    hashes = records["id_hash"]
    if len(pc.unique(hashes)) == len(hashes):
        return
    counted = pc.value_counts(hashes)
    repeated = counted.field("values").filter(pc.greater(counted.field("counts"), 1))
    mine = records.filter(pc.is_in(hashes, repeated))
    flags = mine.append_column(
        "cancelled", pc.fill_null(pc.equal(mine["fate"], _CANCELLED), False)
    ).append_column("delivered", pc.is_in(mine["fate"], _DELIVERED))
    per_id = flags.group_by(["server", "id_hash"], use_threads=False).aggregate(
        [("sequence", "count_distinct"), ("cancelled", "any"), ("delivered", "any")]
    )
    suspect = per_id.filter(
        pc.or_(
            pc.greater(per_id["sequence_count_distinct"], 1),
            pc.and_(per_id["cancelled_any"], per_id["delivered_any"]),
        )
    ).select(["server", "id_hash"])
    if not suspect.num_rows:
        return
    found = mine.join(suspect, ["server", "id_hash"], join_type="inner", use_threads=False)
    found = found.group_by(["server", "id_hash", "bucket_minute"], use_threads=False)
    for row in found.aggregate([]).to_pylist():
        yield SAME_ID, row["server"], row["id_hash"], row["bucket_minute"] * MS_PER_MINUTE


def _ipc(table: pa.Table) -> bytes:
    """``table`` as an Arrow IPC stream, compressed: the hashes do not shrink, but the
    rest does (a run's records share buckets, most were dispatched once, message_log
    offsets grow), to about 9 bytes a record of 24 — and moving the bytes through
    Spark costs more than compressing them (measured)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=_COMPRESSED) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()
