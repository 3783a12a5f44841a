"""Idempotent intake against a real ``delayd serve``: an id the server holds is answered
DUPLICATE with the held message's due time — within a batch, across batches, across a
graceful restart and a ``kill -9``, and after a cancel — and a cancelled id is never
delivered. Issue #18 reproduced the opposite: 50 ids sent twice, every other one
cancelled, gave 0 DUPLICATE answers and 25 cancelled ids delivered."""

from __future__ import annotations

import time

import pytest

import delayd
from delayd.logs import layout, message_log
from delayd.protocol import Message, ResultCode
from delayd.protocol.codes import CancelOutcome
from storage.segmented_log import SegmentedLog
from tests.delivery_support import (
    SUBJECT,
    assert_never_early,
    consume,
    exactly_once,
    hostport,
    now_ms,
)
from tests.intake_support import NO_SYNC_FS, RawClient, read_schedule_log

pytestmark = pytest.mark.slow

DELAY_MS = 2500


def resend_all(address: tuple[str, int], ids: list[str], first_due: dict[str, int]) -> None:
    """Send every id again, with another body and delay: each answered DUPLICATE with
    the due time the first send got (nothing is scheduled twice)."""
    with delayd.Producer(hostport(address)) as producer:
        receipts = producer.send_batch(
            [Message(i, SUBJECT, body=f"again {i}".encode(), delay_ms=60_000) for i in ids]
        )
    assert [r.code for r in receipts] == [ResultCode.DUPLICATE] * len(ids)
    assert {r.message_id: r.due_ms for r in receipts} == {i: first_due[i] for i in ids}


@pytest.mark.parametrize("restart", ["sigterm", "kill-9"])
def test_ids_sent_twice_are_held_once_and_cancels_are_final(procs, tmp_path, restart):
    data = tmp_path / "data"
    server = procs.serve(data)
    ids = [f"order-{i}" for i in range(50)]
    cancelled = ids[::2]
    first, second, outcomes = [], [], []
    with delayd.Producer(hostport(server.address)) as producer:
        # Each id sent, sent again at once (its first record is not even replayed yet)
        # and cancelled right after: a cancel after all 125 calls could find the first
        # ids delivered, DELAY_MS after sending, on a loaded machine.
        for i in ids:
            first.append(producer.send(SUBJECT, f"first {i}", delay_ms=DELAY_MS, message_id=i))
            second.append(producer.send(SUBJECT, "second", delay_ms=10, message_id=i))
            if i in cancelled:
                outcomes.append(producer.cancel(i).outcome)
    assert {r.code for r in first} == {ResultCode.OK}
    first_due = {r.message_id: r.due_ms for r in first}
    assert [r.code for r in second] == [ResultCode.DUPLICATE] * len(ids)
    assert [r.due_ms for r in second] == [first_due[i] for i in ids]
    assert outcomes == [CancelOutcome.CANCELLED] * len(cancelled)
    # A cancelled id sent again stays cancelled: DUPLICATE, not a new schedule.
    resend_all(server.address, ids, first_due)

    if restart == "sigterm":
        assert server.stop() == 0
    else:
        server.kill()
    server = procs.serve(data)
    resend_all(server.address, ids, first_due)  # the index and message_log remember

    expected = set(ids) - set(cancelled)
    time.sleep(max(0.0, (max(first_due.values()) - now_ms()) / 1000))
    received = exactly_once(consume(server.broker_address, len(expected), group="check"))
    assert set(received) == expected  # no cancelled id, nothing twice
    assert_never_early(received.values())
    assert {r.message.body for r in received.values()} == {f"first {i}".encode() for i in expected}
    assert server.stop() == 0
    # One MESSAGE record per id in message_log, one SCHEDULED record in schedule_log.
    with SegmentedLog.open(layout.message_log_dir(str(data)), fs=NO_SYNC_FS) as log:
        sent = [
            message_log.decode_message(r.payload).message_id
            for r in log.iter_from(0)
            if r.type == message_log.TYPE_MESSAGE
        ]
    assert sorted(sent) == sorted(ids)
    assert sorted(s.message.message_id for s in read_schedule_log(data)) == sorted(ids)


def test_duplicates_within_one_batch_and_the_refused_ids(procs, tmp_path):
    server = procs.serve(tmp_path / "data")
    due_ms = now_ms() + 3_600_000
    client = RawClient(server.address)
    try:
        results = client.send_batch(
            [
                Message("x", SUBJECT, body=b"a", at_ms=due_ms),
                Message("x", SUBJECT, body=b"b", at_ms=due_ms + 5),
                Message("bad\nid", SUBJECT, body=b"c", at_ms=due_ms),
                Message("y", SUBJECT, body=b"d", at_ms=-1),
                Message("z", "DLQ.orders", body=b"e", at_ms=due_ms),
                # Refused ids are not held: the same id, valid now, is accepted.
                Message("y", SUBJECT, body=b"f", at_ms=due_ms),
            ]
        )
    finally:
        client.close()
    codes = [r.code for r in results]
    assert codes == [
        ResultCode.OK,
        ResultCode.DUPLICATE,
        ResultCode.INVALID_ID,
        ResultCode.INVALID_DELAY,
        ResultCode.INVALID_SUBJECT,
        ResultCode.OK,
    ]
    assert results[1].due_ms == due_ms  # the held one's, not the resend's
    assert "'\\n' at index 3" in results[2].reason
    assert "at_ms is -1" in results[3].reason
    assert "reserved" in results[4].reason and "send to orders" in results[4].reason
    assert server.stop() == 0
