"""Load cursors and canAdd (delayd.wheel.cursor): the rule, the loader's operations,
and a replayer racing a loader over buckets with gaps — every record reaches the wheel
exactly once — plus the checkpoint bytes."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from delayd.wheel import NO_BUCKET, Cursor, LoadCursors
from delayd.wheel.cursor import FORMAT

MINUTE = 60_000
B0 = 1_795_341_600_000  # a bucket start, 2026-11-22T10:00:00Z
B1, B2, B3 = B0 + MINUTE, B0 + 2 * MINUTE, B0 + 3 * MINUTE


# ---------------------------------------------------------------------- the rule


def test_can_add_below_the_loading_bucket_or_at_and_past_its_loading_offset():
    cursors = LoadCursors()
    cursors.begin(B1, 100)
    assert cursors.can_add(B0, 0)  # an earlier bucket: loaded (or a gap)
    assert cursors.can_add(B0, 10**9)
    assert not cursors.can_add(B1, 0)  # below the loading offset: the loader reads it
    assert not cursors.can_add(B1, 99)
    assert cursors.can_add(B1, 100)  # appended after loading began
    assert cursors.can_add(B1, 5_000)
    assert not cursors.can_add(B2, 0)  # a later bucket: left for the loader
    assert not cursors.can_add(B2, 10**9)


def test_before_anything_is_loaded_every_record_is_left_to_the_loader():
    cursors = LoadCursors()
    assert cursors.loading == Cursor(NO_BUCKET, 0) and cursors.complete
    assert not cursors.can_add(0, 0)
    assert not cursors.can_add(B0, 0)


# ---------------------------------------------------------------------- the loader


def test_a_failed_load_resumes_where_it_stopped_with_the_end_it_began_with():
    """QMQ's loadingCursor.shiftCursor accepts the same bucket with a new, larger offset;
    the retried load then re-reads records canAdd already put into the wheel."""
    cursors = LoadCursors()
    assert cursors.begin(B0, 300) == 0
    cursors.advance(100)  # records [0, 100) are in the wheel, then the read fails
    assert cursors.loaded == Cursor(B0, 100) and not cursors.complete
    assert cursors.can_add(B0, 300)  # the replayer appends at 300: straight in
    assert cursors.begin(B0, 400) == 100  # retry, the file is now 400 bytes long
    assert cursors.loading == Cursor(B0, 300)  # still 300: [300, 400) is in the wheel
    cursors.advance(300)
    cursors.finish()
    assert cursors.complete


def test_a_new_bucket_needs_the_loading_one_complete():
    cursors = LoadCursors()
    cursors.begin(B0, 300)
    cursors.advance(200)
    with pytest.raises(ValueError, match="resume it"):
        cursors.begin(B1, 50)
    with pytest.raises(ValueError, match="100 bytes not loaded"):
        cursors.finish()
    cursors.advance(300)
    cursors.finish()
    assert cursors.begin(B1, 50) == 0
    assert cursors.loading == Cursor(B1, 50) and cursors.loaded == Cursor(B1, 0)


@pytest.mark.parametrize(
    ("operation", "message"),
    [
        (lambda c: c.begin(B0, 10), "increasing order"),
        (lambda c: c.begin(B1, 250), "never shrinks"),
        (lambda c: c.begin(B2, -1), "out of range"),
        (lambda c: c.begin(B2, 2**64), "out of range"),
        (lambda c: c.advance(99), "within 100..300"),
        (lambda c: c.advance(301), "within 100..300"),
    ],
)
def test_misuse_raises_and_changes_nothing(operation, message):
    cursors = LoadCursors()
    cursors.begin(B1, 300)
    cursors.advance(100)
    before = cursors.to_bytes()
    with pytest.raises(ValueError, match=message):
        operation(cursors)
    assert cursors.to_bytes() == before


def test_a_gap_is_jumped_over_and_later_records_in_it_go_straight_in():
    files = {B0: 200, B2: 100}  # B1 has no file
    cursors = LoadCursors()
    cursors.begin(B0, files[B0])
    cursors.advance(200)
    cursors.begin(B2, files[B2])  # the loader finds no B1 and jumps over it
    assert cursors.can_add(B1, 0)  # the replayer creates B1 now: below the loading bucket
    assert not cursors.can_add(B3, 0)  # B3 is the loader's when it gets there


def test_an_empty_bucket_is_complete_as_soon_as_it_begins():
    cursors = LoadCursors()
    assert cursors.begin(B0, 0) == 0
    assert cursors.complete
    cursors.finish()
    assert cursors.can_add(B0, 0)


# ---------------------------------------------------------------------- checkpoint


@given(
    bucket=st.integers(NO_BUCKET, 2**63 - 1),
    end=st.integers(0, 2**64 - 1),
    data=st.data(),
)
def test_cursors_survive_a_checkpoint_round_trip(bucket, end, data):
    loaded = data.draw(st.integers(0, end))
    cursors = LoadCursors(bucket, end, loaded)
    raw = cursors.to_bytes()
    assert len(raw) == FORMAT.size == 25 and raw[0] == 1
    again = LoadCursors.from_bytes(raw)
    assert again == cursors
    assert (again.loading, again.loaded) == (Cursor(bucket, end), Cursor(bucket, loaded))


def test_checkpoint_layout_is_version_bucket_loading_loaded_little_endian():
    raw = LoadCursors(B0, 300, 100).to_bytes()
    assert raw == bytes([1]) + B0.to_bytes(8, "little") + (300).to_bytes(8, "little") + (
        100
    ).to_bytes(8, "little")


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        LoadCursors(B0, 3, 1).to_bytes()[:-1],
        LoadCursors(B0, 3, 1).to_bytes() + b"\0",
        b"\x02" + LoadCursors(B0, 3, 1).to_bytes()[1:],  # unknown version
        FORMAT.pack(1, B0, 1, 3),  # loaded past loading
        FORMAT.pack(1, -2, 0, 0),  # below NO_BUCKET
    ],
)
def test_damaged_checkpoint_bytes_are_refused(raw):
    with pytest.raises(ValueError):
        LoadCursors.from_bytes(raw)


# ---------------------------------------------------------------------- the race


class ReplayerRacesLoader(RuleBasedStateMachine):
    """A replayer appending to buckets (creating files, leaving gaps) interleaved with a
    loader that begins buckets, loads a few records at a time (a failed load is one that
    stops early and is resumed later) and jumps over buckets without a file.

    Buckets are 0..7 (starts; the cursors do not care about units); each record is
    ``(offset, end)`` in its bucket's file. The wheel is a Counter, so a duplicate
    shows as a count of 2. The invariant states exactly which records must be in the
    wheel at every step; teardown drives the loader to the last bucket and checks that
    every record arrived exactly once.
    """

    cursors_class = LoadCursors
    LAST_BUCKET = 7

    @initialize(horizon=st.integers(0, 3))
    def start(self, horizon):
        self.cursors = self.cursors_class()
        self.files: dict[int, list[tuple[int, int]]] = {}
        self.wheel: Counter[tuple[int, int]] = Counter()
        self.horizon = horizon  # the loader loads buckets <= horizon (now + load_ahead)

    def size(self, bucket):
        records = self.files.get(bucket)
        return records[-1][1] if records else 0

    @rule(bucket=st.integers(0, LAST_BUCKET), length=st.integers(1, 40))
    def replayer_appends(self, bucket, length):
        # Append and ask canAdd with no step of the loader in between (rule 1).
        offset = self.size(bucket)
        self.files.setdefault(bucket, []).append((offset, offset + length))
        if self.cursors.can_add(bucket, offset):
            self.wheel[(bucket, offset)] += 1

    @rule(budget=st.integers(0, 4))
    def loader_step(self, budget):
        cursors = self.cursors
        if cursors.complete:
            # Next: the lowest bucket with a file above the loading one, up to the
            # horizon, else the horizon itself; decided and begun in one step (rule 2).
            current = cursors.loading.bucket_ms
            above = [b for b in self.files if current < b <= self.horizon]
            target = min(above) if above else self.horizon
            if target > current:
                cursors.begin(target, self.size(target))
            return
        bucket = cursors.loading.bucket_ms
        start = cursors.begin(bucket, self.size(bucket))  # resume
        end = cursors.loading.offset
        for offset, record_end in self.files.get(bucket, []):
            if budget == 0:
                return  # the load "fails" here; a later step resumes it
            if start <= offset and record_end <= end:
                self.wheel[(bucket, offset)] += 1
                cursors.advance(record_end)
                budget -= 1
        cursors.finish()

    @rule(minutes=st.integers(1, 3))
    def time_passes(self, minutes):
        self.horizon = min(self.LAST_BUCKET, self.horizon + minutes)

    @rule()
    def checkpoint_round_trip(self):
        again = self.cursors_class.from_bytes(self.cursors.to_bytes())
        assert again == self.cursors
        self.cursors = again

    @invariant()
    def each_record_is_in_the_wheel_iff_the_cursors_say_so(self):
        assert all(count == 1 for count in self.wheel.values()), self.wheel
        loading, loaded = self.cursors.loading, self.cursors.loaded
        for bucket, records in self.files.items():
            for offset, _ in records:
                covered = bucket < loading.bucket_ms or (
                    bucket == loading.bucket_ms
                    and (offset < loaded.offset or offset >= loading.offset)
                )
                assert self.wheel[(bucket, offset)] == int(covered), (bucket, offset)

    def teardown(self):
        if not hasattr(self, "cursors"):
            return
        self.horizon = self.LAST_BUCKET
        while not (self.cursors.complete and self.cursors.loading.bucket_ms == self.horizon):
            self.loader_step(budget=3)
        expected = {(b, offset) for b, records in self.files.items() for offset, _ in records}
        assert set(self.wheel) == expected
        assert all(count == 1 for count in self.wheel.values())


ReplayerRacesLoader.TestCase.settings = settings(
    max_examples=400, stateful_step_count=50, deadline=None
)
TestReplayerRacesLoader = ReplayerRacesLoader.TestCase


class QmqResumeCursors(LoadCursors):
    """QMQ's shiftCursor on a retried load: the same bucket takes the file's new end."""

    def begin(self, bucket_ms, end_offset):
        if bucket_ms == self.loading.bucket_ms and end_offset > self.loading.offset:
            resume = self.loaded.offset
            self._end = end_offset
            return resume
        return super().begin(bucket_ms, end_offset)


class OffByOneCursors(LoadCursors):
    """canAdd with ``offset > loading.offset``: the record at the boundary is nobody's."""

    def can_add(self, bucket_ms, offset):
        loading = self.loading
        return bucket_ms < loading.bucket_ms or (
            bucket_ms == loading.bucket_ms and offset > loading.offset
        )


@pytest.mark.parametrize("broken", [QmqResumeCursors, OffByOneCursors])
def test_the_race_machine_catches_a_broken_rule(broken):
    """The state machine above has teeth: it finds the duplicate of QMQ's resume and the
    loss of an off-by-one canAdd."""

    class Broken(ReplayerRacesLoader):
        cursors_class = broken

    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            Broken,
            settings=settings(
                max_examples=400,
                stateful_step_count=50,
                deadline=None,
                database=None,
                phases=[Phase.generate],  # finding it is the point; no need to shrink
                report_multiple_bugs=False,
            ),
        )
