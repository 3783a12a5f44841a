"""Cancel and reschedule in-process on trio's clock (docs/cancel.md): before the bucket
is loaded, in the wheel, in the due millisecond, in a send batch that is in flight
(answered or refused), unknown ids; reschedule earlier, later, across buckets, of a
delivered or cancelled message. Real message_log, replayer, id index, schedule_log,
dispatch_log, wheel and sender; in-memory broker targets."""

from __future__ import annotations

from collections import Counter

import pytest
import trio
import trio.testing

from delayd.logs import tombstone
from delayd.logs.dispatch_log import EntryKind
from delayd.protocol.codes import CancelOutcome, RescheduleOutcome, ResultCode
from delayd.server.cancels import Answer
from tests.delivery_pipeline import T0, Pipeline, RecordingTarget, dispatch_entries, received_ids

MINUTE = 60_000


@pytest.fixture
def clock():
    """As tests/test_delivery_pipeline.py: jump only after 50 ms of real idleness."""
    return trio.testing.MockClock(autojump_threshold=0.05)


def append_tombstone(pipeline: Pipeline, message_id: str, due_ms: int | None = None) -> Answer:
    """What the intake path does for CANCEL / RESCHEDULE: a durable tombstone."""
    stone = tombstone.Tombstone(message_id, pipeline.now_ms(), due_ms)
    (offset,) = pipeline.log.append_batch([tombstone.encode(stone)], stone.rtype)
    pipeline.log.flush()
    answer = pipeline.delivery.canceller.expect(offset, is_cancel=stone.is_cancel)
    pipeline.replayer.notify(0)
    return answer


async def cancel(pipeline: Pipeline, message_id: str) -> Answer:
    return await pipeline.delivery.canceller.wait(append_tombstone(pipeline, message_id))


async def reschedule(pipeline: Pipeline, message_id: str, due_ms: int) -> Answer:
    answer = append_tombstone(pipeline, message_id, due_ms)
    return await pipeline.delivery.canceller.wait(answer)


def kinds(data: str) -> Counter:
    return Counter(e.kind for es in dispatch_entries(data).values() for e in es)


async def test_cancel_before_the_bucket_is_loaded(tmp_path, clock):
    target = RecordingTarget("a")
    pipeline = Pipeline(str(tmp_path), [target])  # load-ahead: 2 minutes
    doomed, kept = pipeline.schedule([T0 + 10 * MINUTE + 5, T0 + 10 * MINUTE + 6])
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        await trio.sleep(1)
        assert pipeline.delivery.manager.statistics().buckets_loaded == 0
        answer = await cancel(pipeline, doomed)
        assert answer.outcome is CancelOutcome.CANCELLED and answer.dispatched_ms is None
        await trio.sleep_until((12 * MINUTE) / 1000)
        await pipeline.stop()
        stats = pipeline.delivery.manager.statistics()
        nursery.cancel_scope.cancel()
    assert received_ids([target]) == [kept]
    assert stats.entries_skipped == 1  # the loader read the CANCELLED entry
    assert kinds(str(tmp_path))[EntryKind.CANCELLED] == 1
    assert pipeline.delivery.canceller.cancels[CancelOutcome.CANCELLED] == 1
    pipeline.close()


async def test_cancel_while_in_the_wheel_and_again(tmp_path, clock):
    target = RecordingTarget("a")
    pipeline = Pipeline(str(tmp_path), [target])
    doomed, kept = pipeline.schedule([T0 + 30_000, T0 + 30_000])
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        await trio.sleep(5)
        assert len(pipeline.delivery.ticker.wheel) == 2
        assert (await cancel(pipeline, doomed)).outcome is CancelOutcome.CANCELLED
        assert len(pipeline.delivery.ticker.wheel) == 1
        # A second cancel of a cancelled message: still CANCELLED, no second entry.
        assert (await cancel(pipeline, doomed)).outcome is CancelOutcome.CANCELLED
        await trio.sleep_until(2 * MINUTE / 1000 + 1)
        await pipeline.stop()
        outstanding = pipeline.delivery.manager.outstanding
        nursery.cancel_scope.cancel()
    assert received_ids([target]) == [kept]
    assert kinds(str(tmp_path))[EntryKind.CANCELLED] == 1
    assert kinds(str(tmp_path))[EntryKind.COMPLETE] == 1  # the bucket was completed
    assert outstanding == 0
    pipeline.close()


async def test_cancel_of_an_unknown_id(tmp_path, clock):
    pipeline = Pipeline(str(tmp_path), [RecordingTarget("a")])
    pipeline.schedule([T0 + 5000])
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        answer = await cancel(pipeline, "never-sent")
        nursery.cancel_scope.cancel()
    assert answer.outcome is CancelOutcome.UNKNOWN
    assert not any(dispatch_entries(str(tmp_path)).values())
    pipeline.close()


async def test_cancel_in_the_due_millisecond_is_exact(tmp_path, clock):
    """Each message is cancelled in the very millisecond it falls due: whichever way
    the race goes, the answer says what happened — CANCELLED and never received, or
    ALREADY_DELIVERED and received once, at the dispatched_ms the answer names."""
    target = RecordingTarget("a")
    pipeline = Pipeline(str(tmp_path), [target])
    dues = [T0 + 3000 + 37 * i for i in range(40)]
    ids = pipeline.schedule(dues)
    answers: dict[str, Answer] = {}
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        for message_id, due in zip(ids, dues, strict=True):
            await trio.sleep_until(pipeline.delivery.ticker.deadline(due))
            assert pipeline.now_ms() == due
            answers[message_id] = append_tombstone(pipeline, message_id)
        for answer in answers.values():
            await pipeline.delivery.canceller.wait(answer)
        await trio.sleep(2)
        await pipeline.stop()
        nursery.cancel_scope.cancel()
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
    pipeline.close()


async def test_cancel_waits_for_an_in_flight_batch_that_succeeds(tmp_path, clock):
    hang = trio.Event()
    target = RecordingTarget("slow", hang=hang)
    pipeline = Pipeline(str(tmp_path), [target])
    (message_id,) = pipeline.schedule([T0 + 1000])
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        await trio.sleep_until(1.5)
        assert target.calls == 1  # the batch is at the broker, unanswered
        answer = append_tombstone(pipeline, message_id)
        await trio.sleep(3)
        assert not answer.done.is_set()  # never "maybe": it waits for the outcome
        hang.set()
        await pipeline.delivery.canceller.wait(answer)
        nursery.cancel_scope.cancel()
    assert answer.outcome is CancelOutcome.ALREADY_DELIVERED
    assert answer.dispatched_ms == T0 + 1000
    assert received_ids([target]) == [message_id]
    assert kinds(str(tmp_path))[EntryKind.DISPATCHED] == 1
    pipeline.close()


async def test_cancel_of_an_in_flight_batch_the_broker_refuses_is_not_retried(tmp_path, clock):
    hang = trio.Event()
    target = RecordingTarget("slow", hang=hang, refuse=ResultCode.BUSY)
    pipeline = Pipeline(str(tmp_path), [target])
    doomed, other = pipeline.schedule([T0 + 1000, T0 + 1000])
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        await trio.sleep_until(1.5)
        answer = append_tombstone(pipeline, doomed)
        await trio.sleep(1)
        assert not answer.done.is_set()
        hang.set()  # the batch in flight is refused: stored nowhere
        await pipeline.delivery.canceller.wait(answer)
        target.hang, target.refuse = None, None  # from now on it stores
        await trio.sleep(10)  # the other message is retried and delivered; not doomed
        await pipeline.stop()
        nursery.cancel_scope.cancel()
    assert answer.outcome is CancelOutcome.CANCELLED
    assert received_ids([target]) == [other]
    counted = kinds(str(tmp_path))
    assert counted[EntryKind.CANCELLED] == 1 and counted[EntryKind.DISPATCHED] == 1
    pipeline.close()


async def test_cancel_after_delivery_names_the_dispatch_time(tmp_path, clock):
    target = RecordingTarget("a")
    pipeline = Pipeline(str(tmp_path), [target])
    (message_id,) = pipeline.schedule([T0 + 2000])
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        await trio.sleep(5)
        answer = await cancel(pipeline, message_id)
        nursery.cancel_scope.cancel()
    assert answer.outcome is CancelOutcome.ALREADY_DELIVERED
    assert answer.dispatched_ms == T0 + 2000
    pipeline.close()


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
    pipeline = Pipeline(str(tmp_path), [target])
    (message_id,) = pipeline.schedule([T0 + old_ms])
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        await trio.sleep(5)
        answer = await reschedule(pipeline, message_id, T0 + new_ms)
        assert answer.outcome is RescheduleOutcome.RESCHEDULED
        await trio.sleep_until((max(old_ms, new_ms) + 3 * MINUTE) / 1000)
        await pipeline.stop()
        nursery.cancel_scope.cancel()
    assert [r.message.message_id for r in target.received] == [message_id]
    (got,) = target.received
    assert got.at_ms == T0 + new_ms and got.message.due_ms == T0 + new_ms
    assert got.message.body == message_id.encode()  # same id, same body
    counted = kinds(str(tmp_path))
    assert counted[EntryKind.RESCHEDULED] == 1 and counted[EntryKind.DISPATCHED] == 1
    pipeline.close()


async def test_reschedule_twice_then_cancel(tmp_path, clock):
    target = RecordingTarget("a")
    pipeline = Pipeline(str(tmp_path), [target])
    (message_id,) = pipeline.schedule([T0 + 30_000])
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
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
        nursery.cancel_scope.cancel()
    assert target.received == []
    counted = kinds(str(tmp_path))
    assert counted[EntryKind.RESCHEDULED] == 2 and counted[EntryKind.CANCELLED] == 1
    pipeline.close()


async def test_reschedule_of_a_delivered_message(tmp_path, clock):
    target = RecordingTarget("a")
    pipeline = Pipeline(str(tmp_path), [target])
    (message_id,) = pipeline.schedule([T0 + 1000])
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        await trio.sleep(3)
        answer = await reschedule(pipeline, message_id, T0 + MINUTE)
        await trio.sleep(90)
        nursery.cancel_scope.cancel()
    assert answer.outcome is RescheduleOutcome.ALREADY_DELIVERED
    assert answer.dispatched_ms == T0 + 1000
    assert received_ids([target]) == [message_id]  # once: not again at the new time
    pipeline.close()


async def test_a_restart_keeps_cancels_and_moves(tmp_path, clock):
    """Tombstones past the replay checkpoint are replayed again on restart, before
    delivery: same answers, nothing delivered that was cancelled, the moved message
    delivered once, at its new time."""
    target = RecordingTarget("a")
    pipeline = Pipeline(str(tmp_path), [target])
    pipeline.replayer.checkpoint_interval_s = 3600.0
    doomed, moved, kept = pipeline.schedule([T0 + 3 * MINUTE, T0 + 3 * MINUTE, T0 + 4 * MINUTE])
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline.run)
        assert (await cancel(pipeline, doomed)).outcome is CancelOutcome.CANCELLED
        answer = await reschedule(pipeline, moved, T0 + 5 * MINUTE + 7)
        assert answer.outcome is RescheduleOutcome.RESCHEDULED
        nursery.cancel_scope.cancel()
    checkpointed = pipeline.replayer.checkpointed_position
    pipeline.close()  # no checkpoint: the tombstones are replayed again
    assert checkpointed < pipeline.log.end_offset

    second = RecordingTarget("a")
    again = Pipeline(str(tmp_path), [second])
    async with trio.open_nursery() as nursery:
        await trio.sleep_until(1)
        await nursery.start(again.run)
        await trio.sleep_until(7 * MINUTE / 1000)
        await again.stop()
        nursery.cancel_scope.cancel()
    assert sorted((r.message.message_id, r.at_ms) for r in second.received) == sorted(
        [(kept, T0 + 4 * MINUTE), (moved, T0 + 5 * MINUTE + 7)]
    )
    assert again.delivery.canceller.cancels[CancelOutcome.CANCELLED] == 1  # replayed
    again.close()
