"""A hashed timing wheel of compact entries (the trio task that drives it: ticker.py).

The wheel holds ``(due_ms, bucket, offset)`` entries: when a message is due (epoch ms),
the small integer id of its schedule_log bucket, and the byte offset of its record in
that bucket's file. Bucket and offset are packed into one 64-bit *ref*, ``bucket << 40 |
offset`` (16.7 million bucket ids, 1 TiB per bucket file). It is pure logic: ``now_ms``
is always an argument (STYLE.md #4, as trio's ``Deadlines.expire(now)``), so tests drive
it through any history of time.

Layout (docs/wheel.md has the pictures and the arithmetic)::

    tick          tick_ms of time per slot (default 1 ms)
    round         ``slots`` consecutive ticks, aligned: round r covers ticks
                  [r*slots, (r+1)*slots)
    wheel         the slots of the current round, a list indexed by tick - round start
    busy          ordered set of the indexes of non-empty slots (sortedcontainers)
    overflow      one column pair per later round that holds entries, in a dict keyed
                  by round number, plus the ordered set of those round numbers

As Varghese & Lauck's hashed wheel (scheme 6), an entry goes to the slot of its tick in
O(1). As Kafka's hierarchical TimingWheel, entries beyond the current round wait in an
overflow level whose tick is the whole round and are *cascaded* into the wheel when their
round begins — but the overflow here is sparse (only rounds that hold entries exist), so
one level reaches any horizon and a two-year delay needs no third wheel. As Kafka's
DelayQueue of buckets, the ordered sets let ``expire`` jump over empty slots and rounds:
its cost is the entries it releases plus O(log n) per non-empty slot, never a scan.

Unlike QMQ's HashWheelTimer (Netty's, 500 ms tick, one object per task, fires a slot at
the slot's time), a slot is released entry by entry at each entry's own ``due_ms``: the
tick decides memory and CPU, never precision, and an entry never fires before its due
time whatever the tick. Entries are not objects: each slot is two ``array.array``
columns, due_ms and ref (8 + 8 = 16 bytes per entry, plus the columns' growth slack and
per-slot overhead; ``tools/bench_wheel_memory.py`` measures it, docs/wheel.md states it).
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass

from sortedcontainers import SortedList

DUE_TYPECODE = "q"  # int64: due time, epoch ms
REF_TYPECODE = "Q"  # uint64: bucket id << OFFSET_BITS | offset
OFFSET_BITS = 40  # byte offset in the bucket's schedule_log file: up to 1 TiB
BUCKET_BITS = 24  # bucket id, assigned by the wheel manager: 16.7 million at once
assert BUCKET_BITS + OFFSET_BITS == 64
ENTRY_BYTES = 8 + 8  # column bytes per entry: due_ms, ref
assert array(DUE_TYPECODE).itemsize + array(REF_TYPECODE).itemsize == ENTRY_BYTES

MAX_DUE_MS = 2**63 - 1
MAX_BUCKET = 2**BUCKET_BITS - 1
MAX_OFFSET = 2**OFFSET_BITS - 1
_OFFSET_MASK = MAX_OFFSET

DEFAULT_TICK_MS = 1
DEFAULT_SLOTS = 1024  # one round = 1.024 s at the default tick; see docs/wheel.md

Columns = tuple[array, array]  # (due_ms, ref), parallel


def pack_ref(bucket: int, offset: int) -> int:
    """The ref of (bucket, offset); no range check (TimingWheel.add checks)."""
    return bucket << OFFSET_BITS | offset


def unpack_ref(ref: int) -> tuple[int, int]:
    """(bucket, offset) of a ref."""
    return ref >> OFFSET_BITS, ref & _OFFSET_MASK


class _Slot:
    """The entries of one slot, or of one overflow round: two parallel columns.

    Entries before ``pos`` were already released (a slot is drained from the front while
    ``now_ms`` moves through it); ``ordered`` says whether ``due[pos:]`` is sorted. A slot
    that holds no pending entry is unlinked at once, so ``pos < len(due)`` always.
    """

    __slots__ = ("due", "ordered", "pos", "ref")

    def __init__(self) -> None:
        self.due = array(DUE_TYPECODE)
        self.ref = array(REF_TYPECODE)
        self.pos = 0
        self.ordered = True

    def append(self, due_ms: int, ref: int) -> None:
        due = self.due
        if self.ordered and due and due_ms < due[-1]:
            self.ordered = False
        due.append(due_ms)
        self.ref.append(ref)

    def extend(self, due: array, ref: array) -> None:
        """Append parallel columns whose due times are in order (a run of a sorted round)."""
        mine = self.due
        if self.ordered and mine and due and due[0] < mine[-1]:
            self.ordered = False
        mine += due
        self.ref += ref

    def pending(self) -> int:
        return len(self.due) - self.pos

    def sort(self) -> None:
        """Order the pending entries by due_ms and drop the released ones.

        Stable, so entries due at the same ms keep their insertion order; timsort finds
        the sorted run a slot usually is, so re-sorting after a few late adds is ~linear.
        """
        due, ref = self.due, self.ref
        order = sorted(range(self.pos, len(due)), key=due.__getitem__)
        self.due = array(DUE_TYPECODE, map(due.__getitem__, order))
        self.ref = array(REF_TYPECODE, map(ref.__getitem__, order))
        self.pos = 0
        self.ordered = True

    def find(self, due_ms: int, ref: int) -> int:
        """Index of the pending entry (due_ms, ref), or -1.

        ``array.index`` scans the ref column in C; a ref names one schedule_log record,
        so Python looks at a second match only if the entry was added twice.
        """
        refs = self.ref
        index = self.pos
        while True:
            try:
                index = refs.index(ref, index)
            except ValueError:
                return -1
            if self.due[index] == due_ms:
                return index
            index += 1

    def delete(self, index: int) -> None:
        """Remove the entry at ``index``; the order of the others is kept."""
        del self.due[index]
        del self.ref[index]

    def release_all(self) -> Columns:
        """All pending entries in due order; the slot is spent afterwards."""
        if not self.ordered:
            self.sort()
        pos = self.pos
        if pos == 0:
            return self.due, self.ref  # the columns themselves, no copy
        return self.due[pos:], self.ref[pos:]

    def release_until(self, now_ms: int) -> Columns | None:
        """The pending entries with due_ms <= now_ms, in due order, or None if there are
        none; they are released (``pos`` moves past them)."""
        if not self.ordered:
            self.sort()
        pos, due, ref = self.pos, self.due, self.ref
        end = bisect_right(due, now_ms, pos)
        if end == pos:
            return None
        self.pos = end
        if end == len(due):
            return (due, ref) if pos == 0 else (due[pos:], ref[pos:])
        taken = due[pos:end], ref[pos:end]
        if end >= len(due) - end:
            # Compact once the released prefix outweighs what is left: each entry is
            # moved at most once per halving, so the cost is amortised O(1) per entry.
            del due[:end]
            del ref[:end]
            self.pos = 0
        return taken

    def nbytes(self) -> int:
        return sys.getsizeof(self) + sys.getsizeof(self.due) + sys.getsizeof(self.ref)


@dataclass(frozen=True, slots=True)
class DueEntries:
    """Entries released by one ``expire``: two parallel columns, in due order.

    Columns rather than a list of tuples: releasing a slot copies (or hands over) its
    arrays in C, so a burst of 500,000 due entries is two memcpy's, not 500,000 tuple
    allocations; a sender can slice batches (``due_ms[i:j]``) the same way. Iterating
    yields ``(due_ms, bucket, offset)`` tuples; ``unpack_ref`` splits a single ref.
    """

    due_ms: array
    ref: array

    def __len__(self) -> int:
        return len(self.due_ms)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        for due_ms, ref in zip(self.due_ms, self.ref, strict=True):
            yield due_ms, ref >> OFFSET_BITS, ref & _OFFSET_MASK


@dataclass(frozen=True, slots=True)
class WheelStatistics:
    """A snapshot of a TimingWheel, for metrics and ``delayd top``.

    ``bytes_estimate`` counts the slot objects, their columns (with growth slack), the
    wheel's slot list, the overflow dict and the ordered sets (``ENTRY_BYTES`` per entry
    is the floor).
    """

    entries: int
    wheel_entries: int
    overflow_entries: int
    slots_in_use: int
    overflow_rounds: int
    tick_ms: int
    slots: int
    bytes_estimate: int


def _join(pieces: list[Columns]) -> DueEntries:
    if len(pieces) == 1:
        return DueEntries(*pieces[0])
    due, ref = array(DUE_TYPECODE), array(REF_TYPECODE)
    for piece_due, piece_ref in pieces:
        due += piece_due
        ref += piece_ref
    return DueEntries(due, ref)


class TimingWheel:
    """A hashed timing wheel with a sparse overflow level; see the module docstring.

    ``now_ms`` (epoch ms) is where the wheel's time starts; afterwards time is whatever
    the latest ``expire`` said. ``tick_ms`` is the width of a slot and ``slots`` the
    number of slots in a round; neither affects *when* an entry fires (always the first
    ``expire`` with ``now_ms >= due_ms``), only memory and CPU.

    Raises ValueError for a tick or slot count below 1, TypeError for non-int arguments.
    """

    __slots__ = (
        "_base",
        "_busy",
        "_cursor",
        "_len",
        "_overflow",
        "_rounds",
        "_slot_count",
        "_slots",
        "_tick_ms",
    )

    def __init__(
        self, now_ms: int, *, tick_ms: int = DEFAULT_TICK_MS, slots: int = DEFAULT_SLOTS
    ) -> None:
        for name, value in (("now_ms", now_ms), ("tick_ms", tick_ms), ("slots", slots)):
            if type(value) is not int:
                raise TypeError(f"{name} must be an int, got {value!r}")
        if tick_ms < 1 or slots < 1:
            raise ValueError(f"tick_ms and slots must be >= 1, got {tick_ms} and {slots}")
        self._tick_ms = tick_ms
        self._slot_count = slots
        # Invariants: _base <= _cursor < _base + slots. Wheel slot i holds the pending
        # entries of tick _base + i, except the head slot (i = _cursor - _base), which
        # also holds entries added when their tick had already passed. _overflow[r]
        # holds the entries of round r > _base // slots.
        self._cursor = now_ms // tick_ms  # the tick of the latest now_ms
        self._base = self._cursor - self._cursor % slots  # first tick of the round
        self._slots: list[_Slot | None] = [None] * slots
        self._busy = SortedList()  # indexes of the non-empty wheel slots
        self._overflow: dict[int, _Slot] = {}
        self._rounds = SortedList()  # keys of _overflow
        self._len = 0

    # ------------------------------------------------------------------ geometry

    @property
    def tick_ms(self) -> int:
        """Width of a slot, in ms."""
        return self._tick_ms

    @property
    def slots(self) -> int:
        """Slots per round."""
        return self._slot_count

    @property
    def span_ms(self) -> int:
        """Width of a round (tick_ms * slots), in ms: the wheel proper's horizon."""
        return self._tick_ms * self._slot_count

    def __len__(self) -> int:
        """Entries added and neither released nor removed."""
        return self._len

    # ------------------------------------------------------------------ add / remove

    def add(self, due_ms: int, bucket: int, offset: int) -> None:
        """Schedule the entry; amortised O(1) (an O(log n) ordered-set insert when it
        is the first entry of its slot or overflow round).

        An entry whose due_ms has already passed is released by the next ``expire``.
        The wheel does not look for duplicates: adding an entry twice releases it twice
        (canAdd in delayd.wheel.cursor is what prevents that).

        Raises TypeError unless all three are ints, ValueError unless due_ms is in
        0..MAX_DUE_MS, bucket in 0..MAX_BUCKET (2**24 - 1) and offset in 0..MAX_OFFSET
        (2**40 - 1).
        """
        if type(due_ms) is not int or type(bucket) is not int or type(offset) is not int:
            raise TypeError(f"entries are three ints, got {(due_ms, bucket, offset)!r}")
        if not (
            0 <= due_ms <= MAX_DUE_MS and 0 <= bucket <= MAX_BUCKET and 0 <= offset <= MAX_OFFSET
        ):
            raise ValueError(f"entry out of range: {(due_ms, bucket, offset)!r}")
        tick = due_ms // self._tick_ms
        base = self._base
        if tick < base + self._slot_count:
            # This round, or already past: a past tick goes to the head slot, which the
            # next expire releases (Kafka's TimingWheel.add refuses these instead).
            index = (tick if tick > self._cursor else self._cursor) - base
            slot = self._slots[index]
            if slot is None:
                slot = self._slots[index] = _Slot()
                self._busy.add(index)
        else:
            round_ = tick // self._slot_count
            slot = self._overflow.get(round_)
            if slot is None:
                slot = self._overflow[round_] = _Slot()
                self._rounds.add(round_)
        slot.append(due_ms, bucket << OFFSET_BITS | offset)
        self._len += 1

    def remove(self, due_ms: int, bucket: int, offset: int) -> bool:
        """Unschedule one entry equal to (due_ms, bucket, offset); returns whether there
        was one (False also when it was already released).

        ``due_ms`` finds the slot or overflow round in O(1); the search within it runs
        in C over the ref column, and the delete is one memmove per column — no
        per-entry index is kept, which would cost more than the entries themselves.

        Raises TypeError unless all three are ints.
        """
        if type(due_ms) is not int or type(bucket) is not int or type(offset) is not int:
            raise TypeError(f"entries are three ints, got {(due_ms, bucket, offset)!r}")
        if not (0 <= bucket <= MAX_BUCKET and 0 <= offset <= MAX_OFFSET):
            return False  # could never have been added
        ref = bucket << OFFSET_BITS | offset
        tick = due_ms // self._tick_ms
        base = self._base
        if tick < base + self._slot_count:
            index = (tick if tick > self._cursor else self._cursor) - base
            slot = self._slots[index]
            if slot is None or (found := slot.find(due_ms, ref)) < 0:
                return False
            slot.delete(found)
            if not slot.pending():
                self._slots[index] = None
                self._busy.remove(index)
        else:
            round_ = tick // self._slot_count
            slot = self._overflow.get(round_)
            if slot is None or (found := slot.find(due_ms, ref)) < 0:
                return False
            slot.delete(found)
            if not slot.pending():
                del self._overflow[round_]
                self._rounds.remove(round_)
        self._len -= 1
        return True

    # ------------------------------------------------------------------ time

    def expire(self, now_ms: int) -> DueEntries:
        """Release every entry with due_ms <= now_ms, in due order (ties in the order
        they were added), and move the wheel's time to now_ms.

        Never releases an entry early. ``now_ms`` may go backwards (a wall clock
        stepped back): the wheel then releases only what is due at that earlier time and
        keeps its position. Cost: the entries released, O(log n) per non-empty slot
        passed, one cascade per overflow round entered (each entry is cascaded once).

        Raises TypeError unless now_ms is an int.
        """
        if type(now_ms) is not int:
            raise TypeError(f"now_ms must be an int, got {now_ms!r}")
        pieces: list[Columns] = []
        tick = now_ms // self._tick_ms
        if tick <= self._cursor:
            # Only the head slot can hold entries due at or before the head tick.
            self._release_slot_until(self._cursor - self._base, now_ms, pieces)
        else:
            count = self._slot_count
            while True:
                if tick < self._base + count:
                    self._release_slots_before(tick - self._base, pieces)
                    self._release_slot_until(tick - self._base, now_ms, pieces)
                    break
                # now_ms is past this whole round: everything in it is due.
                self._release_slots_before(count, pieces)
                target = tick // count
                rounds = self._rounds
                if rounds and rounds[0] <= target:
                    round_ = rounds.pop(0)
                    self._base = round_ * count
                    self._cascade(self._overflow.pop(round_))
                else:
                    self._base = target * count  # skip the empty rounds in one step
            self._cursor = tick
        if not pieces:
            return DueEntries(array(DUE_TYPECODE), array(REF_TYPECODE))
        return _join(pieces)

    def next_due_ms(self) -> int | None:
        """The smallest due_ms of all pending entries (possibly already past), or None
        when the wheel is empty: what a ticker sleeps until."""
        if self._busy:
            slot = self._slots[self._busy[0]]
            assert slot is not None
            if not slot.ordered:
                slot.sort()  # the next expire needs this order anyway
            return slot.due[slot.pos]
        if self._rounds:
            # Unordered until cascaded; min() runs in C over one round's column.
            return min(self._overflow[self._rounds[0]].due)
        return None

    def _release_slots_before(self, stop: int, pieces: list[Columns]) -> None:
        """Release, whole and in order, every non-empty wheel slot with index < stop."""
        busy, slots = self._busy, self._slots
        while busy and busy[0] < stop:
            index = busy.pop(0)
            slot = slots[index]
            assert slot is not None
            slots[index] = None
            self._len -= slot.pending()
            pieces.append(slot.release_all())

    def _release_slot_until(self, index: int, now_ms: int, pieces: list[Columns]) -> None:
        slot = self._slots[index]
        if slot is None:
            return
        before = slot.pending()
        taken = slot.release_until(now_ms)
        if taken is None:
            return
        pieces.append(taken)
        left = slot.pending()
        self._len -= before - left
        if not left:
            self._slots[index] = None
            self._busy.remove(index)

    def _cascade(self, round_slot: _Slot) -> None:
        """Move one overflow round's entries into the (empty) wheel, each into its slot.

        As Kafka's TimingWheel re-inserting an expired overflow bucket: the one place an
        entry is touched twice. The round is put in due order first (stable: ties keep
        their insertion order), so each slot's entries are one run of it, moved as two
        array slices found by bisection: the cost is O(log n) per slot in use plus the
        copies in C, not a Python step per entry. The ordered set is built once at the end.
        """
        if not round_slot.ordered:
            round_slot.sort()
        slots, base, tick_ms = self._slots, self._base, self._tick_ms
        due, ref = round_slot.due, round_slot.ref
        created = []
        start, end = round_slot.pos, len(due)
        while start < end:
            tick = due[start] // tick_ms
            stop = bisect_left(due, (tick + 1) * tick_ms, start, end)
            index = tick - base
            slot = slots[index]
            if slot is None:
                slot = slots[index] = _Slot()
                created.append(index)
            slot.extend(due[start:stop], ref[start:stop])
            start = stop
        self._busy.update(created)

    # ------------------------------------------------------------------ metrics

    def statistics(self) -> WheelStatistics:
        """Counts and a byte estimate; O(slots in use + overflow rounds)."""
        wheel_entries = overflow_entries = 0
        nbytes = sys.getsizeof(self._slots) + sys.getsizeof(self._overflow)
        for index in self._busy:
            slot = self._slots[index]
            assert slot is not None
            wheel_entries += slot.pending()
            nbytes += slot.nbytes()
        for slot in self._overflow.values():
            overflow_entries += slot.pending()
            nbytes += slot.nbytes()
        # Ordered-set members: a list pointer each, plus the int object of a round
        # number (slot indexes are mostly small cached ints).
        nbytes += 8 * (len(self._busy) + len(self._rounds)) + 32 * len(self._rounds)
        return WheelStatistics(
            entries=self._len,
            wheel_entries=wheel_entries,
            overflow_entries=overflow_entries,
            slots_in_use=len(self._busy),
            overflow_rounds=len(self._rounds),
            tick_ms=self._tick_ms,
            slots=self._slot_count,
            bytes_estimate=nbytes,
        )
