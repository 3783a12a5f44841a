"""Delivery in-process on trio's clock: exact firing times from 1 ms to 2 h,
canAdd while a bucket loads, gaps between buckets, restart from dispatch_log, COMPLETE
marks, circuit breaker, retries, dead letters and back-pressure."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import trio
import trio.testing

from delayd.logs.buckets import bucket_name, bucket_of
from delayd.logs.dispatch_log import EntryKind
from delayd.protocol.codes import ResultCode
from delayd.sender.ledger import DEAD_LETTER_REASON, ORIGINAL_SUBJECT
from delayd.sender.retry import RetryPolicy
from delayd.sender.sender import SenderConfig
from tests.delivery_pipeline import (
    T0,
    Pipeline,
    RecordingTarget,
    dispatch_entries,
    dispatched_offsets,
    received_ids,
)

# In-process with recording targets: nothing real to wait for but the store's worker
# threads, which hold virtual time (tests/conftest.py).
pytestmark = pytest.mark.instant_autojump

MINUTE = 60_000


async def test_messages_fire_at_their_exact_virtual_millisecond(tmp_path, clock):
    target = RecordingTarget("a")
    with Pipeline(str(tmp_path), [target]) as pipeline:
        offsets_ms = [
            1,
            2,
            5,
            17,
            100,
            999,
            1000,
            59_999,
            60_000,
            61_234,
            600_000,
            3_600_000,
            7_200_000,
        ]
        dues = {T0 + d for d in offsets_ms}
        ids = pipeline.schedule(sorted(dues))
        await pipeline.run_until(T0 + 7_200_000 + 2 * MINUTE)
        got = {r.message.message_id: r for r in target.received}
        assert sorted(got) == sorted(ids)
        for r in target.received:
            m = r.message
            assert m.dispatched_ms == m.due_ms  # to the millisecond, never early
            assert r.at_ms == m.due_ms
        # Each schedule_log record has exactly one DISPATCHED entry, and every bucket whose
        # time has passed is marked COMPLETE.
        entries = dispatch_entries(str(tmp_path))
        kinds = Counter(e.kind for es in entries.values() for e in es)
        assert kinds[EntryKind.DISPATCHED] == len(ids)
        assert sorted(entries) == sorted({bucket_name(bucket_of(d, 1)) for d in dues})
        for name, es in entries.items():
            assert es[-1].kind is EntryKind.COMPLETE, name


async def test_past_due_messages_fire_at_once(tmp_path, clock):
    target = RecordingTarget("a")
    with Pipeline(str(tmp_path), [target]) as pipeline:
        async with pipeline.running():
            await trio.sleep(5)
            now = pipeline.now_ms()
            ids = pipeline.schedule([now - 3000, now - 10, now])
            await trio.sleep(0.5)
            assert sorted(received_ids([target])) == sorted(ids)
            assert all(r.at_ms - now <= 5 for r in target.received)  # replay + wheel, virtual


async def test_gaps_and_appends_to_the_bucket_being_loaded(tmp_path, clock):
    """Buckets with empty minutes between them, and a bucket large enough to be loaded
    in chunks from a worker thread, to which the replayer appends while the loader is
    in the middle of it: every message fires exactly once, at its time."""
    target = RecordingTarget("a")
    with Pipeline(str(tmp_path), [target], load_ahead_ms=2 * MINUTE) as pipeline:
        big = T0 + 3 * MINUTE + 30_000
        first = pipeline.schedule([T0 + 10_000, T0 + 7 * MINUTE])  # gap: minutes 1..6 empty
        bulk = pipeline.schedule([big + i % 50 for i in range(70_000)])
        manager = pipeline.delivery.manager
        scan = manager.reader.scan_dues
        during: list[str] = []
        loading_end: list[int] = []

        def scan_while_the_replayer_appends(bucket_ms, start, end, max_records):
            in_worker_thread = threading.current_thread() is not threading.main_thread()
            if bucket_ms == bucket_of(big, 1) and in_worker_thread and not during:
                loading_end.append(manager.cursors.loading.offset)

                def accept_and_replay() -> None:  # on trio's thread, as intake + replayer
                    during.extend(pipeline.schedule([big + 5000] * 20))
                    pipeline.replayer.replay_available()

                trio.from_thread.run_sync(accept_and_replay)
            return scan(bucket_ms, start, end, max_records)

        manager.reader.scan_dues = scan_while_the_replayer_appends
        expected = len(first) + len(bulk) + 20
        await pipeline.run_until(T0 + 8 * MINUTE, lambda: len(target.received) >= expected)
        assert manager.entries_added == 20  # canAdd took exactly the appended ones
        assert manager.reader.size(bucket_of(big, 1)) > loading_end[0]
        counts = Counter(received_ids([target]))
        assert set(counts) == set(first + bulk + during)
        assert max(counts.values()) == 1
        assert all(r.message.dispatched_ms >= r.message.due_ms for r in target.received)
        assert Counter(dispatched_offsets(str(tmp_path))).most_common(1)[0][1] == 1


async def test_restart_loads_only_what_dispatch_log_does_not_list(tmp_path, clock):
    target = RecordingTarget("a")
    with Pipeline(str(tmp_path), [target]) as pipeline:
        early = pipeline.schedule([T0 + 1000 + i for i in range(50)])
        late = pipeline.schedule([T0 + 30_000 + i for i in range(50)])  # same bucket
        await pipeline.run_until(T0 + 10_000)
    assert sorted(received_ids([target])) == sorted(early)

    # Restart: "now" is still in the bucket; only the 50 late ones are loaded.
    second = RecordingTarget("a")
    with Pipeline(str(tmp_path), [second]) as again:
        await trio.sleep_until(10)
        async with again.running():
            await trio.sleep_until(2 * MINUTE / 1000)
            await again.stop()
            stats = again.delivery.manager.statistics()
        assert sorted(received_ids([second])) == sorted(late)
        assert stats.entries_skipped == 50 and stats.entries_loaded == 50

    def complete_marks() -> int:
        entries = dispatch_entries(str(tmp_path))[bucket_name(bucket_of(T0, 1))]
        return sum(entry.kind is EntryKind.COMPLETE for entry in entries)

    assert complete_marks() == 1
    # A third start finds the bucket COMPLETE, reads none of it and does not mark it
    # again (each restart used to append one more COMPLETE to every bucket on disk).
    with Pipeline(str(tmp_path), [RecordingTarget("a")]) as third:
        await trio.sleep_until(3 * MINUTE / 1000)
        async with third.running():
            await trio.sleep(1)
            stats = third.delivery.manager.statistics()
            await third.stop()
        assert stats.entries_loaded == 0 and stats.buckets_loaded == 1
        assert third.targets[0].received == []
        assert complete_marks() == 1


async def test_a_dead_group_opens_its_circuit_and_the_other_delivers(tmp_path, clock):
    dead, alive = RecordingTarget("dead", unavailable=True), RecordingTarget("alive")
    config = SenderConfig(failure_threshold=2, open_ms=1000, retry=RetryPolicy(base_ms=10))
    with Pipeline(str(tmp_path), [dead, alive], sender=config) as pipeline:
        ids = pipeline.schedule([T0 + 1000 + 100 * (i // 4) for i in range(100)])
        async with pipeline.running():
            await trio.sleep_until(6)
            stats = {g.name: g for g in pipeline.delivery.sender.group_statistics()}
            # The dead group saw its first failures, then (open, half-open probes) little.
            assert stats["dead"].failed >= 2
            assert dead.calls < 10
            assert stats["dead"].sent == 0
            # Revive it: the next probe closes the circuit and it takes traffic again.
            dead.unavailable = False
            more = pipeline.schedule([T0 + 60_000 + i for i in range(200)])
            await trio.sleep_until(70)
            await pipeline.stop()
            stats = {g.name: g for g in pipeline.delivery.sender.group_statistics()}
        counts = Counter(received_ids([dead, alive]))
        assert set(counts) == set(ids + more) and max(counts.values()) == 1
        assert stats["dead"].sent > 0  # closed again and used
        assert int(stats["dead"].circuit) == 0
        late = [r for t in (dead, alive) for r in t.received if r.message.message_id in ids]
        assert all(r.message.dispatched_ms >= r.message.due_ms for r in late)


async def test_refused_messages_are_dead_lettered_after_max_attempts(tmp_path, clock):
    target = RecordingTarget("a", refuse=ResultCode.BODY_TOO_LARGE)
    config = SenderConfig(retry=RetryPolicy(max_attempts=3, base_ms=10, max_ms=100))
    with Pipeline(str(tmp_path), [target], sender=config) as pipeline:
        ids = pipeline.schedule([T0 + 1000])
        async with pipeline.running():
            await trio.sleep_until(2)
            # Three refused sends, then the dead-letter subject (refused too, still retried).
            assert target.subjects[:4] == ["orders"] * 3 + ["DLQ.orders"]
            assert set(target.subjects[3:]) == {"DLQ.orders"}
            target.refuse = None
            await trio.sleep_until(3)
            await pipeline.stop()
        [got] = target.received
        assert got.message.message_id == ids[0]
        assert got.message.subject == "DLQ.orders"
        assert got.message.properties[ORIGINAL_SUBJECT] == "orders"
        assert "BODY_TOO_LARGE" in got.message.properties[DEAD_LETTER_REASON]
        kinds = [e.kind for es in dispatch_entries(str(tmp_path)).values() for e in es]
        assert kinds == [EntryKind.ROUTE, EntryKind.DEAD_LETTERED]  # the bucket's route set first
        stats = pipeline.delivery.sender.group_statistics()[0]
        assert stats.dead_lettered == 1 and stats.sent == 0


async def test_a_hung_broker_bounds_what_the_sender_holds(tmp_path, clock):
    hang = trio.Event()
    target = RecordingTarget("a", hang=hang)
    config = SenderConfig(max_batch=50, max_in_flight=200, batches_in_flight=2)
    with Pipeline(str(tmp_path), [target], sender=config) as pipeline:
        ids = pipeline.schedule([T0 + 1000] * 5000)
        async with pipeline.running():
            await trio.sleep_until(5)
            sender = pipeline.delivery.sender
            # Messages read back from schedule_log stop at the bound; the rest stay compact
            # wheel entries (in the wheel, or released and waiting in on_due).
            assert 0 < sender.in_flight <= 200
            assert target.calls == 2  # batches_in_flight sends are out, hung
            assert target.received == []
            hang.set()
            await trio.sleep_until(10)
            await pipeline.stop()
        assert Counter(received_ids([target])) == Counter(ids)


@pytest.mark.parametrize("scale", [1, 5])
async def test_key_affinity_keeps_a_key_on_one_group(tmp_path, clock, scale):
    a, b = RecordingTarget("a"), RecordingTarget("b")
    with Pipeline(str(tmp_path), [a, b], segment_scale_minutes=scale) as pipeline:
        ids = pipeline.schedule([T0 + 100 * i for i in range(1, 100)], key="order-42")
        await pipeline.run_until(T0 + 20_000)
        assert sorted(received_ids([a, b])) == sorted(ids)
        assert {len(a.received), len(b.received)} == {0, len(ids)}


async def test_a_half_open_group_waits_for_its_probe_and_logs_the_transitions(
    tmp_path, clock, caplog
):
    # One group, max_batch 2: after its circuit opened, the probe takes two messages
    # and the group loop, with more queued, waits for the probe's answer — on an event,
    # not polling the breaker every millisecond while the probe hangs.
    target = RecordingTarget("a", unavailable=True)
    config = SenderConfig(
        max_batch=2, failure_threshold=1, open_ms=1000, retry=RetryPolicy(base_ms=10)
    )
    with Pipeline(str(tmp_path), [target], sender=config) as pipeline:
        first = pipeline.schedule([T0 + 100])
        group = pipeline.delivery.sender._groups["a"]
        allowed = []
        allow = group.breaker.allow
        group.breaker.allow = lambda now_ms: allowed.append(now_ms) or allow(now_ms)
        caplog.set_level("INFO", logger="delayd.sender.sender")
        async with pipeline.running():
            await trio.sleep_until(0.5)  # the first send failed: open until ~T0 + 1100
            assert target.calls == 1 and int(group.breaker.state(pipeline.now_ms())) == 2
            target.unavailable = False
            target.hang = trio.Event()
            rest = pipeline.schedule([T0 + 600] * 5)
            await trio.sleep_until(1.3)  # half-open since ~1.1 s: the probe is out, hanging
            assert target.calls == 2 and group.breaker.probe_in_flight
            calls_before = len(allowed)
            await trio.sleep_until(3.3)  # two seconds of a hanging probe
            assert len(allowed) - calls_before <= 1
            target.hang.set()
            target.hang = None
            await trio.sleep_until(3.5)
            await pipeline.stop()
        counts = Counter(received_ids([target]))
        assert set(counts) == set(first + rest) and max(counts.values()) == 1
        assert int(group.breaker.state(pipeline.now_ms())) == 0
        messages = [r.getMessage() for r in caplog.records]
        opened = [m for m in messages if "circuit open" in m]
        assert opened and "broker group a" in opened[0] and "a is down (test)" in opened[0]
        assert any("broker group a: circuit half-open" in m for m in messages)
        assert any(
            "broker group a: circuit closed: the probe batch succeeded" in m for m in messages
        )
        levels = {r.levelname for r in caplog.records if "circuit open" in r.getMessage()}
        assert levels == {"WARNING"}


async def test_a_failed_probe_reopens_the_circuit_and_says_so(tmp_path, clock, caplog):
    target = RecordingTarget("a", unavailable=True)
    config = SenderConfig(failure_threshold=2, open_ms=200, retry=RetryPolicy(base_ms=10))
    with Pipeline(str(tmp_path), [target], sender=config) as pipeline:
        ids = pipeline.schedule([T0 + 100, T0 + 100, T0 + 101])
        caplog.set_level("INFO", logger="delayd.sender.sender")
        async with pipeline.running():
            await trio.sleep_until(0.7)  # opened, probe failed at least once
            target.unavailable = False
            await trio.sleep_until(3)
            await pipeline.stop()
        assert sorted(received_ids([target])) == sorted(ids)
        messages = [r.getMessage() for r in caplog.records]
        assert any("failed in a row" in m for m in messages)  # closed -> open
        assert any("circuit open" in m and "the probe batch failed" in m for m in messages)
        assert any("circuit closed" in m for m in messages)


async def test_an_idle_leaders_complete_marks_become_durable_without_a_delivery(tmp_path, clock):
    """The wheel's COMPLETE mark is written after the bucket's last delivery was
    flushed: the sender must flush it too, or an idle leader keeps it in its page cache
    and its followers (which copy durable records only) lack it."""
    target = RecordingTarget("a")
    with Pipeline(str(tmp_path), [target]) as pipeline:
        pipeline.schedule([T0 + 1000])
        async with pipeline.running():
            await trio.sleep(3 * MINUTE / 1000)  # the bucket passed; nothing else to do
            assert pipeline.delivery.manager.buckets_completed == 1
            assert not pipeline.delivery.dispatch.dirty
        (entries,) = dispatch_entries(str(tmp_path)).values()
        assert entries[-1].kind is EntryKind.COMPLETE
