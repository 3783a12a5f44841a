"""What the audit decides where a bucket is read, without Spark: the flags of every
record (judge/verdicts.py), each bucket's counts and percentiles and the histograms that add up
across buckets (counting.py), the hash ranges that find one id across buckets and servers
(id_ranges.py) — each against a plain, row-by-row reading of docs/audit.md — and what the
records of one id decide (judge/id_checks.py)."""

from __future__ import annotations

import math
import random

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delayd.audit.judge import counting, id_checks, id_ranges
from delayd.audit.judge.pairing import DISPATCH_PROBLEMS
from delayd.audit.judge.verdicts import FLAGS, judge
from delayd.audit.kinds import CORRUPT, ERROR, FORMAT, TORN_TAIL
from delayd.audit.schemas import PAIRED, RECORD
from delayd.logs.dispatch_log import EntryKind
from tests.audit_support import MINUTE, T0

EXAMPLES = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CUTOFF_MS = T0 + 30 * MINUTE
LATE_MS = 5_000
US_PER_MS = 1000
BUCKETS = [T0 + i * MINUTE for i in range(3)]
SHOWN_SCHEMA = pa.schema([pa.field("server", pa.string()), *RECORD])  # reconcile.SHOWN

# A PAIRED row: a record, a schedule_log problem row, or entries with no record. Times
# cluster around the boundaries the definitions draw.
COUNT = st.none() | st.integers(0, 3)
NEAR_CUTOFF = st.sampled_from([CUTOFF_MS - 1, CUTOFF_MS, CUTOFF_MS + 1])
LATENESS = st.sampled_from([-1, 0, 1, LATE_MS - 1, LATE_MS, LATE_MS + 1])
ROWS = st.lists(
    st.fixed_dictionaries(
        {
            "bucket": st.sampled_from(BUCKETS),
            "offset": st.integers(0, 50).map(lambda i: i * 100),
            "due_ms": st.none() | NEAR_CUTOFF | st.integers(CUTOFF_MS - MINUTE, CUTOFF_MS + MINUTE),
            "schedule_problem": st.none() | st.sampled_from([TORN_TAIL, CORRUPT, FORMAT]),
            "dispatches": COUNT,
            "dead_letters": COUNT,
            "withdrawals": COUNT,
            "fate": st.none() | st.sampled_from([kind.value for kind in EntryKind]),
            "lateness": st.none() | LATENESS | st.integers(-1_000, 10_000),
            "first_entry_ms": st.none() | NEAR_CUTOFF,
        }
    ),
    max_size=40,
)


def paired_table(rows: list[dict]) -> pa.Table:
    """PAIRED rows; a problem row has no record columns."""
    columns: dict[str, list] = {field.name: [] for field in PAIRED}
    for row in rows:
        record = row["due_ms"] is not None and row["schedule_problem"] is None
        values = {
            "bucket": row["bucket"] * US_PER_MS,
            "offset": row["offset"],
            "message_log_offset": row["offset"] + 7 if record else None,
            "due_ms": row["due_ms"] if record else None,
            "message_id": f"m-{row['offset']}" if record else None,
            "sequence": row["offset"] if record else None,
            "schedule_problem": row["schedule_problem"],
            "schedule_detail": row["schedule_problem"],
            "dispatches": row["dispatches"],
            "dead_letters": row["dead_letters"],
            "withdrawals": row["withdrawals"],
            "fate": row["fate"],
            "dispatched_ms": None,
            "first_entry_ms": row["first_entry_ms"],
        }
        if record and row["lateness"] is not None and row["dispatches"]:
            values["dispatched_ms"] = row["due_ms"] + row["lateness"]
        for name, value in values.items():
            columns[name].append(value)
    return pa.table(columns, schema=PAIRED)


def expected_flags(row: dict, stops: dict[int, int], damaged: set[int]) -> dict[str, bool]:
    """docs/audit.md's definitions, one row at a time."""
    dispatches = row["dispatches"] or 0
    dead_letters = row["dead_letters"] or 0
    fate = row["fate"]
    withdrawn = fate in (EntryKind.CANCELLED, EntryKind.RESCHEDULED, EntryKind.NOT_MOVED)
    due_ms = row["due_ms"]
    scheduled = due_ms is not None
    handled = fate is not None
    undone = scheduled and not handled and due_ms < CUTOFF_MS
    lateness = None
    if scheduled and not withdrawn and row["dispatched_ms"] is not None:
        lateness = row["dispatched_ms"] - due_ms
    stop = stops.get(row["bucket"])
    unread = stop is not None and row["offset"] >= stop
    first_before = row["first_entry_ms"] is not None and row["first_entry_ms"] < CUTOFF_MS
    delivered_first = fate in (EntryKind.DISPATCHED, EntryKind.DEAD_LETTERED)
    return {
        "scheduled": scheduled,
        "dispatched": dispatches > 0 and not withdrawn,
        "dead_lettered": dead_letters > 0 and not withdrawn,
        "cancelled": fate == EntryKind.CANCELLED,
        "rescheduled": fate == EntryKind.RESCHEDULED,
        "overdue": undone and row["bucket"] not in damaged,
        "unverified": undone and row["bucket"] in damaged,
        "pending": scheduled and not handled and due_ms >= CUTOFF_MS,
        "early": lateness is not None and lateness < 0,
        "late": lateness is not None and lateness > LATE_MS,
        "duplicate_dispatch": scheduled and dispatches > 1,
        "dispatched_after_cancel": scheduled and withdrawn and dispatches + dead_letters > 0,
        "cancelled_after_dispatch": scheduled and delivered_first and (row["withdrawals"] or 0) > 0,
        "unknown_record": not scheduled
        and row["schedule_problem"] is None
        and not unread
        and first_before,
        "moved": scheduled and fate == EntryKind.RESCHEDULED and first_before,
    }


@EXAMPLES
@given(ROWS, st.sets(st.sampled_from(BUCKETS)))
def test_every_flag_is_what_the_definitions_say(rows, damaged):
    paired = paired_table(rows)
    problems = pa.table(
        {
            "bucket": pa.array(
                [b * US_PER_MS for b in sorted(damaged)], PAIRED.field("bucket").type
            ),
            "position": pa.array([0] * len(damaged), pa.int64()),
            "problem": pa.array([CORRUPT] * len(damaged)),
            "detail": pa.array(["bad"] * len(damaged)),
        },
        schema=DISPATCH_PROBLEMS,
    )

    judged = judge(paired, problems, CUTOFF_MS, LATE_MS).to_pylist()

    stops: dict[int, int] = {}
    for row in paired.to_pylist():
        if row["schedule_problem"] in (TORN_TAIL, CORRUPT):
            bucket = int(row["bucket"].timestamp() * 1000)
            stops[bucket] = min(stops.get(bucket, row["offset"]), row["offset"])
    for row, got in zip(paired.to_pylist(), judged, strict=True):
        row["bucket"] = int(row["bucket"].timestamp() * 1000)
        assert {flag: got[flag] for flag in FLAGS} == expected_flags(row, stops, damaged), row
        assert got["dispatches"] == (row["dispatches"] or 0)


def nearest_rank(values: list[int], percent: int) -> int:
    """The smallest value with at least ceil(p * n) of the n values at or below it."""
    ordered = sorted(values)
    return ordered[math.ceil(percent / 100 * len(ordered)) - 1]


@EXAMPLES
@given(
    st.lists(
        st.lists(st.integers(-50, 10**6), min_size=1, max_size=150, unique=True),
        min_size=1,
        max_size=3,
    ),
    st.integers(1, 5),
)
def test_bucket_percentiles_are_exact_and_histograms_add_up(per_bucket, runs):
    lateness = [(BUCKETS[b], ms) for b, values in enumerate(per_bucket) for ms in values]
    judged = pa.table(
        {
            "bucket": pa.array([b * US_PER_MS for b, _ in lateness], PAIRED.field("bucket").type),
            "lateness_ms": pa.array([ms for _, ms in lateness], pa.int64()),
            "dispatches": pa.array([1] * len(lateness), pa.int64()),
            **{name: [name in ("scheduled", "dispatched")] * len(lateness) for name in FLAGS},
        }
    )

    counts = counting.bucket_counts(judged, judged["bucket"]).to_pylist()

    assert len(counts) == len(per_bucket)
    for row, mine in zip(counts, per_bucket, strict=True):
        assert row["dispatched"] == len(mine)
        assert row["lateness_p50_ms"] == nearest_rank(mine, 50)
        assert row["lateness_p99_ms"] == nearest_rank(mine, 99)
        assert row["lateness_max_ms"] == max(mine)
    # Histograms of any split into runs add up to the percentiles of all.
    cut = sorted(random.Random(runs).sample(range(len(lateness) + 1), min(runs, len(lateness) + 1)))
    pieces = [judged.slice(a, b - a) for a, b in zip([0, *cut], [*cut, len(lateness)], strict=True)]
    pairs = [
        (row["lateness_ms"], row["records"])
        for piece in pieces
        for row in counting.histogram(piece).to_pylist()
    ]
    everything = [ms for _, ms in lateness]
    assert counting.percentiles(pairs) == {
        "lateness_p50_ms": nearest_rank(everything, 50),
        "lateness_p99_ms": nearest_rank(everything, 99),
        "lateness_max_ms": max(everything),
    }


def test_nearest_rank_at_every_bucket_size():
    """Bucket i holds the lateness values 0..i-1 in a shuffled order: its p50 and p99
    are the ranks ceil(p * i), whatever i is; and so are those of its histogram."""
    rng = random.Random(7)
    rows = []
    for size in range(1, 201):
        values = list(range(size))
        rng.shuffle(values)
        rows += [(T0 + size * MINUTE, ms) for ms in values]
    judged = pa.table(
        {
            "bucket": pa.array([b * US_PER_MS for b, _ in rows], PAIRED.field("bucket").type),
            "lateness_ms": pa.array([ms for _, ms in rows], pa.int64()),
            "dispatches": pa.array([1] * len(rows), pa.int64()),
            **{name: [name in ("scheduled", "dispatched")] * len(rows) for name in FLAGS},
        }
    )

    counts = counting.bucket_counts(judged, judged["bucket"]).to_pylist()

    expected = [(math.ceil(size / 2) - 1, math.ceil(0.99 * size) - 1) for size in range(1, 201)]
    assert [(r["lateness_p50_ms"], r["lateness_p99_ms"]) for r in counts] == expected
    merged = [counting.percentiles((ms, 1) for ms in range(size)) for size in range(1, 201)]
    assert [(p["lateness_p50_ms"], p["lateness_p99_ms"]) for p in merged] == expected


@EXAMPLES
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),  # server
            st.integers(0, 12),  # which id
            st.integers(0, 2),  # DISPATCHED entries
            st.sampled_from(BUCKETS),
            st.integers(0, 1),  # which send of the id (its sequence)
            st.none() | st.sampled_from([kind.value for kind in EntryKind]),  # fate
        ),
        max_size=80,
    ),
    st.integers(1, 4),
)
def test_hash_ranges_find_every_repeated_id_and_every_lost_copy(records, tasks):
    """However the records are spread over tasks, the ranges find exactly the ids
    dispatched more than once (with the buckets that hold them), the ids of one server
    sent more than once or cancelled and delivered (with the buckets of their records
    there), and the moved records with no record of their id behind them (with their
    buckets)."""
    id_hash = id_ranges.id_hashes(pa.array([f"id-{r[1]}" for r in records], pa.string()))
    rows = [
        (*record, h, offset)
        for offset, (record, h) in enumerate(zip(records, id_hash.to_pylist(), strict=True))
    ]  # server, id, dispatches, bucket, send, fate, hash, message_log offset
    moved = [r[0] == "a" and r[5] == EntryKind.RESCHEDULED.value for r in rows]
    blobs: list[tuple[int, str, bytes]] = []
    for task in range(tasks):
        for server in ("a", "b"):
            mine = [r for n, r in enumerate(rows) if n % tasks == task and r[0] == server]
            part = id_ranges.part(
                pa.array([r[6] for r in mine], pa.int64()),
                pa.array([r[2] for r in mine], pa.int64()),
                pa.array([r[3] * US_PER_MS for r in mine], PAIRED.field("bucket").type),
                pa.array([r[7] for r in mine], pa.int64()),
                pa.array([1000 * r[1] + r[4] for r in mine], pa.int64()),
                pa.array([r[5] for r in mine], pa.int8()),
                pa.array([moved[r[7]] for r in mine], pa.bool_()),
            )
            blobs += [(range_, server, blob) for range_, blob in id_ranges.blobs([part])]

    found = set()
    for range_ in {range_ for range_, _, _ in blobs}:
        mine = [(server, blob) for r, server, blob in blobs if r == range_]
        found |= set(id_ranges.merge(mine))

    dispatches: dict[int, int] = {}
    for r in rows:
        dispatches[r[6]] = dispatches.get(r[6], 0) + r[2]
    expected = {
        (id_ranges.CANDIDATE, r[0], r[6], r[3]) for r in rows if r[2] and dispatches[r[6]] > 1
    }
    delivered = (EntryKind.DISPATCHED.value, EntryKind.DEAD_LETTERED.value)
    for server, h in {(r[0], r[6]) for r in rows}:
        same = [r for r in rows if (r[0], r[6]) == (server, h)]
        sent_twice = len({r[4] for r in same}) > 1
        cancelled = any(r[5] == EntryKind.CANCELLED.value for r in same)
        if sent_twice or (cancelled and any(r[5] in delivered for r in same)):
            expected |= {(id_ranges.SAME_ID, server, h, r[3]) for r in same}
    for r in rows:
        behind = [o[7] for o in rows if (o[0], o[6]) == (r[0], r[6]) and o[7] > r[7]]
        if moved[r[7]] and not behind:
            expected.add((id_ranges.LOST, r[0], r[6], r[3]))
    assert found == expected


def shown(server: str, message_id: str, mlo: int, sequence: int, fate: EntryKind | None) -> dict:
    """A record as reconcile.SHOWN has it (its place and times derived from ``mlo``)."""
    return {
        "server": server,
        "bucket": T0 * US_PER_MS,
        "offset": mlo * 10,
        "message_log_offset": mlo,
        "message_id": message_id,
        "id_hash": 7,  # one hash for every id: the ids decide, never the hash
        "due_ms": T0 + mlo,
        "dispatched_ms": T0 + mlo + 1 if fate is EntryKind.DISPATCHED else None,
        "dispatches": int(fate is EntryKind.DISPATCHED),
        "lateness_ms": None,
        "sequence": sequence,
        "fate": None if fate is None else fate.value,
    }


def test_id_checks_count_sends_by_sequence_and_cancels_by_fate():
    moved, cancelled = EntryKind.RESCHEDULED, EntryKind.CANCELLED
    records = [
        # Sent, moved (its copy keeps sequence 1), then sent again and again.
        shown("a", "x", 10, 1, moved),
        shown("a", "x", 50, 1, EntryKind.DISPATCHED),
        shown("a", "x", 30, 2, cancelled),
        shown("a", "x", 70, 3, None),
        # Moved twice, then cancelled: one send, nothing delivered.
        shown("a", "y", 11, 4, moved),
        shown("a", "y", 40, 4, moved),
        shown("a", "y", 60, 4, cancelled),
        # The same id on another server is another message; dead-lettered is delivered.
        shown("b", "y", 12, 1, EntryKind.DEAD_LETTERED),
        shown("b", "z", 13, 2, cancelled),
        shown("b", "z", 13, 2, EntryKind.DISPATCHED),  # a copy appended twice, one send
    ]
    table = pa.Table.from_pylist(records, schema=SHOWN_SCHEMA)

    found = id_checks.findings(table).to_pylist()

    assert [(r["kind"], r["server"], r["message_id"], r["message_log_offset"]) for r in found] == [
        ("cancelled_id_delivered", "a", "x", 50),
        ("cancelled_id_delivered", "b", "z", 13),
        ("duplicate_send", "a", "x", 30),
        ("duplicate_send", "a", "x", 70),
    ]
    assert found[2]["detail"] == (
        "id sent 3 times: message_log offset 10 (sequence 1, due 2026-11-22 10:00:00.010), "
        "message_log offset 30 (sequence 2, due 2026-11-22 10:00:00.030), "
        "message_log offset 70 (sequence 3, due 2026-11-22 10:00:00.070)"
    )
    assert found[0]["detail"] == (
        "delivered, but a cancel of its id was answered CANCELLED: the record at "
        "message_log offset 30 (due 2026-11-22 10:00:00.030) is cancelled"
    )
    assert {r["severity"] for r in found} == {ERROR}
