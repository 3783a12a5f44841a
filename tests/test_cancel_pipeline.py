"""Cancel and reschedule in-process on trio's clock (docs/cancel.md): before the bucket
is loaded, in the wheel, in the due millisecond, in a send batch that is in flight
(answered or refused), unknown ids; reschedule earlier, later, across buckets, of a
delivered or cancelled message. Real message_log, replayer, id index, schedule_log,
dispatch_log, wheel and sender; in-memory broker targets."""

from __future__ import annotations

import os
import threading
from collections import Counter
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing

from delayd.logs import layout
from delayd.logs.dispatch_log import EntryKind
from delayd.protocol import SendResult
from delayd.protocol.codes import CancelOutcome, RescheduleOutcome, ResultCode
from delayd.sender.sender import SenderConfig
from delayd.server.cancels import Answer
from tests.delivery_pipeline import (
    T0,
    Pipeline,
    Received,
    RecordingTarget,
    dispatch_entries,
    received_ids,
)

MINUTE = 60_000


def append_tombstone(pipeline: Pipeline, message_id: str, due_ms: int | None = None) -> Answer:
    """What the intake path does for CANCEL / RESCHEDULE: a durable tombstone."""
    return pipeline.append_tombstone(message_id, due_ms)


async def cancel(pipeline: Pipeline, message_id: str) -> Answer:
    return await pipeline.delivery.canceller.wait(append_tombstone(pipeline, message_id))


async def reschedule(pipeline: Pipeline, message_id: str, due_ms: int) -> Answer:
    answer = append_tombstone(pipeline, message_id, due_ms)
    return await pipeline.delivery.canceller.wait(answer)


@dataclass
class DedupingTarget(RecordingTarget):
    """A broker group that stores each message id once, as a broker's dedupe does:
    a copy is answered DUPLICATE and not stored (``received`` is what consumers see).
    Give two runs the same ``stored`` for one broker across a restart."""

    stored: set[str] = field(default_factory=set)
    duplicates: int = 0

    async def send_batch(self, messages):
        self.calls += 1
        if self.hang is not None:
            await self.hang.wait()
        await trio.lowlevel.checkpoint()
        results = []
        for message in messages:
            if message.message_id in self.stored:
                self.duplicates += 1
                results.append(SendResult(ResultCode.DUPLICATE))
            else:
                self.stored.add(message.message_id)
                self.received.append(Received(self.clock(), message))
                results.append(SendResult(ResultCode.OK))
        return results


def lose_dispatch_log(data: str) -> None:
    """What a machine crash can leave of dispatch_log files never fsynced (it is
    flushed lazily): nothing."""
    directory = layout.dispatch_log_dir(data)
    for name in os.listdir(directory):
        os.truncate(os.path.join(directory, name), 0)


async def wait_for(condition) -> None:
    while not condition():
        await trio.sleep(0.001)


def kinds(data: str) -> Counter:
    return Counter(e.kind for es in dispatch_entries(data).values() for e in es)


async def test_cancel_before_the_bucket_is_loaded(tmp_path, clock):
    target = RecordingTarget("a")
    with Pipeline(str(tmp_path), [target]) as pipeline:  # load-ahead: 2 minutes
        doomed, kept = pipeline.schedule([T0 + 10 * MINUTE + 5, T0 + 10 * MINUTE + 6])
        async with pipeline.running():
            await trio.sleep(1)
            assert pipeline.delivery.manager.statistics().buckets_loaded == 0
            answer = await cancel(pipeline, doomed)
            assert answer.outcome is CancelOutcome.CANCELLED and answer.dispatched_ms is None
            await trio.sleep_until((12 * MINUTE) / 1000)
            await pipeline.stop()
            stats = pipeline.delivery.manager.statistics()
        assert received_ids([target]) == [kept]
        assert stats.entries_skipped == 1  # the loader read the CANCELLED entry
        assert kinds(str(tmp_path))[EntryKind.CANCELLED] == 1
        assert pipeline.delivery.canceller.cancels[CancelOutcome.CANCELLED] == 1


async def test_cancel_while_in_the_wheel_and_again(tmp_path, clock):
    target = RecordingTarget("a")
    with Pipeline(str(tmp_path), [target]) as pipeline:
        doomed, kept = pipeline.schedule([T0 + 30_000, T0 + 30_000])
        async with pipeline.running():
            await trio.sleep(5)
            assert len(pipeline.delivery.ticker.wheel) == 2
            assert (await cancel(pipeline, doomed)).outcome is CancelOutcome.CANCELLED
            assert len(pipeline.delivery.ticker.wheel) == 1
            # A second cancel of a cancelled message: still CANCELLED, no second entry.
            assert (await cancel(pipeline, doomed)).outcome is CancelOutcome.CANCELLED
            await trio.sleep_until(2 * MINUTE / 1000 + 1)
            await pipeline.stop()
            outstanding = pipeline.delivery.manager.outstanding
        assert received_ids([target]) == [kept]
        assert kinds(str(tmp_path))[EntryKind.CANCELLED] == 1
        assert kinds(str(tmp_path))[EntryKind.COMPLETE] == 1  # the bucket was completed
        assert outstanding == 0


async def test_cancel_of_an_unknown_id(tmp_path, clock):
    with Pipeline(str(tmp_path), [RecordingTarget("a")]) as pipeline:
        pipeline.schedule([T0 + 5000])
        async with pipeline.running():
            answer = await cancel(pipeline, "never-sent")
        assert answer.outcome is CancelOutcome.UNKNOWN
        assert not any(dispatch_entries(str(tmp_path)).values())


async def test_cancel_in_the_due_millisecond_is_exact(tmp_path, clock):
    """Each message is cancelled in the very millisecond it falls due: whichever way
    the race goes, the answer says what happened — CANCELLED and never received, or
    ALREADY_DELIVERED and received once, at the dispatched_ms the answer names.

    The wheel releases a message at the start of its millisecond and the sender starts
    its batch at once, before a cancel in that millisecond is resolved: to run the race
    both ways, messages come in pairs one ms apart to a group that sends one batch at a
    time, slowly, so the second of a pair waits in the group's queue (cancellable)."""
    target = RecordingTarget("a", send_s=0.005)
    with Pipeline(str(tmp_path), [target], sender=SenderConfig(batches_in_flight=1)) as pipeline:
        dues = [T0 + 3000 + 37 * (i // 2) + i % 2 for i in range(40)]
        ids = pipeline.schedule(dues)
        answers: dict[str, Answer] = {}
        async with pipeline.running():
            for message_id, due in zip(ids, dues, strict=True):
                await trio.sleep_until(pipeline.delivery.ticker.deadline(due))
                assert pipeline.now_ms() == due
                answers[message_id] = append_tombstone(pipeline, message_id)
            for answer in answers.values():
                await pipeline.delivery.canceller.wait(answer)
            await trio.sleep(2)
            await pipeline.stop()
        got = {r.message.message_id: r.message for r in target.received}
        assert len(got) == len(target.received)  # none twice
        for message_id, answer in answers.items():
            if answer.outcome is CancelOutcome.CANCELLED:
                assert message_id not in got
            else:
                assert answer.outcome is CancelOutcome.ALREADY_DELIVERED
                assert got[message_id].dispatched_ms == answer.dispatched_ms
        outcomes = Counter(a.outcome for a in answers.values())
        assert outcomes[CancelOutcome.CANCELLED] > 0  # the race really was run both ways
        assert outcomes[CancelOutcome.ALREADY_DELIVERED] > 0


async def test_cancel_waits_for_an_in_flight_batch_that_succeeds(tmp_path, clock):
    hang = trio.Event()
    target = RecordingTarget("slow", hang=hang)
    with Pipeline(str(tmp_path), [target]) as pipeline:
        (message_id,) = pipeline.schedule([T0 + 1000])
        async with pipeline.running():
            await trio.sleep_until(1.5)
            assert target.calls == 1  # the batch is at the broker, unanswered
            answer = append_tombstone(pipeline, message_id)
            await trio.sleep(3)
            assert not answer.decided  # never "maybe": it waits for the outcome
            hang.set()
            await pipeline.delivery.canceller.wait(answer)
        assert answer.outcome is CancelOutcome.ALREADY_DELIVERED
        assert answer.dispatched_ms == T0 + 1000
        assert received_ids([target]) == [message_id]
        assert kinds(str(tmp_path))[EntryKind.DISPATCHED] == 1


async def test_cancel_of_an_in_flight_batch_the_broker_refuses_is_not_retried(tmp_path, clock):
    hang = trio.Event()
    target = RecordingTarget("slow", hang=hang, refuse=ResultCode.BUSY)
    with Pipeline(str(tmp_path), [target]) as pipeline:
        doomed, other = pipeline.schedule([T0 + 1000, T0 + 1000])
        async with pipeline.running():
            await trio.sleep_until(1.5)
            answer = append_tombstone(pipeline, doomed)
            await trio.sleep(1)
            assert not answer.decided
            hang.set()  # the batch in flight is refused: stored nowhere
            await pipeline.delivery.canceller.wait(answer)
            target.hang, target.refuse = None, None  # from now on it stores
            await trio.sleep(10)  # the other message is retried and delivered; not doomed
            await pipeline.stop()
        assert answer.outcome is CancelOutcome.CANCELLED
        assert received_ids([target]) == [other]
        counted = kinds(str(tmp_path))
        assert counted[EntryKind.CANCELLED] == 1 and counted[EntryKind.DISPATCHED] == 1


async def test_cancel_after_delivery_names_the_dispatch_time(tmp_path, clock):
    target = RecordingTarget("a")
    with Pipeline(str(tmp_path), [target]) as pipeline:
        (message_id,) = pipeline.schedule([T0 + 2000])
        async with pipeline.running():
            await trio.sleep(5)
            answer = await cancel(pipeline, message_id)
        assert answer.outcome is CancelOutcome.ALREADY_DELIVERED
        assert answer.dispatched_ms == T0 + 2000


@pytest.mark.parametrize(
    ("old_ms", "new_ms"),
    [
        (30_000, 5 * MINUTE + 123),  # later, across buckets, beyond the load window
        (10 * MINUTE, 20_000),  # earlier: from a bucket not loaded into the wheel's
        (30_000, 45_000),  # later, within the same loaded bucket
    ],
)
async def test_reschedule_delivers_once_at_the_new_time(tmp_path, clock, old_ms, new_ms):
    target = RecordingTarget("a")
    with Pipeline(str(tmp_path), [target]) as pipeline:
        (message_id,) = pipeline.schedule([T0 + old_ms])
        async with pipeline.running():
            await trio.sleep(5)
            answer = await reschedule(pipeline, message_id, T0 + new_ms)
            assert answer.outcome is RescheduleOutcome.RESCHEDULED
            await trio.sleep_until((max(old_ms, new_ms) + 3 * MINUTE) / 1000)
            await pipeline.stop()
        assert [r.message.message_id for r in target.received] == [message_id]
        (got,) = target.received
        assert got.at_ms == T0 + new_ms and got.message.due_ms == T0 + new_ms
        assert got.message.body == message_id.encode()  # same id, same body
        counted = kinds(str(tmp_path))
        assert counted[EntryKind.RESCHEDULED] == 1 and counted[EntryKind.DISPATCHED] == 1


async def test_reschedule_twice_then_cancel(tmp_path, clock):
    target = RecordingTarget("a")
    with Pipeline(str(tmp_path), [target]) as pipeline:
        (message_id,) = pipeline.schedule([T0 + 30_000])
        async with pipeline.running():
            await trio.sleep(1)
            assert (await reschedule(pipeline, message_id, T0 + 50_000)).outcome is (
                RescheduleOutcome.RESCHEDULED
            )
            assert (await reschedule(pipeline, message_id, T0 + 3 * MINUTE)).outcome is (
                RescheduleOutcome.RESCHEDULED
            )
            assert (await cancel(pipeline, message_id)).outcome is CancelOutcome.CANCELLED
            again = await reschedule(pipeline, message_id, T0 + 4 * MINUTE)
            assert again.outcome is RescheduleOutcome.UNKNOWN  # nothing pending to move
            await trio.sleep_until(6 * MINUTE / 1000)
            await pipeline.stop()
        assert target.received == []
        counted = kinds(str(tmp_path))
        assert counted[EntryKind.RESCHEDULED] == 2 and counted[EntryKind.CANCELLED] == 1


async def test_reschedule_of_a_delivered_message(tmp_path, clock):
    target = RecordingTarget("a")
    with Pipeline(str(tmp_path), [target]) as pipeline:
        (message_id,) = pipeline.schedule([T0 + 1000])
        async with pipeline.running():
            await trio.sleep(3)
            answer = await reschedule(pipeline, message_id, T0 + MINUTE)
            await trio.sleep(90)
        assert answer.outcome is RescheduleOutcome.ALREADY_DELIVERED
        assert answer.dispatched_ms == T0 + 1000
        assert received_ids([target]) == [message_id]  # once: not again at the new time


async def test_a_restart_keeps_cancels_and_moves(tmp_path, clock):
    """Tombstones past the replay checkpoint are replayed again on restart, before
    delivery: same answers, nothing delivered that was cancelled, the moved message
    delivered once, at its new time."""
    target = RecordingTarget("a")
    with Pipeline(str(tmp_path), [target]) as pipeline:
        pipeline.replayer.checkpoint_interval_s = 3600.0
        doomed, moved, kept = pipeline.schedule([T0 + 3 * MINUTE, T0 + 3 * MINUTE, T0 + 4 * MINUTE])
        async with pipeline.running():
            assert (await cancel(pipeline, doomed)).outcome is CancelOutcome.CANCELLED
            answer = await reschedule(pipeline, moved, T0 + 5 * MINUTE + 7)
            assert answer.outcome is RescheduleOutcome.RESCHEDULED
        checkpointed = pipeline.replayer.checkpointed_position
    # Closed without a checkpoint: the tombstones are replayed again.
    assert checkpointed < pipeline.log.end_offset

    second = RecordingTarget("a")
    with Pipeline(str(tmp_path), [second]) as again:
        await trio.sleep_until(1)
        await again.run_until(T0 + 7 * MINUTE)
        assert sorted((r.message.message_id, r.at_ms) for r in second.received) == sorted(
            [(kept, T0 + 4 * MINUTE), (moved, T0 + 5 * MINUTE + 7)]
        )
        assert again.delivery.canceller.cancels[CancelOutcome.CANCELLED] == 1  # replayed


async def test_a_restart_mid_bucket_answers_from_the_entries_the_loader_skips(
    tmp_path, clock, monkeypatch
):
    """After a restart the loader skips the offsets its bucket's dispatch_log lists.
    A cancel or reschedule of one of them, arriving while the loader is in the middle
    of that bucket and has not reached it, is answered from its entry: delivered by the
    previous run → ALREADY_DELIVERED; cancelled by it → a reschedule must not bring it
    back (UNKNOWN), and it is never delivered."""
    target = RecordingTarget("a")
    with Pipeline(str(tmp_path), [target]) as pipeline:
        # One bucket [T0, T0 + 1 min): the first record is pending, the others are settled
        # in the first run.
        first, delivered, cancelled = pipeline.schedule([T0 + 50_000, T0 + 5000, T0 + 55_000])
        async with pipeline.running():
            await trio.sleep_until(10)
            assert (await cancel(pipeline, cancelled)).outcome is CancelOutcome.CANCELLED
            await pipeline.stop()
        assert received_ids([target]) == [delivered]

    # The second run loads the bucket one record per worker-thread chunk, and the
    # chunks after the first wait for the gate: the loader stops mid-bucket.
    monkeypatch.setattr("delayd.wheel.manager.INLINE_READ_BYTES", 0)
    monkeypatch.setattr("delayd.wheel.manager.LOAD_CHUNK_RECORDS", 1)
    gate, blocked = threading.Event(), threading.Event()
    second = RecordingTarget("a")
    with Pipeline(str(tmp_path), [second]) as again:
        scan = again.delivery.manager.reader.scan_dues

        def gated_scan(bucket_ms, position, end, limit):
            if position > 0:
                blocked.set()
                gate.wait(30)
            return scan(bucket_ms, position, end, limit)

        again.delivery.manager.reader.scan_dues = gated_scan
        await trio.sleep_until(12)
        async with again.running():
            try:
                while not blocked.is_set():
                    await trio.sleep(0.01)
                cursors = again.delivery.manager.cursors
                assert cursors.loading.bucket_ms == T0 and cursors.loaded.offset > 0
                assert not cursors.complete
                with trio.fail_after(30):
                    answer = await cancel(again, delivered)
                    moved = await reschedule(again, cancelled, T0 + 90_000)
            finally:
                gate.set()
            await trio.sleep_until(3 * MINUTE / 1000)
            await again.stop()
        assert answer.outcome is CancelOutcome.ALREADY_DELIVERED
        assert answer.dispatched_ms == T0 + 5000
        assert moved.outcome is RescheduleOutcome.UNKNOWN
        assert received_ids([second]) == [first]  # not the delivered one, not the cancelled
        counted = kinds(str(tmp_path))
        assert counted[EntryKind.RESCHEDULED] == 0 and counted[EntryKind.DISPATCHED] == 2


async def test_a_cancel_while_an_acknowledged_batch_waits_for_the_dispatch_lock(tmp_path, clock):
    """The broker acknowledged the batch; before the sender could take the dispatch
    lock to record it, a cancel took the lock. The message is not withdrawable: it
    was acknowledged, so the answer is ALREADY_DELIVERED."""
    hang = trio.Event()
    target = RecordingTarget("slow", hang=hang)
    with Pipeline(str(tmp_path), [target]) as pipeline:
        (message_id,) = pipeline.schedule([T0 + 1000])
        lock = pipeline.delivery.dispatch_lock
        async with pipeline.running():
            await trio.sleep_until(1.5)
            assert target.calls == 1
            async with lock:
                answer = append_tombstone(pipeline, message_id)
                await wait_for(lambda: lock.statistics().tasks_waiting == 1)  # the canceller
                hang.set()  # acknowledged; the sender queues for the lock behind it
                await wait_for(lambda: lock.statistics().tasks_waiting == 2)
            await pipeline.delivery.canceller.wait(answer)
            await trio.sleep(5)
            await pipeline.stop()
        assert answer.outcome is CancelOutcome.ALREADY_DELIVERED
        assert answer.dispatched_ms == T0 + 1000
        assert received_ids([target]) == [message_id]
        counted = kinds(str(tmp_path))
        assert counted[EntryKind.DISPATCHED] == 1 and counted[EntryKind.CANCELLED] == 0


async def deliver_then_lose_the_entries(data: str, dues: list[int], until_ms: int):
    """A first run delivers ``dues`` (those due by ``until_ms``) to a deduping broker;
    then its dispatch_log is lost. Returns (ids, the broker)."""
    broker = DedupingTarget("a")
    with Pipeline(data, [broker]) as pipeline:
        ids = pipeline.schedule(dues)
        await pipeline.run_until(until_ms)
    lose_dispatch_log(data)
    return ids, broker


async def test_a_restart_that_lost_dispatch_entries_answers_from_the_resend(tmp_path, clock):
    """The first run delivered two messages but its dispatch_log entries were lost: the
    restart sends them again (the broker answers DUPLICATE; consumers saw them once).
    Tombstones replayed on restart, before delivery starts, find no entry: the messages
    are in doubt from the earlier run, so they are not withdrawn — the answers wait
    for the resend: ALREADY_DELIVERED. A third message, due while the server was down
    and never sent, is in the same doubt: it is delivered now, and the cancel says so."""
    data = str(tmp_path)
    (first, moved, overdue), broker = await deliver_then_lose_the_entries(
        data, [T0 + 1000, T0 + 2000, T0 + 7000], until_ms=T0 + 5000
    )
    assert received_ids([broker]) == [first, moved]

    with Pipeline(data, [DedupingTarget("a", stored=broker.stored)]) as again:
        (target,) = again.targets
        await trio.sleep_until(8)
        answers = [
            append_tombstone(again, first),
            append_tombstone(again, moved, T0 + 4 * MINUTE),
            append_tombstone(again, overdue),
        ]
        async with again.running():
            with trio.fail_after(30):
                for answer in answers:
                    await again.delivery.canceller.wait(answer)
            await trio.sleep_until(6 * MINUTE / 1000)
            await again.stop()
        assert [a.outcome for a in answers] == [
            CancelOutcome.ALREADY_DELIVERED,
            RescheduleOutcome.ALREADY_DELIVERED,
            CancelOutcome.ALREADY_DELIVERED,
        ]
        for answer in answers:  # the resend's time: the earlier copy was delivered before it
            assert T0 + 8000 <= answer.dispatched_ms < T0 + 9000
        assert target.duplicates == 2
        assert received_ids([broker, target]) == [first, moved, overdue]  # each once
        counted = kinds(data)
        assert counted[EntryKind.DISPATCHED] == 3
        assert counted[EntryKind.CANCELLED] == counted[EntryKind.RESCHEDULED] == 0


@pytest.mark.parametrize("is_cancel", [True, False])
async def test_a_restart_that_lost_dispatch_entries_keeps_a_held_message_in_doubt(
    tmp_path, clock, is_cancel
):
    """As above, with the cancel (or reschedule) arriving after delivery started: the
    message waits in the sender's queue behind a batch in flight, not yet sent by this
    run — but maybe by the last one. It is not withdrawn; it is sent, and the answer is
    ALREADY_DELIVERED."""
    data = str(tmp_path)
    (_, second), broker = await deliver_then_lose_the_entries(
        data, [T0 + 1000, T0 + 2000], until_ms=T0 + 5000
    )
    hang = trio.Event()
    target = DedupingTarget("a", stored=broker.stored, hang=hang)
    with Pipeline(data, [target], sender=SenderConfig(max_batch=1, batches_in_flight=1)) as again:
        await trio.sleep_until(8)
        async with again.running():
            sender = again.delivery.sender
            await wait_for(lambda: target.calls == 1 and sender.in_flight == 2)  # second: queued
            answer = append_tombstone(again, second, None if is_cancel else T0 + 4 * MINUTE)
            await trio.sleep(1)
            assert not answer.decided  # never "maybe": it waits for the send
            hang.set()
            with trio.fail_after(30):
                await again.delivery.canceller.wait(answer)
            await trio.sleep_until(6 * MINUTE / 1000)
            await again.stop()
        delivered = CancelOutcome if is_cancel else RescheduleOutcome
        assert answer.outcome is delivered.ALREADY_DELIVERED
        assert answer.dispatched_ms >= T0 + 8000
        assert target.received == [] and target.duplicates == 2
        assert kinds(data)[EntryKind.DISPATCHED] == 2


async def test_a_cancel_answered_before_a_restart_stays_cancelled_once_due(tmp_path, clock):
    """The other side of the doubt: a message cancelled (and answered) while it was
    pending, whose due time passed while the server was down, is found CANCELLED by
    the replayed tombstone (its entry was durable before the answer) — not sent."""
    target = RecordingTarget("a")
    with Pipeline(str(tmp_path), [target]) as pipeline:
        pipeline.replayer.checkpoint_interval_s = 3600.0  # the tombstone is replayed again
        (doomed,) = pipeline.schedule([T0 + 7000])
        async with pipeline.running():
            assert (await cancel(pipeline, doomed)).outcome is CancelOutcome.CANCELLED

    second = RecordingTarget("a")
    with Pipeline(str(tmp_path), [second]) as again:
        await trio.sleep_until(10)
        async with again.running():
            with trio.fail_after(30):  # a wrong turn waits for a send that never comes
                answer = await cancel(again, doomed)
            await trio.sleep_until(3 * MINUTE / 1000)
            await again.stop()
        assert answer.outcome is CancelOutcome.CANCELLED
        assert again.delivery.canceller.cancels[CancelOutcome.CANCELLED] == 2  # replayed, new
        assert second.received == [] and target.received == []


async def test_an_answer_names_the_buckets_whose_entries_decide_it(tmp_path, clock):
    """What a group member's answer waits for the group to have (docs/replication.md,
    "Wiring"): the dispatch_log buckets of the record acted on and of the copy a
    reschedule appended — not every bucket, and none for an unknown id."""
    with Pipeline(str(tmp_path), [RecordingTarget("a")]) as pipeline:
        doomed, moved, refused = pipeline.schedule(
            [T0 + 10 * MINUTE + 5, T0 + 11 * MINUTE + 5, T0 + 1000]
        )
        async with pipeline.running():
            await trio.sleep(2)  # ``refused`` is delivered
            cancelled = await cancel(pipeline, doomed)
            assert cancelled.outcome is CancelOutcome.CANCELLED
            assert cancelled.buckets == {T0 + 10 * MINUTE}
            rescheduled = await reschedule(pipeline, moved, T0 + 20 * MINUTE)
            assert rescheduled.outcome is RescheduleOutcome.RESCHEDULED
            assert rescheduled.buckets == {T0 + 11 * MINUTE, T0 + 20 * MINUTE}
            late = await reschedule(pipeline, refused, T0 + 30 * MINUTE)
            assert late.outcome is RescheduleOutcome.ALREADY_DELIVERED
            assert late.buckets == {T0, T0 + 30 * MINUTE}  # its entry, the void copy's
            unknown = await cancel(pipeline, "nobody")
            assert unknown.outcome is CancelOutcome.UNKNOWN and unknown.buckets == set()
            await pipeline.stop()
