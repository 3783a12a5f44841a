"""The reconciliation: one row per schedule_log record with what became of it.

``(server, bucket, offset)`` names a message for good (docs/replay.md). Each record is
joined with what dispatch_log says about that offset, and judged. The first entry of an
offset (in file order) is its *fate* (delayd.logs.dispatch_log); a CANCELLED or
RESCHEDULED fate *withdraws* the record (docs/cancel.md): it is settled, never overdue,
never in the lateness figures. Definitions (docs/audit.md has them with examples);
``cutoff = as_of - grace``:

* dispatched: the record has at least one DISPATCHED entry and was not withdrawn;
  ``dispatched_ms`` is the first one's time, ``lateness_ms = dispatched_ms - due_ms``.
* cancelled / rescheduled: the fate is CANCELLED / RESCHEDULED (the record was moved
  away: a copy with the new due time is a record of its own). A cancel replayed after a
  crash may repeat CANCELLED: the first entry counts, the others are harmless.
* dispatched_after_cancel: withdrawn, and yet a DISPATCHED or DEAD_LETTERED entry
  follows — a cancelled (or moved) message was delivered.
* cancelled_after_dispatch: the fate is DISPATCHED or DEAD_LETTERED and a CANCELLED or
  RESCHEDULED entry follows — a cancel or reschedule was told "done" for a message
  already delivered (the server answers ALREADY_DELIVERED and writes nothing).
* copy_missing: withdrawn by RESCHEDULED, written before the cutoff, and no record of
  the same message id (by hash) with a higher message_log offset exists on that server:
  the copy a reschedule appends in the same step is not there (missing_copies). Where
  a schedule_log file of the server could not be read whole, the copy may be in the
  part that was not read: counted as unverified instead.
* duplicate_dispatch: more than one DISPATCHED entry for the same record.
* duplicate_id: a message id whose DISPATCHED entries are at more than one record
  (a producer retry is two records with one id; the delay server does not dedupe, the
  broker does). The by-id count counts ids with more than one DISPATCHED entry in all,
  so an id dispatched twice at one record counts there too.
* overdue: no entry at all (no fate) and due before the cutoff.
  pending: the same, due at or after the cutoff (not judged yet). unverified: the same
  as overdue, in a bucket whose dispatch_log file has a problem (its entry may be in the
  part that could not be read); counted, not listed: the problem row is the finding.
* early: dispatched before its due time. late: ``lateness_ms > late_ms``.
* dead_lettered: handled (never overdue) but listed, as a notice.
* unknown_record: an entry for an offset with no schedule_log record, written before
  the cutoff (a later one may belong to a record appended after the audit read the
  bucket), and before the byte where reading the bucket's schedule_log stopped, if it
  did (past it, records exist that could not be read).

Each log is read once, a bucket's two files together, joined where they are read
(pairs.py): schedule_log's problem rows travel through the join with its records (a
torn or corrupt frame sits at a record's offset); dispatch_log's are counted per file.
A message id travels as its 64-bit hash; the ids themselves are read again for the
few records that need them (inputs.py), so ten million strings are never shuffled or
cached.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from delayd.audit.config import AuditConfig
from delayd.audit.kinds import CORRUPT, TORN_TAIL
from delayd.logs.dispatch_log import EntryKind

WITHDRAWN = (EntryKind.CANCELLED.value, EntryKind.RESCHEDULED.value)  # fates: settled
DELIVERED = (EntryKind.DISPATCHED.value, EntryKind.DEAD_LETTERED.value)  # fates

# Discrepancy kinds. Every kind fails the audit except the notices.
DEAD_LETTERED = EntryKind.DEAD_LETTERED.name.lower()  # as dispatch_log's kind column
OVERDUE = "overdue"
DUPLICATE_DISPATCH = "duplicate_dispatch"
DUPLICATE_ID = "duplicate_id"
EARLY = "early"
LATE = "late"
UNKNOWN_RECORD = "unknown_record"
DISPATCHED_AFTER_CANCEL = "dispatched_after_cancel"
CANCELLED_AFTER_DISPATCH = "cancelled_after_dispatch"
COPY_MISSING = "copy_missing"
NOT_SCHEDULED = "not_scheduled"
SCHEDULED_TWICE = "scheduled_twice"
NOTICES = frozenset({DEAD_LETTERED, TORN_TAIL})

KEY = ["server", "bucket", "offset"]  # names a schedule_log record for good
DUPLICATES_SCHEMA = (
    "server string, bucket timestamp, offset long, message_id string, "
    "id_dispatches long, id_records long"
)
COPIES_SCHEMA = (
    "server string, bucket timestamp, offset long, copy_missing boolean, copy_unverified boolean"
)
IN_SERVER = KEY[1:]


def is_record(frame: DataFrame) -> Column:
    return frame["problem"].isNull()


def joined(paired: DataFrame) -> DataFrame:
    """One server's ``delayd.paired`` rows (pairs.py: every schedule_log row, problem
    rows included, with what dispatch_log says about its offset; entries for an offset
    with no schedule_log row; a count per damaged dispatch_log file), the message id
    replaced by its 64-bit hash ``id_hash`` (null where there is no id). Not judged yet
    (judge); no ``server`` column (the job adds it, so that a cache of these rows holds
    no copy of the server's name per record)."""
    message_id = F.col("message_id")
    return paired.select(
        *IN_SERVER,
        "message_log_offset",
        "due_ms",
        F.when(message_id.isNotNull(), F.xxhash64(message_id)).alias("id_hash"),
        "schedule_problem",
        "schedule_detail",
        "dispatches",
        "dead_letters",
        "withdrawals",
        "fate",
        "dispatched_ms",
        "first_entry_ms",
        "dispatch_problems",
    )


def judge(
    joined_rows: DataFrame, stops: DataFrame, damaged: DataFrame, config: AuditConfig
) -> DataFrame:
    """The rows of ``joined`` with the flags of the module docstring. ``stops`` and
    ``damaged`` are schedule_stops and damaged_dispatch_logs of those rows (small; the
    job computes them once)."""
    judged = joined_rows.join(F.broadcast(stops), ["server", "bucket"], "left").join(
        F.broadcast(damaged), ["server", "bucket"], "left"
    )
    dispatches = F.coalesce(F.col("dispatches"), F.lit(0))
    dead_letters = F.coalesce(F.col("dead_letters"), F.lit(0))
    withdrawals = F.coalesce(F.col("withdrawals"), F.lit(0))
    fate = F.col("fate")
    withdrawn = F.coalesce(fate.isin(*WITHDRAWN), F.lit(False))
    delivered_first = F.coalesce(fate.isin(*DELIVERED), F.lit(False))
    scheduled = F.col("due_ms").isNotNull()
    known = scheduled | F.col("schedule_problem").isNotNull()
    handled = fate.isNotNull()
    undone = scheduled & ~handled & (F.col("due_ms") < config.cutoff_ms)
    damaged = F.coalesce(F.col("dispatch_damaged"), F.lit(False))
    unread = F.col("schedule_stop").isNotNull() & (F.col("offset") >= F.col("schedule_stop"))
    # A withdrawn record has no lateness: it was not to be sent (if it was, that is
    # dispatched_after_cancel, not lateness).
    lateness = F.when(scheduled & ~withdrawn, F.col("dispatched_ms") - F.col("due_ms"))
    return judged.select(
        *KEY,
        "message_log_offset",
        "due_ms",
        "id_hash",
        dispatches.alias("dispatches"),
        "dispatched_ms",
        lateness.alias("lateness_ms"),
        flag("scheduled", scheduled),
        flag("dispatched", (dispatches > 0) & ~withdrawn),
        flag("dead_lettered", (dead_letters > 0) & ~withdrawn),
        flag("cancelled", fate == EntryKind.CANCELLED.value),
        flag("rescheduled", fate == EntryKind.RESCHEDULED.value),
        flag("overdue", undone & ~damaged),
        flag("unverified", undone & damaged),
        flag("pending", scheduled & ~handled & (F.col("due_ms") >= config.cutoff_ms)),
        flag("early", lateness < 0),
        flag("late", lateness > config.late_ms),
        flag("duplicate_dispatch", scheduled & (dispatches > 1)),
        flag("dispatched_after_cancel", scheduled & withdrawn & (dispatches + dead_letters > 0)),
        flag("cancelled_after_dispatch", scheduled & delivered_first & (withdrawals > 0)),
        flag(
            "unknown_record",
            ~known & ~unread & (F.col("first_entry_ms") < config.cutoff_ms),
        ),
    )


def flag(name: str, condition: Column) -> Column:
    """A true/false column (never null: a comparison with a missing value is false)."""
    return F.coalesce(condition, F.lit(False)).alias(name)


def schedule_stops(joined_rows: DataFrame) -> DataFrame:
    """Per bucket, the byte where reading its schedule_log file stopped (torn tail or
    corruption): entries for offsets from there on are about records that could not be
    read, not unknown ones."""
    return (
        joined_rows.where(F.col("schedule_problem").isin(TORN_TAIL, CORRUPT))
        .groupBy("server", "bucket")
        .agg(F.min("offset").alias("schedule_stop"))
    )


def damaged_dispatch_logs(joined_rows: DataFrame) -> DataFrame:
    """Buckets whose dispatch_log file has a problem: some entries could not be read, so
    a record there without an entry is ``unverified``, not overdue."""
    return (
        joined_rows.where(F.col("dispatch_problems") > 0)
        .select("server", "bucket", F.lit(True).alias("dispatch_damaged"))
        .distinct()
    )


def problem_rows(joined_rows: DataFrame) -> DataFrame:
    """The rows of ``joined`` that stand for problems: schedule_log's problem rows and
    dispatch_log's per-file counts. Few; schedule_stops, damaged_dispatch_logs and the
    corrupt_records table are computed from them."""
    return joined_rows.where(
        F.col("schedule_problem").isNotNull() | (F.col("dispatch_problems") > 0)
    ).select(*KEY, "schedule_problem", "schedule_detail", "dispatch_problems")


def duplicate_hashes(joined_rows: DataFrame) -> DataFrame:
    """Message id hashes with more than one DISPATCHED entry over all servers (a
    superset of the duplicate ids: hashes can collide)."""
    return (
        joined_rows.where(F.col("due_ms").isNotNull() & (F.col("dispatches") > 0))
        .groupBy("id_hash")
        .agg(F.sum("dispatches").alias("hash_dispatches"))
        .where(F.col("hash_dispatches") > 1)
        .select("id_hash")
    )


def duplicate_candidates(joined_rows: DataFrame, hashes: DataFrame) -> DataFrame:
    """The dispatched records whose id hash is one of ``hashes`` (KEY and
    ``dispatches``); duplicate_ids decides by the ids themselves."""
    dispatched = joined_rows.where(F.col("due_ms").isNotNull() & (F.col("dispatches") > 0))
    return dispatched.join(hashes, "id_hash", "left_semi").select(*KEY, "dispatches")


def duplicate_ids(candidates: DataFrame) -> DataFrame:
    """Of the candidates (with their ``message_id``), the records whose message id has
    more than one DISPATCHED entry over all servers, with ``id_dispatches`` (entries in
    all) and ``id_records`` (records dispatched)."""
    per_id = (
        candidates.groupBy("message_id")
        .agg(F.sum("dispatches").alias("id_dispatches"), F.count("*").alias("id_records"))
        .where(F.col("id_dispatches") > 1)
    )
    return candidates.join(per_id, "message_id").select(
        *KEY, "message_id", "id_dispatches", "id_records"
    )


def moved(joined_rows: DataFrame) -> DataFrame:
    """The records whose fate is RESCHEDULED (KEY, ``message_log_offset``, ``id_hash``,
    ``first_entry_ms``): each should have a copy (missing_copies)."""
    return joined_rows.where(
        F.col("due_ms").isNotNull() & (F.col("fate") == EntryKind.RESCHEDULED.value)
    ).select(*KEY, "message_log_offset", "id_hash", "first_entry_ms")


def missing_copies(
    joined_rows: DataFrame, moved_rows: DataFrame, unread: DataFrame, config: AuditConfig
) -> DataFrame:
    """Of ``moved_rows`` (moved's output; the job broadcasts it when small), those with no
    record of the same id hash and a higher message_log offset on their server, moved
    before the cutoff (a live server appends the copy right after the entry; the audit
    may have read the bucket the copy went to before). ``unread``: the servers (column
    ``server``) with a schedule_log problem row, where the copy may be the record that
    could not be read: ``copy_unverified`` there, ``copy_missing`` elsewhere.

    A reschedule appends its copy behind the RESCHEDULE tombstone's message_log offset,
    which is higher than the moved record's; the server finds the current record of an
    id the same way (the highest message_log offset, delayd.server.cancels). A later
    message reusing the id would hide a missing copy: ids are meant to be unique
    (docs/cancel.md, Limits)."""
    later = joined_rows.where(F.col("due_ms").isNotNull()).select(
        "server", "id_hash", F.col("message_log_offset").alias("later_offset")
    )
    followed = (
        later.join(moved_rows, ["server", "id_hash"])
        .where(F.col("later_offset") > F.col("message_log_offset"))
        .select(*KEY)
        .distinct()
    )
    lost = moved_rows.join(followed, KEY, "left_anti").where(
        F.col("first_entry_ms") < config.cutoff_ms
    )
    unread = unread.select("server", F.lit(True).alias("schedule_unread")).distinct()
    maybe = F.coalesce(F.col("schedule_unread"), F.lit(False))
    return lost.join(F.broadcast(unread), "server", "left").select(
        *KEY, (~maybe).alias("copy_missing"), maybe.alias("copy_unverified")
    )


def with_copies(status: DataFrame, copies: DataFrame) -> DataFrame:
    """``status`` plus ``copy_missing`` (missing_copies' rows), with ``unverified`` also
    true where a copy could not be verified."""
    joined = status.join(copies, KEY, "left")
    return joined.withColumns(
        {
            "copy_missing": F.coalesce(F.col("copy_missing"), F.lit(False)),
            "unverified": F.col("unverified") | F.coalesce(F.col("copy_unverified"), F.lit(False)),
        }
    ).drop("copy_unverified")


def with_duplicate_ids(status: DataFrame, duplicates: DataFrame) -> DataFrame:
    """``status`` plus ``duplicate_by_id`` (the record's id was dispatched more than once)
    and ``duplicate_id`` (at more than one record), with ``id_records``."""
    joined = status.join(duplicates.select(*KEY, "id_records"), KEY, "left")
    return joined.withColumns(
        {
            "duplicate_by_id": F.col("id_records").isNotNull(),
            "duplicate_id": F.coalesce(F.col("id_records"), F.lit(0)) > 1,
        }
    )
