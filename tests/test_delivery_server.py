"""Delivery through a real ``delayd serve`` on loopback: schedule → consume round trip
from the embedded broker (each message exactly once, none early, its due time and
dispatch time on it), and a graceful stop (SIGTERM, then SIGINT) with messages pending
and a producer sending: exit 0, the wheel's cursors written, and after a restart every
acknowledged message arrives exactly once."""

from __future__ import annotations

import random

import pytest

import delayd
from delayd.logs import layout
from delayd.logs.dispatch_log import EntryKind
from delayd.server.delivery import WHEEL_CHECKPOINT
from delayd.wheel.cursor import LoadCursors
from storage.checkpoint import read_checkpoint
from storage.fs import REAL_FS
from tests.delivery_support import (
    SUBJECT,
    SteadySender,
    Workload,
    assert_never_early,
    check_dispatch_log,
    consume,
    dispatched_count,
    exactly_once,
    hostport,
    now_ms,
    poll,
    serve_stats,
)
from tests.intake_support import check_exactly_once, interrupt, terminate

pytestmark = pytest.mark.slow


def test_schedule_consume_round_trip(procs, tmp_path):
    data = tmp_path / "data"
    server = procs.serve(data)
    rng = random.Random(5)
    receipts: dict[str, delayd.Receipt] = {}
    sent: dict[str, tuple[str | None, dict[str, str], bytes]] = {}
    with delayd.Producer(hostport(server.address)) as producer:
        for i in range(200):
            key = f"k{i % 7}" if i % 3 else None
            properties = {"n": str(i)} if i % 2 else {}
            body = rng.randbytes(rng.randrange(300))
            if i % 20 == 0:  # past due: due at once
                at = {"at_ms": now_ms() - rng.randrange(1, 90_000)}
            else:
                at = {"delay_ms": rng.randrange(2000)}
            receipt = producer.send(
                SUBJECT, body, message_id=f"m{i}", key=key, properties=properties, **at
            )
            assert receipt.ok and receipt.due_ms is not None
            receipts[receipt.message_id] = receipt
            sent[receipt.message_id] = (key, properties, body)
    received = exactly_once(consume(server.broker_address, len(receipts), group="billing"))
    assert set(received) == set(receipts)
    assert_never_early(received.values())
    for message_id, r in received.items():
        m = r.message
        assert m.due_ms == receipts[message_id].due_ms
        assert (m.key, m.properties, m.body) == sent[message_id]
        assert m.subject == SUBJECT
        assert r.received_ms - m.due_ms < 30_000  # delivered, not merely eventually

    terminate(server)
    scheduled = check_exactly_once(data, 1)
    dispatched = check_dispatch_log(data)
    assert set(dispatched) == set(scheduled) == set(receipts)
    for message_id, (_, entry) in dispatched.items():
        assert entry.kind is EntryKind.DISPATCHED and entry.group == "local"
        # the time in dispatch_log is the time the consumer was shown
        assert entry.at_ms == received[message_id].message.dispatched_ms


def test_sigterm_with_messages_pending_then_restart(procs, tmp_path):
    data = tmp_path / "data"
    server = procs.serve(data)
    sender = SteadySender(server.address, "t", 7, Workload(delay_ms=(200, 2500), warm=100))
    sender.start()
    assert sender.started_acking.wait(20), server.log_tail()
    # Stop once some messages were delivered and the rest are pending, while the
    # producer is still sending.
    poll(lambda: dispatched_count(data) >= 50, 20, "first deliveries")
    terminate(server)  # SIGTERM: exit 0
    sender.join(20)
    assert not sender.is_alive() and sender.error is None, sender.error
    assert len(sender.acked) >= 100
    cursors = read_checkpoint(REAL_FS, f"{layout.checkpoint_dir(str(data))}/{WHEEL_CHECKPOINT}")
    assert cursors is not None, "no wheel checkpoint after SIGTERM"
    assert LoadCursors.from_bytes(cursors).loading.bucket_ms >= 0
    dispatched_before = dispatched_count(data)
    assert 50 <= dispatched_before < len(sender.acked), "nothing was pending at SIGTERM"

    server = procs.serve(data)
    total = serve_stats(server.address)["intake.last_sequence"]
    poll(lambda: dispatched_count(data) >= total, 30, f"{total} messages dispatched")
    received = exactly_once(consume(server.broker_address, total, group="after"))
    assert len(received) == total
    # A message whose acknowledgement the stop cut off may be there too, once.
    assert set(sender.acked) <= set(received) <= sender.sent
    assert_never_early(received.values())
    assert all(received[i].message.due_ms == due for i, due in sender.acked.items())
    assert interrupt(server) == 0, server.log_tail()  # SIGINT: exit 0 as well
    scheduled = check_exactly_once(data, 1)
    assert set(check_dispatch_log(data)) == set(scheduled) == set(received)
    log = server.log_path.read_text()
    assert log.count("wheel cursors:") == 2
