"""SIGTERM under pipelined load: every batch the server stored is answered before the
connection closes, or it is not stored.

A client keeps up to PIPELINE batches unanswered on one connection while the server is
stopped, so batches arrive before, during and after the signal. Then, on the files:
every message answered OK is in message_log exactly once, and every message in
message_log was answered OK. A stored batch whose answer is lost is what turned a
client's resend into a second record of the same id (issue 18): it would show here as
a logged id the client never saw acknowledged.
"""

from __future__ import annotations

import select
import signal
import socket
import time
from collections import Counter

from delayd.protocol import (
    CLIENT,
    NEED_DATA,
    Connection,
    ConnectionClosed,
    Error,
    Hello,
    HelloOk,
    Message,
    ResultCode,
    SendBatch,
    SendBatchResult,
)
from tests.broker_support import BrokerProcess
from tests.intake_support import ServeProcess, read_message_log

PIPELINE = 32  # batches in flight on the connection
BATCH = 20  # messages per batch
ROUNDS = 4
STOP_AFTER_ANSWERS = 40  # batches answered before the SIGTERM (a loaded connection)
IO_TIMEOUT_S = 10.0


class Tally:
    """What the client saw: ids sent, ids answered OK, ids answered otherwise."""

    def __init__(self) -> None:
        self.sent: set[str] = set()
        self.acked: list[str] = []
        self.refused: list[str] = []
        self.errors: list[Error] = []


def pipeline_through_stop(
    server: ServeProcess | BrokerProcess, prefix: str, *, delayed: bool = True
) -> Tally:
    """Send batches on one connection, never more than PIPELINE unanswered, and SIGTERM
    ``server`` once STOP_AFTER_ANSWERS are answered; go on sending and reading until
    the server closes the connection. ``delayed``: messages due in an hour (the delay
    server), else due now (a broker takes no delayed message)."""
    assert server.address is not None and server.proc is not None
    tally = Tally()
    conn = Connection(CLIENT)
    sock = socket.create_connection(server.address, timeout=IO_TIMEOUT_S)
    try:
        hello = Hello(client_name="sigterm-test", request_id=conn.next_request_id())
        sock.sendall(conn.send(hello))
        while (event := conn.next_event()) is NEED_DATA:
            conn.receive_data(sock.recv(65536))
        assert isinstance(event, HelloOk), event
        sock.setblocking(False)
        due = int(time.time() * 1000) + 3_600_000 if delayed else None
        pending: dict[int, list[str]] = {}
        out = b""
        writing, signalled, answered, batch_no = True, False, 0, 0
        while True:
            if writing and len(pending) < PIPELINE and not out:
                ids = [f"{prefix}-{batch_no}-{i}" for i in range(BATCH)]
                batch_no += 1
                rid = conn.next_request_id()
                messages = [Message(m, "orders", body=b"x" * 50, at_ms=due) for m in ids]
                out = conn.send(SendBatch(messages, request_id=rid))
                pending[rid] = ids
                tally.sent.update(ids)
            readable, writable, _ = select.select(
                [sock], [sock] if out and writing else [], [], IO_TIMEOUT_S
            )
            assert readable or writable, "the server neither answered nor closed"
            if writable:
                try:
                    out = out[sock.send(out) :]
                except OSError:  # the server closed: what it read is answered below
                    writing, out = False, b""
            if not readable:
                continue
            try:
                data = sock.recv(1 << 20)
            except ConnectionResetError:
                data = b""  # the answers lost with a reset show in the check
            if not data:
                return tally
            conn.receive_data(data)
            while (event := conn.next_event()) is not NEED_DATA:
                if isinstance(event, ConnectionClosed):
                    return tally
                if isinstance(event, Error):
                    tally.errors.append(event)
                    pending.pop(event.request_id, None)
                    continue
                assert isinstance(event, SendBatchResult), event
                ids = pending.pop(event.request_id)
                for message_id, result in zip(ids, event.results, strict=True):
                    ok = result.code is ResultCode.OK
                    if ok:
                        tally.acked.append(message_id)
                    else:
                        tally.refused.append(f"{message_id}: {result.code.name} {result.reason}")
                answered += 1
            if answered >= STOP_AFTER_ANSWERS and not signalled:
                server.proc.send_signal(signal.SIGTERM)
                signalled = True
    finally:
        sock.close()


def check_round(server: ServeProcess | BrokerProcess, tally: Tally) -> None:
    assert server.proc is not None
    assert server.proc.wait(30) == 0, server.log_tail()
    assert not tally.refused, tally.refused[:5]
    # Refused or unanswered batches are the client's to resend; an ERROR must say why
    # (SHUTTING_DOWN), never INTERNAL.
    assert all(e.code.name == "SHUTTING_DOWN" for e in tally.errors), tally.errors
    assert len(tally.acked) >= STOP_AFTER_ANSWERS * BATCH


def check_stored(stored: list[str], acked: list[str], sent: set[str]) -> None:
    """``stored``: the ids on disk, in order, one per record."""
    twice = [m for m, n in Counter(stored).items() if n > 1]
    assert not twice, twice[:5]
    assert len(acked) == len(set(acked))
    unanswered = set(stored) - set(acked)
    assert not unanswered, (
        f"{len(unanswered)} messages stored but never acknowledged: {sorted(unanswered)[:5]}"
    )
    lost = set(acked) - set(stored)
    assert not lost, f"{len(lost)} acknowledged messages not stored: {sorted(lost)[:5]}"
    assert set(stored) < sent  # the stop cut the load short: some were never stored


def test_every_stored_batch_is_answered_across_sigterm_under_load(tmp_path, procs):
    data = tmp_path / "data"
    server = procs.add(ServeProcess(data, "--broker-listen", "off", metrics_listen="off"))
    acked_total: list[str] = []
    sent_total: set[str] = set()
    for round_no in range(ROUNDS):
        server.start()
        tally = pipeline_through_stop(server, f"r{round_no}")
        check_round(server, tally)
        acked_total += tally.acked
        sent_total |= tally.sent
    stored = [record.message_id for _, record in read_message_log(data)]
    check_stored(stored, acked_total, sent_total)


def test_the_broker_answers_every_stored_batch_across_sigterm_under_load(tmp_path, procs):
    """The same for ``delayd broker``'s SEND_BATCH: read back by draining the subject
    after a restart (the broker stores each id once, so a lost answer shows as a
    stored id never acknowledged)."""
    server = procs.add(BrokerProcess(tmp_path / "broker", "--metrics-listen", "off"))
    acked_total: list[str] = []
    sent_total: set[str] = set()
    for round_no in range(ROUNDS):
        server.start()
        tally = pipeline_through_stop(server, f"r{round_no}", delayed=False)
        check_round(server, tally)
        acked_total += tally.acked
        sent_total |= tally.sent
    server.start()
    with server.client() as client:
        stored = [m.message_id for m in client.drain("orders", "check", "c1")]
    assert server.stop() == 0
    check_stored(stored, acked_total, sent_total)
