"""The audit on a real local SparkSession: planted faults in data written by the
project's own log writers are found exactly — no fewer, no more — and reported in the
Parquet tables, the console, the HTML page and the exit status."""

from __future__ import annotations

import os

import pytest

from delayd.audit import job
from delayd.audit.config import AuditConfig, Server
from delayd.audit.result import ERROR, NOTICE
from delayd.audit.schemas import DISPATCH_LOG, SCHEDULE_LOG
from delayd.audit.sources import spark_schema
from delayd.cli import main
from delayd.logs.dispatch_log import FRAMED_SIZE, EntryKind, encode_entry
from storage.framing import encode_record
from tests.audit_support import (
    MINUTE,
    T0,
    DelayData,
    Scheduled,
    append_bytes,
    dispatch_path,
    flip_byte,
    read_table,
    schedule_path,
    spark_session,  # noqa: F401 - the shared session fixture
)

AS_OF = T0 + 60 * MINUTE  # 11:00; grace 60 s, so due before 10:59 is judged
AS_OF_TEXT = "2026-11-22T11:00:00Z"


@pytest.fixture(scope="module")
def spark(spark_session):  # noqa: F811 - the fixture imported above
    return spark_session


def findings(out: str) -> set[tuple]:
    return {
        (row["kind"], row["severity"], row["server"], row["message_id"])
        for row in read_table(out, "discrepancies")
    }


def totals(out: str) -> dict:
    (overall,) = [r for r in read_table(out, "summary") if r["server"] is None]
    return overall


def test_planted_faults_are_found_exactly(spark, tmp_path, capsys):
    root, out = str(tmp_path / "data"), str(tmp_path / "out")
    with DelayData(root) as data:
        for minute in range(3):  # 15 messages dispatched 0..4 ms after their due time
            for i in range(5):
                record = data.accept(f"ok-{minute}-{i}", T0 + minute * MINUTE + i * 1000)
                data.entry(record, record.due_ms + i)
        missing = data.accept("missing-1", T0 + MINUTE + 10_000)
        corrupt = data.accept("corrupt-1", T0 + MINUTE + 20_000)
        data.entry(corrupt, corrupt.due_ms + 1)
        after = data.accept("after-corrupt-1", T0 + MINUTE + 30_000)  # unreadable too
        data.entry(after, after.due_ms + 1)
        double = data.accept("double-1", T0 + 20_000)
        data.entry(double, double.due_ms + 5)
        data.entry(double, double.due_ms + 2_000)
        late = data.accept("late-1", T0 + 2 * MINUTE)
        data.entry(late, late.due_ms + 30_000)
        # Handled or not yet due: never overdue.
        dead = data.accept("dead-1", T0 + 2 * MINUTE + 1)
        data.entry(dead, dead.due_ms + 100, EntryKind.DEAD_LETTERED)
        cancelled = data.accept("cancelled-1", T0 + 2 * MINUTE + 2)
        data.entry(cancelled, T0, EntryKind.CANCELLED)
        data.accept("pending-1", AS_OF - 30_000)  # due after as_of - grace
        data.complete(T0)
    flip_byte(schedule_path(root, corrupt.bucket_ms), corrupt.offset + 30)

    status = main(["audit", "--data", f"s1={root}", "--out", out, "--as-of", AS_OF_TEXT])

    assert status == 1
    assert findings(out) == {
        ("overdue", ERROR, "s1", "missing-1"),
        ("duplicate_dispatch", ERROR, "s1", "double-1"),
        ("late", ERROR, "s1", "late-1"),
        ("dead_lettered", NOTICE, "s1", "dead-1"),
    }
    (overdue,) = [r for r in read_table(out, "discrepancies") if r["kind"] == "overdue"]
    assert (overdue["offset"], overdue["due_ms"]) == (missing.offset, missing.due_ms)
    assert [
        (r["server"], r["log"], r["file"], r["position"], r["problem"], r["severity"])
        for r in read_table(out, "corrupt_records")
    ] == [("s1", "schedule_log", corrupt.bucket, corrupt.offset, "corrupt", ERROR)]
    overall = totals(out)
    assert {k: overall[k] for k in COUNTS} == {
        "scheduled": 21,  # 23 accepted, 2 unreadable past the corrupt record
        "dispatched": 17,
        "dispatch_entries": 20,  # the unreadable records' entries are there too
        "duplicate_dispatch": 1,
        "duplicate_by_id": 1,
        "dead_lettered": 1,
        "cancelled": 1,
        "pending": 1,
        "overdue": 1,
        "unverified": 0,
        "early": 0,
        "late": 1,
        "unknown_record": 0,
        "message_log_records": 23,
        "not_scheduled": 0,
        "scheduled_twice": 0,
        "message_unverified": 2,  # in message_log; their bucket's file stopped early
    }
    # Lateness of the 17 dispatched records: 0..4 ms three times each, 5 and 30000 ms;
    # nearest rank: p50 is the 9th smallest, p99 the 17th.
    assert (overall["lateness_p50_ms"], overall["lateness_p99_ms"]) == (2, 30_000)
    assert overall["lateness_max_ms"] == 30_000
    per_bucket = {
        r["bucket"].strftime("%H:%M"): r for r in read_table(out, "summary") if r["bucket"]
    }
    assert {b: r["scheduled"] for b, r in per_bucket.items()} == {
        "10:00": 6,
        "10:01": 6,
        "10:02": 8,
        "10:59": 1,
    }
    assert per_bucket["10:02"]["lateness_p99_ms"] == 30_000

    printed = capsys.readouterr().out
    assert "RESULT: 4 discrepancies" in printed
    assert "missing-1" in printed and "crc mismatch" in printed
    with open(os.path.join(out, "report.html"), encoding="utf-8") as page:
        html = page.read()
    assert "<svg" in html and "missing-1" in html and "202611221001" in html
    assert "http" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")


COUNTS = (
    "scheduled",
    "dispatched",
    "dispatch_entries",
    "duplicate_dispatch",
    "duplicate_by_id",
    "dead_lettered",
    "cancelled",
    "pending",
    "overdue",
    "unverified",
    "early",
    "late",
    "unknown_record",
    "message_log_records",
    "not_scheduled",
    "scheduled_twice",
    "message_unverified",
)


def test_several_servers_message_log_ids_and_torn_tails(spark, tmp_path):
    a_root, b_root, out = (str(tmp_path / name) for name in ("a", "b", "out"))
    with DelayData(a_root) as a:
        first = a.accept("a-first", T0 + 1_000)
        a.entry(first, first.due_ms + 3)
        retry = a.accept("retry-1", T0 + 2_000)
        a.entry(retry, retry.due_ms + 3)
        early = a.accept("early-1", T0 + 3_000)
        a.entry(early, early.due_ms - 500)
        a.entry(Scheduled("?", 0, T0, 99_999, 0), T0 + 10)  # no record at that offset
        a.entry(Scheduled("?", 0, T0, 88_888, 0), AS_OF - 10_000)  # too recent to judge
        a.accept("lost-1", T0 + 4_000, copies=0)  # in message_log, never in schedule_log
        a.accept("fresh-1", AS_OF + 10 * MINUTE, copies=0)  # received after the cutoff
        a.accept("twice-1", AS_OF + 5 * MINUTE, copies=2)  # pending, but in it twice
    with DelayData(b_root) as b:
        b_first = b.accept("b-first", T0 + 1_000)  # same bucket and offset as a-first
        assert (b_first.bucket_ms, b_first.offset) == (first.bucket_ms, first.offset)
        retry_b = b.accept("retry-1", T0 + 2_000)  # a producer retry to another server
        b.entry(retry_b, retry_b.due_ms + 7)
        torn_ok = b.accept("torn-ok", T0 + 2 * MINUTE)
        b.entry(torn_ok, torn_ok.due_ms + 1)
        b.accept("torn-1", T0 + 2 * MINUTE + 1)  # its entry may be the torn one
    torn_file = dispatch_path(b_root, torn_ok.bucket_ms)
    append_bytes(torn_file, encode_record(encode_entry(1, 2, b"x"), EntryKind.DISPATCHED)[:30])

    config = AuditConfig(
        servers=(Server("a", a_root), Server("b", b_root)), out=out, as_of_ms=AS_OF
    )
    result = job.run(spark, config)

    assert findings(out) == {
        ("early", ERROR, "a", "early-1"),
        ("unknown_record", ERROR, "a", None),
        ("not_scheduled", ERROR, "a", "lost-1"),
        ("scheduled_twice", ERROR, "a", "twice-1"),
        ("duplicate_id", ERROR, "a", "retry-1"),
        ("duplicate_id", ERROR, "b", "retry-1"),
        ("overdue", ERROR, "b", "b-first"),
    }
    assert [
        (r["server"], r["file"], r["position"], r["problem"], r["severity"])
        for r in read_table(out, "corrupt_records")
    ] == [("b", "202611221002", FRAMED_SIZE, "torn_tail", NOTICE)]
    (unknown,) = [r for r in read_table(out, "discrepancies") if r["kind"] == "unknown_record"]
    assert unknown["offset"] == 99_999
    servers = {r["server"]: r for r in read_table(out, "summary") if r["bucket"] is None}
    assert servers["b"]["unverified"] == 1 and servers["a"]["unverified"] == 0
    assert servers["b"]["overdue"] == 1 and servers["a"]["overdue"] == 0
    assert servers["a"]["message_log_records"] == 6
    assert servers[None]["duplicate_by_id"] == 1  # one id, dispatched at two records
    assert result.errors == 7 and not result.clean
    assert {kind for kind, _ in result.counts} == {
        "early",
        "unknown_record",
        "not_scheduled",
        "scheduled_twice",
        "duplicate_id",
        "overdue",
    }


def test_the_formats_read_as_spark_tables(spark, tmp_path):
    root = str(tmp_path)
    with DelayData(root) as data:
        for minute in range(4):
            for i in range(3):
                record = data.accept(f"m-{minute}-{i}", T0 + minute * MINUTE + i)
                data.entry(record, record.due_ms + 1, group="eu-west")

    schedule = spark.read.format("delayd.schedule_log").load(root)
    dispatch = (
        spark.read.format("delayd.dispatch_log")
        .option("server", "eu-1")
        .option("partitionBytes", "0")
        .load(root)
    )

    assert schedule.schema == spark_schema(SCHEDULE_LOG)
    assert dispatch.schema == spark_schema(DISPATCH_LOG)
    assert dispatch.rdd.getNumPartitions() == 4  # one per bucket file
    assert schedule.rdd.getNumPartitions() == 1  # small files packed together
    dispatch.createOrReplaceTempView("dispatch")
    rows = spark.sql(
        "SELECT server, `group`, kind, count(*) AS n FROM dispatch GROUP BY 1, 2, 3"
    ).collect()
    assert [tuple(r) for r in rows] == [("eu-1", "eu-west", "dispatched", 12)]
    joined = schedule.join(dispatch.drop("server", "file"), ["bucket", "offset"])
    assert joined.where("at_ms = due_ms + 1").count() == 12

    narrow = (
        spark.read.format("delayd.schedule_log")
        .schema("offset long, message_id string, problem string")
        .option("files", "202611221001,202611221003")
        .load(root)
    )
    assert sorted(r["message_id"] for r in narrow.collect()) == [
        f"m-{minute}-{i}" for minute in (1, 3) for i in range(3)
    ]
    with pytest.raises(Exception, match="must keep the problem column"):
        spark.read.format("delayd.schedule_log").schema("offset long").load(root).collect()
