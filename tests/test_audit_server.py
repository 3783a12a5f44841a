"""The audit of a real `delayd serve` data directory: messages sent through the client
(one of them cancelled, one rescheduled), delivered by the server into its embedded
broker, the server stopped — and `delayd audit` finds every message scheduled once,
dispatched once, on time, the cancelled one not sent, the moved one sent from its copy,
and exits 0."""

from __future__ import annotations

import time

import pytest

import delayd
from delayd.audit import files
from delayd.audit.decode_dispatch import dispatch_batches
from delayd.cli import main
from delayd.protocol.codes import CancelOutcome, RescheduleOutcome
from tests.audit_support import read_table, spark_session  # noqa: F401 - session fixture
from tests.intake_support import ServeProcess

MESSAGES = 30
DELIVERY_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def spark(spark_session):  # noqa: F811 - the fixture imported above
    return spark_session


@pytest.fixture
def server(tmp_path):
    process = ServeProcess(tmp_path / "data")
    yield process
    process.close()


def dispatched_entries(data_dir: str) -> int:
    """DISPATCHED entries in the data directory's dispatch_log, read as the audit reads."""
    return sum(
        batch.column("kind").to_pylist().count("dispatched")
        for log_file in files.list_files(data_dir, files.DISPATCH_LOG)
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
