"""The audit on a real local SparkSession: planted faults in data written by the
project's own log writers are found exactly — no fewer, no more — and reported in the
Parquet tables, the console, the HTML page and the exit status; and a data directory
written by a real `delayd serve` audits clean.

Every test that needs Spark is in this module, so that one JVM serves them all (pytest
-n 2 --dist loadfile runs each module in one worker)."""

from __future__ import annotations

import os
import shutil
import time

import pytest

import delayd
from delayd.audit.config import AuditConfig, Server
from delayd.audit.read.dispatch import dispatch_batches
from delayd.audit.report.result import ERROR, NOTICE
from delayd.audit.schemas import DISPATCH_LOG, SCHEDULE_LOG
from delayd.audit.spark import job, queries
from delayd.audit.spark.sources import ReconciledSource, spark_schema
from delayd.cli.main import main
from delayd.cluster.members import MemberInfo
from delayd.logs import layout, log_files
from delayd.logs.dispatch_log import FRAMED_SIZE, EntryKind, encode_entry
from delayd.protocol.codes import CancelOutcome, RescheduleOutcome
from storage.framing import encode_record
from tests.audit_support import (
    MINUTE,
    T0,
    DelayData,
    Scheduled,
    cancels_and_moves_done_right,
    dispatch_path,
    group_copy,
    read_table,
    schedule_path,
    sends_and_cancels,
)
from tests.damage_support import append_bytes, flip_byte
from tests.intake_support import ServeProcess
from tests.test_audit_groups import register

AS_OF = T0 + 60 * MINUTE  # 11:00; grace 60 s, so due before 10:59 is judged
AS_OF_TEXT = "2026-11-22T11:00:00Z"
MESSAGES = 30  # sent to the real server
DELIVERY_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def spark(spark_session):
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
        cancelled = data.accept("cancelled-1", T0 + 2 * MINUTE + 2)  # due long ago
        data.cancel(cancelled, T0)
        data.entry(cancelled, T0 + 5, EntryKind.CANCELLED)  # a replayed cancel: harmless
        data.accept("pending-1", AS_OF - 30_000)  # due after as_of - grace
        # Moved once, and twice (each copy in a later bucket); the last copy dispatched.
        moved = data.accept("moved-1", T0 + 30_000)
        copy = data.reschedule(moved, T0 + 3 * MINUTE, at_ms=T0)
        data.entry(copy, copy.due_ms + 3)
        moved_twice = data.accept("moved-2", T0 + 2 * MINUTE + 30_000)
        first_copy = data.reschedule(moved_twice, T0 + 3 * MINUTE + 10_000, at_ms=T0)
        second_copy = data.reschedule(first_copy, T0 + 4 * MINUTE, at_ms=T0 + 1)
        data.entry(second_copy, second_copy.due_ms + 1)
        # Cancelled, then sent all the same, 10 minutes late: a finding, not lateness.
        cancelled_sent = data.accept("cancelled-sent-1", T0 + 2 * MINUTE + 40_000)
        data.cancel(cancelled_sent, T0)
        data.entry(cancelled_sent, cancelled_sent.due_ms + 10 * MINUTE)
        # Moved, its copy not found — but reading schedule_log stopped early (the
        # corrupt record): the copy may be there, so it is unverified, not a finding.
        data.reschedule(data.accept("moved-lost-1", T0 + 2 * MINUTE + 50_000), AS_OF, T0, copies=0)
        data.complete(T0)
    flip_byte(schedule_path(root, corrupt.bucket_ms), corrupt.offset + 30)

    status = main(["audit", "--data", f"s1={root}", "--out", out, "--as-of", AS_OF_TEXT])

    assert status == 1
    assert findings(out) == {
        ("overdue", ERROR, "s1", "missing-1"),
        ("duplicate_dispatch", ERROR, "s1", "double-1"),
        ("late", ERROR, "s1", "late-1"),
        ("dead_lettered", NOTICE, "s1", "dead-1"),
        ("dispatched_after_cancel", ERROR, "s1", "cancelled-sent-1"),
    }
    (overdue,) = [r for r in read_table(out, "discrepancies") if r["kind"] == "overdue"]
    assert (overdue["offset"], overdue["due_ms"]) == (missing.offset, missing.due_ms)
    assert [
        (r["server"], r["log"], r["file"], r["position"], r["problem"], r["severity"])
        for r in read_table(out, "corrupt_records")
    ] == [("s1", "schedule_log", corrupt.bucket, corrupt.offset, "corrupt", ERROR)]
    overall = totals(out)
    expected = {
        # 27 accepted, 2 unreadable past the corrupt record; 3 copies (moved-1 once,
        # moved-2 twice)
        "scheduled": 28,
        "dispatched": 19,  # not cancelled-sent-1
        "dispatch_entries": 23,  # the unreadable records' entries are there too
        "duplicate_dispatch": 1,
        "duplicate_by_id": 1,
        "dead_lettered": 1,
        "cancelled": 2,  # cancelled-1 (its second entry counts once), cancelled-sent-1
        "rescheduled": 4,  # moved-1, moved-2 and its first copy, moved-lost-1
        "pending": 1,
        "overdue": 1,
        "unverified": 1,  # moved-lost-1's copy
        "early": 0,
        "late": 1,
        "unknown_record": 0,
        "dispatched_after_cancel": 1,
        "cancelled_after_dispatch": 0,
        "copy_missing": 0,
        "message_log_records": 27,
        "message_log_cancels": 2,
        "message_log_reschedules": 4,
        "not_scheduled": 0,
        "scheduled_twice": 0,
        "message_unverified": 2,  # in message_log; their bucket's file stopped early
    }
    assert {k: overall[k] for k in expected} == expected
    # Lateness of the 19 dispatched records: 0..4 ms three times each, 1, 3, 5 and
    # 30000 ms (cancelled-sent-1's 10 minutes are not lateness); nearest rank: p50 is
    # the 10th smallest, p99 the 19th.
    assert (overall["lateness_p50_ms"], overall["lateness_p99_ms"]) == (2, 30_000)
    assert overall["lateness_max_ms"] == 30_000
    per_bucket = {
        r["bucket"].strftime("%H:%M"): r for r in read_table(out, "summary") if r["bucket"]
    }
    assert {b: r["scheduled"] for b, r in per_bucket.items()} == {
        "10:00": 7,
        "10:01": 6,
        "10:02": 11,
        "10:03": 2,
        "10:04": 1,
        "10:59": 1,
    }
    assert per_bucket["10:02"]["lateness_p99_ms"] == 30_000
    assert {b: (r["cancelled"], r["rescheduled"]) for b, r in per_bucket.items()} == {
        "10:00": (0, 1),
        "10:01": (0, 0),
        "10:02": (2, 2),
        "10:03": (0, 1),
        "10:04": (0, 0),
        "10:59": (0, 0),
    }
    assert (per_bucket["10:03"]["dispatched"], per_bucket["10:04"]["dispatched"]) == (1, 1)

    printed = capsys.readouterr().out
    assert "RESULT: 5 discrepancies" in printed
    assert "missing-1" in printed and "crc mismatch" in printed
    with open(os.path.join(out, "report.html"), encoding="utf-8") as page:
        html = page.read()
    assert "<svg" in html and "missing-1" in html and "202611221001" in html
    assert "http" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")


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
        # Reschedules and cancels that went wrong, and some that did nothing.
        a.reschedule(a.accept("moved-lost-a", T0 + 5_000), AS_OF, T0, copies=0)
        sent_cancelled = a.accept("sent-cancelled-a", T0 + 6_000)
        a.entry(sent_cancelled, sent_cancelled.due_ms + 2)
        a.cancel(sent_cancelled, sent_cancelled.due_ms + 10)  # the server answers
        # ALREADY_DELIVERED and writes nothing: this entry must not be there
        moved_fresh = a.accept("moved-fresh-a", AS_OF + 20 * MINUTE)
        a.reschedule(moved_fresh, AS_OF + 30 * MINUTE, AS_OF - 10_000, copies=0)  # too recent
        moved_twice = a.accept("moved-twice-a", AS_OF + 5 * MINUTE)
        a.reschedule(moved_twice, AS_OF + 6 * MINUTE, T0, copies=2)  # a copy appended twice
        a.tombstone("a-first", T0 + 20_000, AS_OF)  # already delivered: nothing to move
        a.tombstone("never-sent", T0)  # a cancel of an unknown id: nothing to write
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
        ("copy_missing", ERROR, "a", "moved-lost-a"),
        ("cancelled_after_dispatch", ERROR, "a", "sent-cancelled-a"),
        ("scheduled_twice", ERROR, "a", "moved-twice-a"),
    }
    (twice,) = [r for r in read_table(out, "discrepancies") if r["message_id"] == "moved-twice-a"]
    assert twice["detail"] == "reschedule in schedule_log 2 times"
    assert [
        (r["server"], r["file"], r["position"], r["problem"], r["severity"])
        for r in read_table(out, "corrupt_records")
    ] == [("b", "202611221002", FRAMED_SIZE, "torn_tail", NOTICE)]
    (unknown,) = [r for r in read_table(out, "discrepancies") if r["kind"] == "unknown_record"]
    assert unknown["offset"] == 99_999
    servers = {r["server"]: r for r in read_table(out, "summary") if r["bucket"] is None}
    assert servers["b"]["unverified"] == 1 and servers["a"]["unverified"] == 0
    assert servers["b"]["overdue"] == 1 and servers["a"]["overdue"] == 0
    assert servers["a"]["message_log_records"] == 10
    assert (servers["a"]["message_log_cancels"], servers["a"]["message_log_reschedules"]) == (2, 4)
    assert (servers["a"]["rescheduled"], servers["a"]["cancelled"]) == (3, 0)
    assert servers[None]["duplicate_by_id"] == 1  # one id, dispatched at two records
    assert result.errors == 10 and not result.clean
    assert {kind for kind, _ in result.counts} == {
        "early",
        "unknown_record",
        "not_scheduled",
        "scheduled_twice",
        "duplicate_id",
        "overdue",
        "copy_missing",
        "cancelled_after_dispatch",
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


@pytest.fixture
def server(procs, tmp_path):
    return procs.add(ServeProcess(tmp_path / "data"))


def dispatched_entries(data_dir: str) -> int:
    """DISPATCHED entries in the data directory's dispatch_log, read as the audit reads."""
    return sum(
        batch.column("kind").to_pylist().count("dispatched")
        for log_file in log_files.list_files(data_dir, log_files.DISPATCH_LOG)
        for batch in dispatch_batches(log_file, "probe")
    )


@pytest.mark.slow
def test_a_served_data_directory_audits_clean(spark, server, tmp_path, capsys):
    data_dir, out = str(tmp_path / "data"), str(tmp_path / "out")
    server.start()
    host, port = server.address
    with delayd.Producer(f"{host}:{port}") as producer:
        for i in range(MESSAGES):
            producer.send(
                "orders.timeout",
                f"order {i}".encode(),
                delay_ms=300 + 40 * i,  # due over ~1.5 s, several per bucket
                key=f"order-{i}" if i % 2 else None,
            )
        paid = producer.send("orders.timeout", b"paid", delay_ms=120_000).message_id
        extended = producer.send("auction.end", b"extended", delay_ms=120_000).message_id
        assert producer.cancel(paid).outcome is CancelOutcome.CANCELLED
        moved = producer.reschedule(extended, delay_ms=500)
        assert moved.outcome is RescheduleOutcome.RESCHEDULED
    deadline = time.monotonic() + DELIVERY_TIMEOUT_S
    while dispatched_entries(data_dir) < MESSAGES + 1:  # and the moved one
        assert time.monotonic() < deadline, f"not delivered in time:\n{server.log_tail()}"
        time.sleep(0.2)
    assert server.stop() == 0

    # No grace: everything written before now is judged (the server has stopped), the
    # reschedule's copy too.
    status = main(["audit", "--data", data_dir, "--out", out, "--grace", "0s"])

    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "RESULT: clean" in printed
    assert read_table(out, "discrepancies") == []
    assert read_table(out, "corrupt_records") == []
    (overall,) = [r for r in read_table(out, "summary") if r["server"] is None]
    # Records: the messages, the cancelled one, the moved one and its copy.
    assert overall["scheduled"] == MESSAGES + 3
    assert overall["dispatched"] == overall["dispatch_entries"] == MESSAGES + 1
    assert (overall["cancelled"], overall["rescheduled"]) == (1, 1)
    assert overall["message_log_records"] == MESSAGES + 2
    assert (overall["message_log_cancels"], overall["message_log_reschedules"]) == (1, 1)
    for count in (
        "overdue",
        "pending",
        "unverified",
        "not_scheduled",
        "duplicate_by_id",
        "dispatched_after_cancel",
        "cancelled_after_dispatch",
        "copy_missing",
    ):
        assert overall[count] == 0, count
    assert 0 <= overall["lateness_max_ms"] < 5_000


def docs_example() -> list[str]:
    """The lines of the report docs/audit.md shows under "### Example"."""
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "audit.md")
    with open(path, encoding="utf-8") as page:
        text = page.read()
    example = text[text.index("### Example") :]
    block = example[example.index("```text\n") + len("```text\n") :]
    return block[: block.index("```")].rstrip("\n").splitlines()


def placed(out: str) -> set[tuple]:
    return {
        (r["kind"], r["message_id"], r["bucket"].strftime("%H:%M"), r["offset"])
        for r in read_table(out, "discrepancies")
    }


def test_ids_sent_twice_and_cancelled_ids_delivered_are_found(spark, tmp_path, capsys):
    root, out = str(tmp_path / "data"), str(tmp_path / "out")
    with DelayData(root) as data:
        kept = sends_and_cancels(data, AS_OF)

    status = main(["audit", "--data", f"s1={root}", "--out", out, "--as-of", AS_OF_TEXT])

    assert status == 1
    # A later send is found at its record; so is a delivered record of a cancelled id.
    expected = {
        ("duplicate_send", "twice-1", "11:20", kept["twice-again"].offset),
        ("duplicate_send", "cancel-lost-1", "10:01", kept["lost-newer"].offset),
        ("duplicate_send", "sent-before-1", "10:02", kept["early-newer"].offset),
        ("cancelled_id_delivered", "cancel-lost-1", "10:00", kept["lost"].offset),
        ("cancelled_id_delivered", "sent-before-1", "10:00", kept["early"].offset),
    }
    assert placed(out) == expected
    rows = {(r["kind"], r["message_id"]): r for r in read_table(out, "discrepancies")}
    twice, first = rows[("duplicate_send", "twice-1")], kept["twice"]
    assert (twice["severity"], twice["server"]) == (ERROR, "s1")
    assert (twice["message_log_offset"], twice["due_ms"]) == (
        kept["twice-again"].message_log_offset,
        kept["twice-again"].due_ms,
    )
    assert twice["detail"] == (
        f"id sent 2 times: message_log offset {first.message_log_offset} (sequence 1, due "
        f"2026-11-22 11:10:00.000), message_log offset {twice['message_log_offset']} "
        "(sequence 2, due 2026-11-22 11:20:00.000)"
    )
    delivered, lost = rows[("cancelled_id_delivered", "cancel-lost-1")], kept["lost"]
    assert (delivered["message_log_offset"], delivered["dispatched_ms"]) == (
        lost.message_log_offset,
        lost.due_ms + 2,
    )
    assert delivered["detail"] == (
        "delivered, but a cancel of its id was answered CANCELLED: the record at "
        f"message_log offset {kept['lost-newer'].message_log_offset} (due 2026-11-22 "
        "10:01:05.000) is cancelled"
    )
    overall = totals(out)
    counts = {
        "duplicate_send": 3,
        "cancelled_id_delivered": 2,
        "scheduled_twice": 0,
        "not_scheduled": 0,
        "dispatched_after_cancel": 0,
        "cancelled_after_dispatch": 0,
        "duplicate_by_id": 0,
        "copy_missing": 0,
        "cancelled": 4,
        "rescheduled": 2,
        "message_log_records": 10,
        "message_log_cancels": 5,
    }
    assert {k: overall[k] for k in counts} == counts
    per_bucket = {
        r["bucket"].strftime("%H:%M"): (r["duplicate_send"], r["cancelled_id_delivered"])
        for r in read_table(out, "summary")
        if r["bucket"]
    }
    assert per_bucket["10:00"] == (0, 2) and per_bucket["11:20"] == (1, 0)
    printed = capsys.readouterr().out
    assert "findings: cancelled_id_delivered 2, duplicate_send 3" in printed
    assert "RESULT: 5 discrepancies" in printed
    # docs/audit.md shows this report ("Example"), written to /tmp/audit; all but the
    # headline, which says how long the audit took.
    shown = printed.replace(out, "/tmp/audit").splitlines()
    assert [line.rstrip() for line in shown[1:]] == docs_example()[1:]
    with open(os.path.join(out, "report.html"), encoding="utf-8") as page:
        assert "delivered, but a cancel of its id was answered CANCELLED" in page.read()

    # schedule_log and dispatch_log decide alone: the same after retention removed
    # message_log.
    shutil.rmtree(layout.message_log_dir(root))
    config = AuditConfig(servers=(Server("s1", root),), out=out, as_of_ms=AS_OF)
    result = job.run(spark, config)
    assert placed(out) == expected
    assert (result.errors, result.message_log_checked) == (5, False)


def test_sends_cancels_and_moves_done_right_audit_clean(spark, tmp_path, capsys):
    root, out = str(tmp_path / "data"), str(tmp_path / "out")
    with DelayData(root) as data:
        cancels_and_moves_done_right(data)

    status = main(["audit", "--data", root, "--out", out, "--as-of", AS_OF_TEXT])

    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "RESULT: clean" in printed
    assert read_table(out, "discrepancies") == []
    overall = totals(out)
    assert (overall["duplicate_send"], overall["cancelled_id_delivered"]) == (0, 0)
    assert (overall["cancelled"], overall["rescheduled"]) == (2, 2)
    assert (overall["message_log_records"], overall["message_log_cancels"]) == (4, 3)


def test_groups_from_etcd_are_audited_once_each(spark, tmp_path, capsys, etcd_server, etcd_prefix):
    """Two delay groups of two members each, listed in etcd: each group's logs are read
    from one copy — g1 the leader's (its follower lags), g2, with no leader, the copy
    that holds most — so no message counts twice; g2's planted missing dispatch is
    found, once, and deliveries to either broker group count."""
    copies = {name: str(tmp_path / name) for name in ("g1-a", "g1-b", "g2-a", "g2-b")}
    g1 = group_copy(copies["g1-a"], "g1", 8)
    group_copy(copies["g1-b"], "g1", 5)  # a lagging follower: a prefix of the leader's
    group_copy(copies["g2-a"], "g2", 3, undelivered=frozenset({1}))
    group_copy(copies["g2-b"], "g2", 6, undelivered=frozenset({1}))
    members = {
        name: MemberInfo(name, intake=f"h:{i}", data_dir=path, hostname="h")
        for i, (name, path) in enumerate(copies.items())
    }
    register(etcd_server.url, etcd_prefix, "g1", members["g1-a"], members["g1-b"], leader="g1-a")
    register(etcd_server.url, etcd_prefix, "g2", members["g2-a"], members["g2-b"])
    out = str(tmp_path / "out")
    cluster = ["--etcd", etcd_server.url, "--cluster-prefix", etcd_prefix]

    status = main(["audit", *cluster, "--out", out, "--as-of", AS_OF_TEXT])

    printed = capsys.readouterr().out
    assert status == 1, printed
    assert findings(out) == {("overdue", ERROR, "g2", "g2-1")}
    per_group = {r["server"]: r for r in read_table(out, "summary") if r["bucket"] is None}
    assert (per_group["g1"]["scheduled"], per_group["g1"]["dispatched"]) == (len(g1), len(g1))
    assert (per_group["g2"]["scheduled"], per_group["g2"]["dispatched"]) == (6, 5)
    assert totals(out)["scheduled"] == 14  # not 22: no copy read twice
    assert f"g1: read member g1-a on h (leader): {copies['g1-a']} (the leader's copy" in printed
    assert f"g2: read member g2-b on h: {copies['g2-b']} (the copy that holds most" in printed


def reconciled(spark, root: str, **options: str):
    """delayd.reconciled of ``root`` with ``options`` (the audit's own reader)."""
    reader = spark.read.format("delayd.reconciled").option("cutoffMs", "0").option("lateMs", "0")
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load(root)


def planned_buckets(root: str, **options: str) -> list[list[str]]:
    """The bucket names of each input partition delayd.reconciled plans for ``root``."""
    source = ReconciledSource({"path": root, "cutoffMs": "0", "lateMs": "0", **options})
    reader = source.reader(source.schema())
    return [[bucket.name for bucket in part.files] for part in reader.partitions()]


def test_the_job_partitions_follow_the_bucket_files(spark, tmp_path):
    """What the audit reads is planned as the files lie: a task per bucket — its
    schedule_log and dispatch_log files — with partitionBytes=0; consecutive whole
    buckets packed up to partitionBytes; never a file split or shared by two tasks."""
    root = str(tmp_path / "data")
    records = group_copy(root, "g1", 60)  # ten one-minute buckets
    buckets = sorted({record.bucket for record in records})
    biggest = max(
        os.path.getsize(schedule_path(root, r.bucket_ms))
        + os.path.getsize(dispatch_path(root, r.bucket_ms))
        for r in records
    )

    assert reconciled(spark, root, partitionBytes="0").rdd.getNumPartitions() == 10
    assert planned_buckets(root, partitionBytes="0") == [[bucket] for bucket in buckets]
    packed = planned_buckets(root, partitionBytes=str(3 * biggest))
    assert packed == [buckets[0:3], buckets[3:6], buckets[6:9], buckets[9:]]
    frame = reconciled(spark, root, partitionBytes=str(3 * biggest))
    assert frame.rdd.getNumPartitions() == 4
    # Ten small buckets and two cores: below 4 MiB a task costs more than its files.
    assert planned_buckets(root, minPartitions="2") == [buckets]


def rows_to_driver(spark, monkeypatch) -> list[int]:
    """A list that gets the number of rows of every result pyspark brings to the driver
    from here on (collect, take, toArrow, toPandas of a DataFrame or an RDD)."""
    from pyspark import RDD

    DataFrame = type(spark.range(0))  # pyspark 4: the classic DataFrame overrides its base
    brought: list[int] = []

    def counted(method, rows):
        def wrapper(self, *args, **kwargs):
            result = method(self, *args, **kwargs)
            brought.append(rows(result))
            return result

        return wrapper

    monkeypatch.setattr(DataFrame, "toArrow", counted(DataFrame.toArrow, lambda t: t.num_rows))
    for cls, name in [(DataFrame, n) for n in ("collect", "take", "tail", "toPandas")] + [
        (RDD, n) for n in ("collect", "take")
    ]:
        monkeypatch.setattr(cls, name, counted(getattr(cls, name), len))
    return brought


def busy_server(root: str, per_minute: int) -> None:
    """Four minutes of ``per_minute`` messages each: every fifth moved a minute later and
    delivered there, every seventh else cancelled, the rest delivered 0..2 ms late."""
    with DelayData(root) as data:
        for minute in range(4):
            for i in range(per_minute):
                due_ms = T0 + minute * MINUTE + i * (50_000 // per_minute)
                record = data.accept(f"m-{minute}-{i}", due_ms)
                if i % 5 == 0:
                    record = data.reschedule(record, due_ms + MINUTE, at_ms=T0 - 1_000)
                elif i % 7 == 0:
                    data.cancel(record, at_ms=T0 - 1_000)
                    continue
                data.entry(record, record.due_ms + i % 3)


def test_no_row_per_record_reaches_the_driver(spark, tmp_path, monkeypatch):
    """The driver gets rows per bucket, per task and per finding, never per record: a
    clean audit of four times the records — moved and cancelled ones among them —
    brings it exactly as many rows."""
    brought = rows_to_driver(spark, monkeypatch)
    counts = []
    for per_minute in (25, 100):
        root = str(tmp_path / f"data-{per_minute}")
        busy_server(root, per_minute)
        config = AuditConfig(
            servers=(Server("s1", root),), out=str(tmp_path / f"out-{per_minute}"), as_of_ms=AS_OF
        )
        brought.clear()
        result = job.run(spark, config)
        assert result.clean, result.counts
        total = result.total_row()
        assert total["scheduled"] == 4 * per_minute * 6 // 5  # a moved message: two records
        assert total["rescheduled"] == 4 * per_minute // 5
        counts.append(list(brought))
    small, big = counts
    assert small == big and sum(small) > 0, counts


def test_many_candidates_are_read_again_through_a_join(spark, tmp_path, monkeypatch):
    """Past IN_LIST_ROWS candidate hashes the records are picked by a semi join rather
    than written into the query: found the same. Two servers given the same ids (as two
    groups of a cluster never are) have every id delivered twice."""
    monkeypatch.setattr(queries, "IN_LIST_ROWS", 2)
    roots = [str(tmp_path / name) for name in ("s1", "s2")]
    for root in roots:
        group_copy(root, "same", 6)
    config = AuditConfig(
        servers=tuple(Server(f"s{i + 1}", root) for i, root in enumerate(roots)),
        out=str(tmp_path / "out"),
        as_of_ms=AS_OF,
    )

    result = job.run(spark, config)

    assert result.counts == {("duplicate_id", ERROR): 12}
    assert findings(config.out) == {
        ("duplicate_id", ERROR, server, f"same-{i}") for server in ("s1", "s2") for i in range(6)
    }
