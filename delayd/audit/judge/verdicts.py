"""The verdict on every record of a run of buckets, in Arrow, in the task that read them.

``(server, bucket, offset)`` names a message for good (docs/replay.md). Each record has
been paired with what dispatch_log says about its offset (pairing.py); everything needed
to judge it is in its own bucket's two files, so it is judged where they were read.
What crosses buckets — one message id at several records, a moved record's copy, the
message_log check — is left to the job (spark/across_buckets.py, spark/message_check.py).

The first entry of an offset (in file order) is its *fate* (delayd.logs.dispatch_log);
a CANCELLED, RESCHEDULED or NOT_MOVED fate *withdraws* the record (docs/cancel.md): it
is settled, never overdue, never in the lateness figures. NOT_MOVED is the copy a
refused reschedule appended (every member of a group appends it): counted in no flag
but ``scheduled``. Definitions (docs/audit.md has them with
examples); ``cutoff = as_of - grace``:

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
* moved: withdrawn by RESCHEDULED before the cutoff — its copy must exist (the job
  looks for it: across_buckets.missing_copies).
* duplicate_dispatch: more than one DISPATCHED entry for the same record.
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

A flag is true or false, never null: a comparison with a missing value is false.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from delayd.audit.kinds import CORRUPT, TORN_TAIL
from delayd.logs.dispatch_log import EntryKind

_WITHDRAWN = pa.array(
    [EntryKind.CANCELLED.value, EntryKind.RESCHEDULED.value, EntryKind.NOT_MOVED.value], pa.int8()
)
_DELIVERED = pa.array([EntryKind.DISPATCHED.value, EntryKind.DEAD_LETTERED.value], pa.int8())
_STOPS = pa.array([TORN_TAIL, CORRUPT])  # problems after which reading a file stops

# The flags judge() adds, in this order; every one but ``moved`` is a count of the
# summary (counting.py).
FLAGS = (
    "scheduled",
    "dispatched",
    "dead_lettered",
    "cancelled",
    "rescheduled",
    "overdue",
    "unverified",
    "pending",
    "early",
    "late",
    "duplicate_dispatch",
    "dispatched_after_cancel",
    "cancelled_after_dispatch",
    "unknown_record",
    "moved",
)


def judge(paired: pa.Table, dispatch_problems: pa.Table, cutoff_ms: int, late_ms: int) -> pa.Table:
    """``paired`` (pairs.PAIRED rows of a run of buckets) with ``dispatches`` 0 where
    there are none, ``lateness_ms`` and the FLAGS of the module docstring.
    ``dispatch_problems`` are the problem rows of the run's dispatch_log files
    (pairs.DISPATCH_PROBLEMS): a bucket with any is damaged."""
    due_ms, fate = paired["due_ms"], paired["fate"]
    dispatches = _zero(paired["dispatches"])
    dead_letters = _zero(paired["dead_letters"])
    withdrawn = _true(pc.is_in(fate, _WITHDRAWN))
    scheduled = pc.is_valid(due_ms)
    known = pc.or_(scheduled, pc.is_valid(paired["schedule_problem"]))
    unhandled = pc.and_(scheduled, pc.is_null(fate))
    before_cutoff = _true(pc.less(due_ms, cutoff_ms))
    undone = pc.and_(unhandled, before_cutoff)
    damaged = pc.is_in(paired["bucket"], dispatch_problems["bucket"].combine_chunks())
    lateness = pc.if_else(
        pc.and_(scheduled, pc.invert(withdrawn)),
        pc.subtract(paired["dispatched_ms"], due_ms),
        pa.scalar(None, pa.int64()),
    )
    flags = {
        "scheduled": scheduled,
        "dispatched": pc.and_(pc.greater(dispatches, 0), pc.invert(withdrawn)),
        "dead_lettered": pc.and_(pc.greater(dead_letters, 0), pc.invert(withdrawn)),
        "cancelled": _true(pc.equal(fate, EntryKind.CANCELLED.value)),
        "rescheduled": _true(pc.equal(fate, EntryKind.RESCHEDULED.value)),
        "overdue": pc.and_(undone, pc.invert(damaged)),
        "unverified": pc.and_(undone, damaged),
        "pending": pc.and_(unhandled, pc.invert(before_cutoff)),
        "early": _true(pc.less(lateness, 0)),
        "late": _true(pc.greater(lateness, late_ms)),
        "duplicate_dispatch": pc.and_(scheduled, pc.greater(dispatches, 1)),
        "dispatched_after_cancel": pc.and_(
            pc.and_(scheduled, withdrawn), pc.greater(pc.add(dispatches, dead_letters), 0)
        ),
        "cancelled_after_dispatch": pc.and_(
            pc.and_(scheduled, _true(pc.is_in(fate, _DELIVERED))),
            pc.greater(_zero(paired["withdrawals"]), 0),
        ),
        "unknown_record": pc.and_(
            pc.and_(pc.invert(known), pc.invert(_unread(paired))),
            _true(pc.less(paired["first_entry_ms"], cutoff_ms)),
        ),
        "moved": pc.and_(
            _true(pc.equal(fate, EntryKind.RESCHEDULED.value)),
            pc.and_(scheduled, _true(pc.less(paired["first_entry_ms"], cutoff_ms))),
        ),
    }
    judged = paired.set_column(
        paired.schema.get_field_index("dispatches"), "dispatches", dispatches
    )
    judged = judged.append_column("lateness_ms", lateness)
    for name in FLAGS:
        judged = judged.append_column(name, flags[name])
    return judged


def _stops(paired: pa.Table) -> pa.Table:
    """Per bucket (``bucket``), the byte where reading its schedule_log file stopped
    (``stop``: a torn tail or corruption); only buckets where it did."""
    stopped = paired.filter(pc.is_in(paired["schedule_problem"], _STOPS))
    grouped = stopped.group_by("bucket", use_threads=False).aggregate([("offset", "min")])
    return grouped.rename_columns({"offset_min": "stop"})


def _unread(paired: pa.Table) -> pa.BooleanArray:
    """Rows at or after the byte where reading their bucket's schedule_log stopped."""
    unread = pa.repeat(False, paired.num_rows)
    for bucket, stop in zip(*_stops(paired).select(["bucket", "stop"]).columns, strict=True):
        here = pc.and_(pc.equal(paired["bucket"], bucket), pc.greater_equal(paired["offset"], stop))
        unread = pc.or_(unread, _true(here))
    return unread


def _zero(counts: pa.ChunkedArray) -> pa.ChunkedArray:
    """``counts`` with 0 where null (no entries)."""
    return pc.fill_null(counts, 0)


def _true(condition: pa.ChunkedArray) -> pa.ChunkedArray:
    """``condition`` with false where null."""
    return pc.fill_null(condition, False)
