"""Cancel and reschedule against a real ``delayd serve`` (TCP, on-disk store, embedded
broker), with ``kill -9`` right after the answers: an acknowledged cancel is never
delivered, an acknowledged reschedule is delivered exactly once, at its new time."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

import delayd
from delayd.protocol.codes import CancelOutcome, RescheduleOutcome
from tests.delivery_support import Processes, consume, exactly_once, hostport, now_ms
from tests.intake_support import ROOT, write_config

pytestmark = pytest.mark.slow


@pytest.fixture
def procs(tmp_path):
    processes = Processes(tmp_path)
    yield processes
    processes.close()


@pytest.mark.parametrize("checkpoint_ms", [60_000, 50])
def test_kill_9_right_after_cancel_and_reschedule(procs, tmp_path, checkpoint_ms):
    """With a long checkpoint interval the tombstones are replayed again after the
    kill (recovery decides again); with a short one the checkpoint has passed them and
    only dispatch_log carries the decision."""
    config = write_config(
        tmp_path / "c.toml", f"[replay]\ncheckpoint_interval_ms = {checkpoint_ms}\n"
    )
    data = tmp_path / "data"
    server = procs.serve(data, "--config", config)
    with delayd.Producer(hostport(server.address)) as producer:
        receipts = [producer.send("orders", f"m{i}", delay_ms=4000) for i in range(30)]
        ids = [r.message_id for r in receipts]
        cancelled = {message_id: producer.cancel(message_id).outcome for message_id in ids[:10]}
        new_at = now_ms() + 7000
        moved = {
            message_id: producer.reschedule(message_id, at_ms=new_at) for message_id in ids[10:15]
        }
        unknown = producer.cancel("never-sent").outcome
    server.kill()  # right after the last answer
    assert set(cancelled.values()) == {CancelOutcome.CANCELLED}
    assert {m.outcome for m in moved.values()} == {RescheduleOutcome.RESCHEDULED}
    assert unknown is CancelOutcome.UNKNOWN

    server = procs.serve(data, "--config", config)
    time.sleep(max(0.0, (new_at - now_ms()) / 1000) + 1.0)
    received = exactly_once(consume(server.broker_address, 20, group="check"))
    assert set(received) == set(ids[10:])  # none of the cancelled
    for message_id in ids[10:15]:
        message = received[message_id].message
        assert message.due_ms == new_at and message.dispatched_ms >= new_at
        assert received[message_id].received_ms >= new_at  # not at the old time
    assert server.stop() == 0


def test_cli_cancel_and_reschedule(procs, tmp_path):
    server = procs.serve(tmp_path / "data")
    address = hostport(server.address)
    with delayd.Producer(address) as producer:
        first = producer.send("orders", "a", delay_ms=60_000).message_id
        second = producer.send("orders", "b", delay_ms=60_000).message_id
        with pytest.raises(ValueError, match="exactly one of at_ms and delay_ms"):
            producer.reschedule(second)

    def cli(*args: str) -> tuple[int, dict]:
        done = subprocess.run(
            [sys.executable, "-m", "delayd", *args, "--server", address],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return done.returncode, json.loads(done.stdout) if done.stdout else {}

    assert cli("cancel", first) == (0, {"message_id": first, "outcome": "CANCELLED"})
    code, answer = cli("cancel", "nope")
    assert (code, answer["outcome"]) == (3, "UNKNOWN")
    code, answer = cli("reschedule", "--delay", "2m", second)
    assert (code, answer["outcome"]) == (0, "RESCHEDULED")
    code, answer = cli("reschedule", "--delay", "800d", second)  # past max_delay
    assert (code, answer["outcome"]) == (3, "DELAY_TOO_LONG")
    assert server.stop() == 0
