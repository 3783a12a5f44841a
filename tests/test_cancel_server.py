"""Cancel and reschedule against a real ``delayd serve`` (TCP, on-disk store, embedded
broker), with ``kill -9`` right after the answers: an acknowledged cancel is never
delivered, an acknowledged reschedule is delivered exactly once, at its new time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter

import pytest
import trio

import delayd
from delayd.logs import layout
from delayd.logs.dispatch_log import EntryKind
from delayd.protocol import CancelBatch, Error, ErrorCode
from delayd.protocol.codes import CancelOutcome, RescheduleOutcome
from tests.delivery_support import (
    consume,
    dispatched_count,
    exactly_once,
    hostport,
    now_ms,
    poll,
    read_dispatch_log,
)
from tests.fault_checker import History, check
from tests.intake_support import RawClient, write_config
from tests.process_support import ROOT

pytestmark = pytest.mark.slow


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
        # Due after the 45 calls below even on a loaded machine (a cancel finding its
        # message delivered would fail the test), and before new_at, which the test
        # waits for anyway.
        receipts = [producer.send("orders", f"m{i}", delay_ms=6000) for i in range(30)]
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
    sightings = consume(server.broker_address, 20, group="check")
    # The checker: no cancelled one delivered, the moved ones not at their old time,
    # none lost, none twice.
    history = History()
    for receipt in receipts:
        history.acked(receipt.message_id, receipt.due_ms)
    for message_id, outcome in cancelled.items():
        history.cancel(message_id, outcome.name)
    for message_id, answer in moved.items():
        history.reschedule(message_id, answer.outcome.name, answer.at_ms)
    history.seen_all(r.sighting("check", committed=True) for r in sightings)
    check(history, due_by_ms=new_at).assert_clean()
    received = {r.message_id: r for r in sightings}
    assert set(received) == set(ids[10:])  # none of the cancelled
    for message_id in ids[10:15]:
        assert received[message_id].message.due_ms == new_at
    assert server.stop() == 0


def test_cli_cancel_and_reschedule(procs, tmp_path):
    server = procs.serve(tmp_path / "data")
    address = hostport(server.address)
    with delayd.Producer(address) as producer:
        first = producer.send("orders", "a", delay_ms=60_000).message_id
        second = producer.send("orders", "b", delay_ms=60_000).message_id
        with pytest.raises(ValueError, match="exactly one of at, delay, at_ms and delay_ms"):
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


def test_kill_9_with_dispatch_log_unflushed_then_cancel_after_restart(procs, tmp_path):
    """The first run delivers every message, then dies by ``kill -9`` with none of its
    dispatch_log fsynced (flush interval and replay checkpoints an hour away); the
    files are emptied as a machine crash may leave them. After the restart every
    message is pending again and is resent (the broker answers DUPLICATE). Cancels and
    reschedules sent right after the restart — most before the resend, which goes one
    message per batch — must all answer ALREADY_DELIVERED, and a consumer must have
    received each message exactly once."""
    count = 300
    config = write_config(
        tmp_path / "c.toml",
        "[replay]\ncheckpoint_interval_ms = 3600000\n"
        "[delivery]\ndispatch_flush_interval_ms = 3600000\nmax_batch = 1\n"
        "batches_in_flight = 1\n",
    )
    data = tmp_path / "data"
    server = procs.serve(data, "--config", config)
    with delayd.Producer(hostport(server.address)) as producer:
        receipts = producer.send_batch(
            [{"subject": "orders", "body": f"m{i}", "delay_ms": 1000} for i in range(count)]
        )
    ids = [r.message_id for r in receipts]
    first = exactly_once(consume(server.broker_address, count, group="before"))
    assert set(first) == set(ids)
    poll(lambda: dispatched_count(data) == count, 30, "every dispatch_log entry written")
    server.kill()
    directory = layout.dispatch_log_dir(str(data))
    for name in os.listdir(directory):
        os.truncate(os.path.join(directory, name), 0)

    server = procs.serve(data, "--config", config)
    answers: dict = {}

    async def cancel_all() -> None:
        async with (
            delayd.open_producer(hostport(server.address)) as producer,
            trio.open_nursery() as nursery,
        ):
            # Latest due first: those are resent last.
            for index, message_id in enumerate(reversed(ids)):
                if index % 3:
                    nursery.start_soon(cancel, producer, message_id)
                else:
                    nursery.start_soon(reschedule, producer, message_id)

    async def cancel(producer, message_id: str) -> None:
        answers[message_id] = await producer.cancel(message_id)

    async def reschedule(producer, message_id: str) -> None:
        answers[message_id] = await producer.reschedule(message_id, delay_ms=60_000)

    trio.run(cancel_all)
    wrong = sorted((m, a.outcome.name) for m, a in answers.items() if a.dispatched_ms is None)
    assert len(answers) == count and not wrong, wrong[:5]
    for message_id, answer in answers.items():
        assert answer.dispatched_ms >= first[message_id].message.due_ms
    received = exactly_once(consume(server.broker_address, count, group="after"))
    assert set(received) == set(ids)
    assert server.stop() == 0
    # DISPATCHED again, nothing cancelled or moved: each reschedule's copy is void.
    kinds = Counter(e.kind for entries in read_dispatch_log(data).values() for e in entries)
    reschedules = len(range(0, count, 3))
    assert dispatched_count(data) == count + reschedules
    assert (kinds[EntryKind.DISPATCHED], kinds[EntryKind.NOT_MOVED]) == (count, reschedules)


def test_cancel_many_answers_each_id_in_order(procs, tmp_path):
    """CANCEL_BATCH through both producers: one receipt per id, in order, each what a
    CANCEL would answer; the cancelled messages are never delivered."""
    server = procs.serve(tmp_path / "data")
    address = hostport(server.address)
    with delayd.Producer(address) as producer:
        receipts = producer.send_batch(
            [{"subject": "orders", "body": f"m{i}", "delay_ms": 3000} for i in range(2500)]
        )
        ids = [r.message_id for r in receipts]
        doomed = ids[:2100]  # three frames: 1024 + 1024 + 52
        answers = producer.cancel_many([*doomed, "never-sent"])
        with pytest.raises(ValueError, match="non-empty"):
            producer.cancel_many(["a", ""])
        with pytest.raises(ValueError, match="not one id"):
            producer.cancel_many("abc")
    assert [a.message_id for a in answers] == [*doomed, "never-sent"]
    assert {a.outcome for a in answers[:-1]} == {CancelOutcome.CANCELLED}
    assert answers[-1].outcome is CancelOutcome.UNKNOWN

    async def again() -> list:
        async with delayd.open_producer(address) as producer:
            return await producer.cancel_many(doomed[-5:] + ids[-3:])

    raw = RawClient(server.address)  # past the client's checks: all or nothing
    try:
        refused = raw.request(lambda rid: CancelBatch((ids[-1], ""), request_id=rid))
    finally:
        raw.close()
    assert isinstance(refused, Error) and refused.code is ErrorCode.INVALID_REQUEST

    repeated = trio.run(again)
    assert [a.outcome for a in repeated[:5]] == [CancelOutcome.CANCELLED] * 5
    assert [a.outcome for a in repeated[5:]] == [CancelOutcome.CANCELLED] * 3
    received = exactly_once(consume(server.broker_address, 2500 - 2103, group="check"))
    assert set(received) == set(ids[2100:-3])
    assert server.stop() == 0
