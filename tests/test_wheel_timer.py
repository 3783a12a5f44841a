"""The timing wheel (delayd.wheel.timer): exact release against a sorted-list model,
tick and round boundaries, overflow rounds, past-due entries, removal, bytes per entry,
and the trio ticker on a virtual clock (fires at the exact ms, sleeps while idle)."""

from __future__ import annotations

import math
import time
import tracemalloc

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from delayd.wheel import DueEntries, Ticker, TimingWheel, pack_ref, unpack_ref
from delayd.wheel.timer import ENTRY_BYTES, MAX_BUCKET, MAX_OFFSET

T0 = 1_795_341_600_000  # 2026-11-22T10:00:00Z, epoch ms
HOUR = 3_600_000
TWO_YEARS = 2 * 365 * 24 * HOUR


def fired(entries: DueEntries) -> list[tuple[int, int, int]]:
    return list(entries)


# ---------------------------------------------------------------------- the model


class WheelAgainstModel(RuleBasedStateMachine):
    """Random adds, expires (forwards, backwards, across many rounds), removes and
    next_due queries against a list of pending entries.

    Every expire must return exactly the pending entries with due_ms <= now_ms, sorted
    by due_ms with ties in insertion order. Hence every entry fires exactly once, never
    before its due_ms, and at the first expire with now_ms >= due_ms.
    """

    @initialize(
        start=st.integers(0, 10**7),
        tick_ms=st.sampled_from([1, 2, 7, 500]),
        slots=st.sampled_from([1, 2, 3, 8, 64]),
    )
    def start(self, start, tick_ms, slots):
        self.wheel = TimingWheel(start, tick_ms=tick_ms, slots=slots)
        self.span = tick_ms * slots
        self.now = start
        self.pending: list[tuple[int, int, int]] = []
        self.gone: list[tuple[int, int, int]] = []  # fired or removed
        self.next_offset = 0

    def _add(self, due_ms, bucket):
        entry = (max(0, due_ms), bucket, self.next_offset)
        self.next_offset += 1
        self.wheel.add(*entry)
        self.pending.append(entry)

    @rule(
        delay=st.one_of(
            st.integers(-3_000, 3_000),  # around now, including the past
            st.integers(0, 20).map(lambda k: k * 500),  # on tick / round boundaries
            st.integers(0, 200_000),  # several rounds out
            st.integers(0, TWO_YEARS),  # far overflow
        ),
        bucket=st.integers(0, 3),
    )
    def add(self, delay, bucket):
        self._add(self.now + delay, bucket)

    @rule(bucket=st.integers(0, 3), copies=st.integers(2, 5), delay=st.integers(-10, 5_000))
    def add_same_due(self, bucket, copies, delay):
        for _ in range(copies):
            self._add(self.now + delay, bucket)

    @rule(
        step=st.one_of(
            st.integers(-50, 0),  # the clock went back, or did not move
            st.integers(0, 1_100),
            st.sampled_from([1, 499, 500, 501, 999, 1_000]),
            st.integers(0, 300_000),
            st.integers(0, TWO_YEARS + 10**6),
        )
    )
    def expire(self, step):
        now = max(0, self.now + step)
        got = self.wheel.expire(now)
        assert isinstance(got, DueEntries)
        expected = sorted((e for e in self.pending if e[0] <= now), key=lambda e: e[0])
        assert fired(got) == expected
        self.pending = [e for e in self.pending if e[0] > now]
        self.gone.extend(expected)
        self.now = max(self.now, now) if step >= 0 else now

    @rule(at_next_due=st.just(True))
    def expire_at_next_due(self, at_next_due):
        """What the ticker does: wake at next_due_ms, expire; one ms earlier is too early."""
        next_due = self.wheel.next_due_ms()
        if next_due is None or next_due <= self.now:
            return
        assert fired(self.wheel.expire(next_due - 1)) == []
        got = fired(self.wheel.expire(next_due))
        assert got and all(e[0] == next_due for e in got)
        assert got == [e for e in self.pending if e[0] == next_due]
        self.pending = [e for e in self.pending if e[0] != next_due]
        self.gone.extend(got)
        self.now = next_due

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def remove_pending(self, data):
        entry = data.draw(st.sampled_from(self.pending))
        assert self.wheel.remove(*entry) is True
        self.pending.remove(entry)
        self.gone.append(entry)

    @rule(data=st.data())
    def remove_absent(self, data):
        """Fired, removed, or never added: nothing to remove, nothing changes."""
        choices = [*self.gone, (self.now + 5, 0, 10**9), (self.now + 10**8, 1, 10**9)]
        entry = data.draw(st.sampled_from(choices))
        before = len(self.wheel)
        assert self.wheel.remove(*entry) is False
        assert len(self.wheel) == before

    @invariant()
    def counts_and_next_due(self):
        assert len(self.wheel) == len(self.pending)
        expected = min((e[0] for e in self.pending), default=None)
        assert self.wheel.next_due_ms() == expected
        stats = self.wheel.statistics()
        assert stats.entries == stats.wheel_entries + stats.overflow_entries == len(self.pending)


WheelAgainstModel.TestCase.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None
)
TestWheelAgainstModel = WheelAgainstModel.TestCase


# ---------------------------------------------------------------------- boundaries


@pytest.mark.parametrize("tick_ms", [1, 500])
def test_an_entry_on_a_tick_boundary_fires_at_its_ms_not_one_earlier(tick_ms):
    wheel = TimingWheel(0, tick_ms=tick_ms, slots=4)
    dues = [tick_ms, 2 * tick_ms, 4 * tick_ms, 4 * tick_ms + 1, 9 * tick_ms]  # 4*tick: round 1
    for offset, due in enumerate(dues):
        wheel.add(due, 7, offset)
    for offset, due in enumerate(dues):
        assert fired(wheel.expire(due - 1)) == []
        assert fired(wheel.expire(due)) == [(due, 7, offset)]
    assert len(wheel) == 0


def test_a_coarse_tick_still_releases_each_entry_at_its_own_ms():
    """QMQ fires a whole 500 ms slot at once; here the slot is drained ms by ms."""
    wheel = TimingWheel(0, tick_ms=500, slots=8)
    for offset, due in enumerate([1_400, 1_001, 1_499, 1_000, 1_250]):
        wheel.add(due, 1, offset)
    assert wheel.next_due_ms() == 1_000
    assert fired(wheel.expire(999)) == []
    assert fired(wheel.expire(1_000)) == [(1_000, 1, 3)]
    assert fired(wheel.expire(1_249)) == [(1_001, 1, 1)]
    assert wheel.next_due_ms() == 1_250
    assert fired(wheel.expire(1_499)) == [(1_250, 1, 4), (1_400, 1, 0), (1_499, 1, 2)]


def test_entries_due_at_the_same_ms_come_out_in_the_order_they_were_added():
    wheel = TimingWheel(0, tick_ms=10, slots=4)
    wheel.add(25, 0, 0)
    for offset in range(1, 6):
        wheel.add(21, 0, offset)
    assert fired(wheel.expire(30)) == [(21, 0, k) for k in range(1, 6)] + [(25, 0, 0)]


def test_past_due_entries_fire_on_the_next_expire_even_at_the_same_now():
    wheel = TimingWheel(T0)
    wheel.add(T0 + 50, 0, 0)
    assert fired(wheel.expire(T0 + 10)) == []
    wheel.add(T0 - HOUR, 0, 1)  # already an hour late when added
    wheel.add(T0 + 5, 0, 2)  # late by 5 ms
    assert wheel.next_due_ms() == T0 - HOUR
    assert fired(wheel.expire(T0 + 10)) == [(T0 - HOUR, 0, 1), (T0 + 5, 0, 2)]
    assert fired(wheel.expire(T0 + 50)) == [(T0 + 50, 0, 0)]


def test_far_future_entries_wait_in_overflow_rounds_and_fire_at_their_ms():
    wheel = TimingWheel(T0)
    dues = [T0 + TWO_YEARS, T0 + HOUR, T0 + 3, T0 + wheel.span_ms * 5 + 17]
    for offset, due in enumerate(dues):
        wheel.add(due, 2, offset)
    stats = wheel.statistics()
    assert (stats.wheel_entries, stats.overflow_entries, stats.overflow_rounds) == (1, 3, 3)
    for due in sorted(dues):
        assert wheel.next_due_ms() == due
        assert fired(wheel.expire(due - 1)) == []
        assert [e[0] for e in wheel.expire(due)] == [due]
    assert wheel.next_due_ms() is None
    assert wheel.statistics().overflow_rounds == 0


def test_time_going_back_releases_nothing_early_and_loses_nothing():
    wheel = TimingWheel(0, tick_ms=100, slots=4)
    wheel.add(250, 0, 0)
    wheel.add(260, 0, 1)
    assert fired(wheel.expire(255)) == [(250, 0, 0)]
    assert fired(wheel.expire(100)) == []  # a wall clock stepped back
    wheel.add(150, 0, 2)  # past due at the new time
    assert fired(wheel.expire(150)) == [(150, 0, 2)]
    assert fired(wheel.expire(260)) == [(260, 0, 1)]


def test_a_large_burst_is_handed_over_as_columns():
    wheel = TimingWheel(0)
    for offset in range(10_000):
        wheel.add(5_000, 3, offset)
    got = wheel.expire(5_000)
    assert len(got) == 10_000
    assert got.due_ms.typecode == "q" and got.ref.typecode == "Q"
    assert list(got) == [(5_000, 3, offset) for offset in range(10_000)]


def test_expire_skips_empty_slots_and_rounds_instead_of_scanning_them():
    """A million slots per round and a thousand rounds: a per-tick or per-slot scan would
    touch 10**9 slots (minutes); the ordered sets make this a few ms."""
    slots = 1 << 20
    wheel = TimingWheel(0, slots=slots)
    for k in range(1, 1_001):
        wheel.add(k * slots + k, 0, k)  # one entry in each of a thousand rounds
    started = time.perf_counter()
    released = 0
    now = 0
    while len(wheel):
        now += slots // 3  # three calls per round, most of them with nothing due
        released += len(wheel.expire(now))
    assert released == 1_000
    assert time.perf_counter() - started < 5.0


@given(bucket=st.integers(0, MAX_BUCKET), offset=st.integers(0, MAX_OFFSET))
def test_a_ref_packs_bucket_and_offset_into_64_bits_and_back(bucket, offset):
    ref = pack_ref(bucket, offset)
    assert 0 <= ref < 2**64
    assert unpack_ref(ref) == (bucket, offset)
    wheel = TimingWheel(0)
    wheel.add(1, bucket, offset)
    got = wheel.expire(1)
    assert list(got.ref) == [ref] and list(got) == [(1, bucket, offset)]


# ---------------------------------------------------------------------- removal


def test_remove_finds_an_entry_in_a_slot_in_overflow_and_in_a_half_drained_slot():
    wheel = TimingWheel(0, tick_ms=100, slots=4)
    entries = [(150, 1, 10), (150, 2, 10), (160, 1, 11), (170, 1, 12), (5_000, 1, 13)]
    for entry in entries:
        wheel.add(*entry)
    assert wheel.remove(150, 2, 10) is True  # same due and offset as another: bucket decides
    assert wheel.remove(150, 2, 10) is False
    assert wheel.remove(5_000, 1, 13) is True  # overflow
    assert wheel.statistics().overflow_rounds == 0
    assert fired(wheel.expire(150)) == [(150, 1, 10)]  # the head slot is now half drained
    assert wheel.remove(150, 1, 10) is False  # already fired
    assert wheel.remove(170, 1, 12) is True
    assert len(wheel) == 1 and wheel.next_due_ms() == 160
    assert fired(wheel.expire(10_000)) == [(160, 1, 11)]


def test_removing_the_last_entry_of_a_slot_frees_it_and_moves_next_due():
    wheel = TimingWheel(0)
    wheel.add(10, 0, 0)
    wheel.add(20, 0, 1)
    assert wheel.remove(10, 0, 0)
    assert wheel.statistics().slots_in_use == 1
    assert wheel.next_due_ms() == 20
    assert fired(wheel.expire(15)) == []


def test_removing_a_past_due_entry_before_it_fires():
    wheel = TimingWheel(1_000)
    wheel.expire(2_000)
    wheel.add(1_500, 0, 0)  # past due: parked in the head slot
    assert wheel.remove(1_500, 0, 0) is True
    assert fired(wheel.expire(2_000)) == []


# ---------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ((1.5, 0, 0), TypeError),
        ((True, 0, 0), TypeError),
        ((10, "0", 0), TypeError),
        ((-1, 0, 0), ValueError),
        ((10, -1, 0), ValueError),
        ((10, 2**24, 0), ValueError),  # bucket ids have 24 bits
        ((10, 0, 2**40), ValueError),  # offsets have 40 bits
    ],
)
def test_a_bad_entry_is_refused_and_leaves_the_wheel_unchanged(entry, error):
    wheel = TimingWheel(0)
    with pytest.raises(error):
        wheel.add(*entry)
    assert len(wheel) == 0 and wheel.next_due_ms() is None
    assert wheel.statistics().slots_in_use == 0


def test_bad_geometry_and_bad_time_are_refused():
    with pytest.raises(ValueError):
        TimingWheel(0, tick_ms=0)
    with pytest.raises(ValueError):
        TimingWheel(0, slots=0)
    with pytest.raises(TypeError):
        TimingWheel(0.5)
    with pytest.raises(TypeError):
        TimingWheel(0).expire(10.0)
    with pytest.raises(TypeError):
        TimingWheel(0).remove(10.0, 0, 0)
    assert TimingWheel(0).remove(10, 2**24, 0) is False  # could never have been added


# ---------------------------------------------------------------------- memory


def measure_bytes_per_entry(count: int, spread_ms: int) -> tuple[float, float]:
    """(traced bytes, statistics' estimate) per entry for ``count`` entries due evenly
    over ``spread_ms`` from now, in a multiplicative pseudo-random order."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        wheel = TimingWheel(T0)
        for k in range(count):
            due = T0 + (k * 7_919 % count) * spread_ms // count
            wheel.add(due, k % 3, k * 100)
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return traced / count, wheel.statistics().bytes_estimate / count


@pytest.mark.parametrize(
    "spread_ms",
    [1_000, 600_000],  # within one round (wheel slots); over 10 min (overflow rounds)
)
def test_an_entry_costs_at_most_32_bytes(spread_ms):
    traced, estimate = measure_bytes_per_entry(100_000, spread_ms)
    assert ENTRY_BYTES <= traced <= 32
    assert estimate == pytest.approx(traced, rel=0.1)


def test_a_slot_or_round_in_use_costs_a_bounded_few_hundred_bytes():
    """One entry per overflow round: the fixed cost docs/wheel.md states (~360 B for a
    round with one entry), which bounds the overhead of a sparse load window."""
    count = 10_000
    traced, estimate = measure_bytes_per_entry(count, count * TimingWheel(0).span_ms)
    assert traced <= 400
    assert estimate == pytest.approx(traced, rel=0.1)


# ---------------------------------------------------------------------- deadline


@given(origin=st.integers(0, 2 * T0), due=st.integers(0, 3 * T0))
def test_the_ticker_deadline_is_the_first_float_at_which_the_ms_is_reached(origin, due):
    ticker = Ticker(TimingWheel(0), origin_ms=origin)
    deadline = ticker.deadline(due)
    assert origin + math.floor(deadline * 1000) >= due
    assert origin + math.floor(math.nextafter(deadline, -math.inf) * 1000) < due


# ---------------------------------------------------------------------- trio ticker


class Recorder:
    def __init__(self, ticker: Ticker) -> None:
        self.ticker = ticker
        self.calls: list[tuple[int, list[tuple[int, int, int]]]] = []
        self.all_fired = trio.Event()
        self.expected = 0

    async def on_due(self, entries: DueEntries, now_ms: int) -> None:
        # The virtual clock itself, not only the ticker's now_ms, must be at the due ms.
        assert self.ticker.now_ms() == now_ms
        self.calls.append((now_ms, fired(entries)))
        if sum(len(got) for _, got in self.calls) >= self.expected:
            self.all_fired.set()


async def test_ticker_fires_each_entry_at_its_exact_virtual_ms_and_sleeps_in_between(
    autojump_clock,
):
    wheel = TimingWheel(T0)
    ticker = Ticker(wheel, origin_ms=T0)
    recorder = Recorder(ticker)
    delays = [1, 2, 2, 5, 999, 1_000, 1_023, 1_024, 1_025, 60_000, HOUR - 1, HOUR, 2 * HOUR]
    recorder.expected = len(delays)
    async with trio.open_nursery() as nursery:
        await nursery.start(ticker.run, recorder.on_due)
        for offset, delay in enumerate(delays):
            ticker.add(T0 + delay, 0, offset)
        await recorder.all_fired.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert trio.current_time() == pytest.approx(2 * HOUR / 1000)
        stats = ticker.statistics()
        # One wake per distinct due ms, plus the first add waking the idle ticker:
        # not one per tick (7.2 million of them over two hours).
        assert stats.timer_wakeups == len(set(delays))
        assert stats.add_wakeups == 1
        assert stats.sleeping_until_ms == math.inf
        # Idle: a day of virtual time passes without a single wakeup.
        await trio.sleep(24 * 3600)
        assert ticker.statistics() == stats
        nursery.cancel_scope.cancel()
    for now_ms, got in recorder.calls:
        assert [due for due, _, _ in got] == [now_ms] * len(got)
    assert sorted(e for _, got in recorder.calls for e in got) == sorted(
        (T0 + delay, 0, offset) for offset, delay in enumerate(delays)
    )
    assert [len(got) for _, got in recorder.calls if got[0][0] == T0 + 2] == [2]


async def test_an_earlier_entry_wakes_the_ticker_and_a_past_due_one_fires_at_once(
    autojump_clock,
):
    ticker = Ticker(TimingWheel(T0), origin_ms=T0)
    recorder = Recorder(ticker)
    recorder.expected = 3
    async with trio.open_nursery() as nursery:
        await nursery.start(ticker.run, recorder.on_due)
        ticker.add(T0 + 2 * HOUR, 0, 0)
        await trio.sleep(1)
        assert ticker.statistics().sleeping_until_ms == T0 + 2 * HOUR
        ticker.add(T0 + 1_005, 0, 1)  # sooner than what the ticker sleeps towards
        await trio.sleep(1)
        assert recorder.calls == [(T0 + 1_005, [(T0 + 1_005, 0, 1)])]
        ticker.add(T0 + 10, 0, 2)  # two seconds late
        await trio.testing.wait_all_tasks_blocked()
        assert recorder.calls[-1] == (T0 + 2_000, [(T0 + 10, 0, 2)])
        await recorder.all_fired.wait()
        assert recorder.calls[-1] == (T0 + 2 * HOUR, [(T0 + 2 * HOUR, 0, 0)])
        nursery.cancel_scope.cancel()
    stats = ticker.statistics()
    assert (stats.add_wakeups, stats.timer_wakeups, stats.fired) == (3, 2, 3)


async def test_a_removed_entry_never_fires(autojump_clock):
    ticker = Ticker(TimingWheel(T0), origin_ms=T0)
    recorder = Recorder(ticker)
    recorder.expected = 1
    async with trio.open_nursery() as nursery:
        await nursery.start(ticker.run, recorder.on_due)
        ticker.add(T0 + 100, 0, 0)
        ticker.add(T0 + 200, 0, 1)
        await trio.sleep(0.05)
        assert ticker.remove(T0 + 100, 0, 0)
        await recorder.all_fired.wait()
        nursery.cancel_scope.cancel()
    assert recorder.calls == [(T0 + 200, [(T0 + 200, 0, 1)])]
