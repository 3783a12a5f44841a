"""KnownIds: does the delay server already hold a message with this id?

Idempotent intake asks it once per message sent: a message id the server holds —
scheduled, delivered or cancelled, for as long as its schedule_log record is kept — is
answered DUPLICATE, never scheduled twice (a cancel answered CANCELLED must not leave an
older copy to be delivered; docs/protocol.md, "Idempotent intake").

Where an id can be, from the moment intake accepts it:

- accepted, appended to message_log, not yet replayed: in ``_pending``, dicts id ->
  due_ms of the batches appended (``hold``), each dropped whole once the replayer has
  indexed past its last sequence (``indexed_through``);
- replayed: in the id index (IdIndex, on disk), which a lookup settles exactly.

Looking every id up in the index would cost several preads per message, so a HashFilter
stands in front of it: an id it has never seen is new at the cost of one hash and one
word. Every id intake checks is added to it (``check``). The work is per batch, in C
where Python allows it (hashes by ``map``, the pending ids by ``dict(zip())``): the
idempotency check must not cost intake more than a tenth of its throughput.

The filter is sized to what the server holds (ENTRIES_PER_WORD hashes a word, 1.7 %
false "maybe" when full), from 8 MiB (4 million ids) up, 4x at each rebuild: a filter
far larger than needed costs every message a cache and TLB miss, and one that starts
tiny and doubles re-reads the ids again and again (both measured: docs/benchmarks.md).
It is *built*, in a worker thread, from the index files' entries (they carry the 32-bit
hash: no record is read), for up to HEADROOM times the ids held — at start-up (until
then it is cold: every id is looked up) and whenever it fills. A build:

1. ``begin_rebuild`` (event loop): the index's entries as they are now, the hashes of
   the ids held but not yet indexed, and from now on every id checked is also
   recorded;
2. ``build_filter`` (worker thread): a new filter of all of them;
3. ``finish_rebuild`` (event loop): the recorded hashes added, and the new filter
   replaces the old. Every id held is then in it: indexed before 1, unindexed at 1, or
   checked since.

The per-batch dicts cost ~50 bytes an id for as long as replay lags behind intake
(bounded by ``max_replay_lag_records``).

Pure logic, one thread (the event loop), except ``build_filter``.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from xxhash import xxh64_intdigest

from delayd.logs.id_index import IdIndex
from storage.hashfilter import MAX_WORD_BITS, HashFilter
from storage.index_hashes import read_key_hashes
from storage.indexfile import ENTRY_SIZE, HashSource

ENTRIES_PER_WORD = 4  # a full filter: 16 bits per id, 1.7 % false "maybe" (measured)
MIN_WORD_BITS = 20  # 8 MiB, 4 million ids: most servers never rebuild after the start
HEADROOM = 4  # a filter is built for up to 4x the ids held: few rebuilds as a server fills


def word_bits_for(ids: int) -> int:
    """The filter size (log2 of words) for ``ids`` ids: room for HEADROOM / 2 to
    HEADROOM times as many, between MIN_WORD_BITS and MAX_WORD_BITS.

    Rounded down to a power of two, not up: a filter is rebuilt when it holds just
    over its capacity, itself a power of two, so rounding up would build one twice the
    size, for 8x the ids, with every page resident (64 MiB instead of 32 at 4 million
    ids)."""
    words = max(1, ids * HEADROOM // ENTRIES_PER_WORD)
    return min(MAX_WORD_BITS, max(MIN_WORD_BITS, words.bit_length() - 1))


@dataclass(frozen=True, slots=True)
class RebuildPlan:
    """What ``build_filter`` reads (``begin_rebuild``)."""

    sources: list[HashSource]  # the index's entries at the start of the rebuild
    unindexed: list[int]  # hashes of the ids accepted, not indexed then
    word_bits: int


class _PendingBatch:
    """Ids appended to message_log up to ``last_sequence``, not yet indexed."""

    __slots__ = ("due_ms", "last_sequence")

    def __init__(self, due_ms: dict[bytes, int], last_sequence: int) -> None:
        self.due_ms = due_ms
        self.last_sequence = last_sequence


PENDING_MERGE = 4096  # batches are merged up to this many ids: few dicts to search


class KnownIds:
    """The ids this delay server holds; see the module docstring.

    ``lookups`` counts the index lookups made (a metric). ``on_full`` is called (from
    ``indexed_through``) when a warm filter holds more than ``capacity`` ids: time to
    rebuild it bigger."""

    def __init__(self, index: IdIndex, *, word_bits: int = MIN_WORD_BITS) -> None:
        self.index = index
        self.filter = HashFilter(word_bits)
        self.warm = False  # the filter holds every id held (a rebuild finished)
        self.capacity = (1 << word_bits) * ENTRIES_PER_WORD
        self.held_estimate = 0  # ids in the filter: rebuilt from, or indexed since
        self.on_full: Callable[[], object] | None = None
        self._pending: deque[_PendingBatch] = deque()
        # Hashes checked during a rebuild: 8 bytes each (a list of ints would take 40).
        self._recording: array[int] | None = None
        self.lookups = 0

    @property
    def unindexed_count(self) -> int:
        return sum(len(batch.due_ms) for batch in self._pending)

    @property
    def rebuilding(self) -> bool:
        return self._recording is not None

    def check(self, message_ids: list[bytes], due_ms: list[int]) -> dict[int, int] | None:
        """Which of ``message_ids`` (a batch about to be appended, in order, due at
        ``due_ms``) are held: {position: the held message's due time}, or None when
        none is (the usual answer). An id held because it came earlier in the same
        list counts, with that one's due time. Holding the new ones is ``hold``'s
        job, once they are appended.

        Raises CorruptionError for a damaged index chain."""
        if self._recording is not None:
            self._recording.extend(map(xxh64_intdigest, message_ids))
        positions: Iterable[int]
        if not self.warm:
            # Cold: every id is looked up, and the build under way (or about to begin,
            # with these held by then) puts them in the filter that replaces this one.
            positions = range(len(message_ids))
        elif (maybes := self.filter.add_many(map(xxh64_intdigest, message_ids))) is None:
            return None
        else:  # rare: which ids the filter could not rule out
            maybe = set(maybes)
            hashes = map(xxh64_intdigest, message_ids)
            positions = [p for p, h in enumerate(hashes) if h in maybe]
        held: dict[int, int] = {}
        first: dict[bytes, int] | None = None
        for position in positions:
            message_id = message_ids[position]
            if first is None:
                first = {}
                for earlier, seen in enumerate(message_ids):
                    first.setdefault(seen, earlier)
            earlier = first[message_id]
            if earlier < position:
                held_due = held.get(earlier, due_ms[earlier])
            else:
                held_due = self.held_due_ms(message_id)
                if held_due is None:
                    continue
            held[position] = held_due
        return held or None

    def held_due_ms(self, message_id: bytes) -> int | None:
        """The due time of the held message with ``message_id`` (its newest record's:
        a reschedule moves it), or None (exact: the index is read)."""
        for batch in self._pending:
            due_ms = batch.due_ms.get(message_id)
            if due_ms is not None:
                return due_ms
        self.lookups += 1
        found = self.index.lookup(message_id)
        return found[0].due_ms if found else None

    def held(self, message_ids: list[bytes]) -> list[int | None]:
        """``held_due_ms`` of each of ``message_ids``, read-only (a HELD_IDS): unlike
        ``check`` nothing is added to the filter, which a warm filter lets rule out most
        ids not held without reading the index. Raises CorruptionError as ``check``."""
        rule_out = self.filter.may_contain if self.warm else None
        return [
            None
            if rule_out is not None and not rule_out(xxh64_intdigest(message_id))
            else self.held_due_ms(message_id)
            for message_id in message_ids
        ]

    def hold(self, message_ids: list[bytes], due_ms: list[int], last_sequence: int) -> None:
        """``message_ids`` (checked, not held) were appended to message_log, the last
        with ``last_sequence``: held from now on."""
        pending = self._pending
        if pending and len(pending[-1].due_ms) < PENDING_MERGE:
            batch = pending[-1]
            batch.due_ms.update(zip(message_ids, due_ms))  # noqa: B905  # equal lengths
            batch.last_sequence = last_sequence
        else:
            due_by_id = dict(zip(message_ids, due_ms))  # noqa: B905  # equal lengths
            pending.append(_PendingBatch(due_by_id, last_sequence))

    def indexed_through(self, sequence: int) -> None:
        """The replayer has put every message up to ``sequence`` in the index: it
        answers for them now."""
        pending = self._pending
        while pending and pending[0].last_sequence <= sequence:
            self.held_estimate += len(pending.popleft().due_ms)
        full = self.held_estimate > self.capacity and self.filter.word_bits < MAX_WORD_BITS
        if full and self.warm and self._recording is None and self.on_full is not None:
            self.on_full()

    # ------------------------------------------------------------------ rebuilding

    def begin_rebuild(self) -> RebuildPlan:
        """Step 1 of a rebuild (see the module docstring). Call once replay has
        caught up with message_log at start-up, so that every id held before this
        process is in the index."""
        if self._recording is not None:
            raise RuntimeError("a filter rebuild is already under way")
        sources = self.index.store.hash_sources()
        entries = sum(s.flushed + len(s.pending) // ENTRY_SIZE for s in sources)
        unindexed = [
            xxh64_intdigest(message_id) for batch in self._pending for message_id in batch.due_ms
        ]
        self._recording = array("Q")
        return RebuildPlan(sources, unindexed, word_bits_for(entries + len(unindexed)))

    @staticmethod
    def build_filter(plan: RebuildPlan) -> HashFilter | None:
        """Step 2: a filter of every hash of ``plan`` (may run in a worker thread), or
        None when a file that still exists could not be read — a filter missing its
        ids would call their resends new. A file closed and gone meanwhile was deleted
        by retention: its ids are no longer held."""
        built = HashFilter(plan.word_bits)
        for source in plan.sources:
            try:
                for hashes in read_key_hashes(source):
                    built.add_all(hashes)
            except OSError:
                if source.fs.exists(source.path):
                    built.close()
                    return None
        built.add_all(plan.unindexed)
        return built

    def finish_rebuild(self, built: HashFilter | None, max_hashes: int = 1 << 62) -> bool:
        """Step 3: add at most ``max_hashes`` of the ids checked meanwhile to ``built``;
        once none is left, ``built`` replaces the filter and True is returned. Call
        again (after other work: checks go on) until it is. None (the build failed)
        keeps the old filter, warm or cold as it was."""
        recorded = self._recording
        if recorded is None:
            raise RuntimeError("no filter rebuild is under way")
        if built is None:
            self._recording = None
            return True
        chunk = recorded[:max_hashes]
        del recorded[:max_hashes]
        built.add_all(chunk)
        if recorded:
            return False
        self._recording = None
        old, self.filter = self.filter, built
        self.capacity = (1 << built.word_bits) * ENTRIES_PER_WORD
        self.held_estimate = built.added
        self.warm = True
        old.close()
        return True

    def close(self) -> None:
        self.filter.close()
