"""KnownIds: does the delay server already hold a message with this id?

Idempotent intake asks it once per message sent: a message id the server holds —
scheduled, delivered or cancelled, for as long as its schedule_log record is kept — is
answered DUPLICATE, never scheduled twice (a cancel answered CANCELLED must not leave an
older copy to be delivered; docs/protocol.md, "Idempotent intake").

Where an id can be, from the moment intake accepts it:

- accepted, appended to message_log, not yet replayed: in ``_unindexed`` (id -> due_ms),
  which the replayer empties as it indexes (``indexed``);
- replayed: in the id index (IdIndex, on disk), which a lookup settles exactly.

Looking every id up in the index would cost several preads per message, so a HashFilter
stands in front of it: an id it has never seen is new at the cost of one hash and one
word. Every id intake accepts is added to it.

The filter is sized to what the server holds (ENTRIES_PER_WORD hashes a word, 1.7 %
false "maybe" when full): a 32 MiB filter for a hundred thousand ids would cost every
message a cache and TLB miss. So it is *rebuilt*, in a worker thread, from the index
files' entries (they carry the 32-bit hash: no record is read), at twice the size
needed — at start-up (until then it is cold: every id is looked up) and whenever it
fills. A rebuild:

1. ``begin_rebuild`` (event loop): the index's entries as they are now, the hashes of
   the ids accepted but not yet indexed, and from now on every id claimed is also
   recorded;
2. ``build_filter`` (worker thread): a new filter of all of them;
3. ``finish_rebuild`` (event loop): the recorded hashes added, and the new filter
   replaces the old. Every id held is then in it: indexed before 1, unindexed at 1, or
   claimed since.

Pure logic, one thread (the event loop), except ``build_filter``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from xxhash import xxh64_intdigest

from delayd.logs.id_index import IdIndex
from storage.hashfilter import U32, HashFilter
from storage.indexfile import ENTRY_SIZE, HashSource, read_key_hashes

ENTRIES_PER_WORD = 4  # a full filter: 16 bits per id, 1.7 % false "maybe" (measured)
MIN_WORD_BITS = 12  # 32 KiB: the cold filter of a start, and the smallest rebuilt
MAX_WORD_BITS = 26  # 512 MiB, for 268 million ids
HEADROOM = 2  # a rebuilt filter holds twice the ids it was built for


def word_bits_for(ids: int) -> int:
    """The filter size (log2 of words) for ``ids`` ids with HEADROOM."""
    words = max(1, ids * HEADROOM // ENTRIES_PER_WORD)
    return min(MAX_WORD_BITS, max(MIN_WORD_BITS, (words - 1).bit_length()))


@dataclass(frozen=True, slots=True)
class RebuildPlan:
    """What ``build_filter`` reads (``begin_rebuild``)."""

    sources: list[HashSource]  # the index's entries at the start of the rebuild
    unindexed: list[int]  # hashes of the ids accepted, not indexed then
    word_bits: int


class KnownIds:
    """The ids this delay server holds; see the module docstring.

    Counters for metrics: ``lookups`` (index lookups made), ``duplicates`` (ids found
    held), ``false_maybes`` (lookups of ids the filter could not rule out that were
    new), ``rebuilds`` (filters built). ``on_full`` is called (from ``indexed``) when a
    warm filter holds more than ``capacity`` ids: time to rebuild it bigger."""

    def __init__(self, index: IdIndex, *, word_bits: int = MIN_WORD_BITS) -> None:
        self.index = index
        self.filter = HashFilter(word_bits)
        self._words, self._shift = self.filter.inline_view()
        self.warm = False  # the filter holds every id held (a rebuild finished)
        self.capacity = (1 << word_bits) * ENTRIES_PER_WORD
        self.held_estimate = 0  # ids in the filter: rebuilt from, or indexed since
        self.on_full: Callable[[], object] | None = None
        self._unindexed: dict[bytes, int] = {}
        self._recording: list[int] | None = None  # hashes claimed during a rebuild
        self.lookups = 0
        self.duplicates = 0
        self.false_maybes = 0
        self.rebuilds = 0

    @property
    def unindexed_count(self) -> int:
        return len(self._unindexed)

    @property
    def rebuilding(self) -> bool:
        return self._recording is not None

    def claim(self, message_id: bytes, due_ms: int) -> int | None:
        """None when no message with ``message_id`` is held: it is held from now on,
        due at ``due_ms`` (call ``release`` if it is not appended after all). Otherwise
        the held message's due time (its newest record's: a reschedule moves it).

        Raises CorruptionError for a damaged index chain."""
        # HashFilter.add and key_hash, inlined: this runs once per message sent.
        h = xxh64_intdigest(message_id) & U32
        mask = 1 << (h & 63) | 1 << (h >> 6 & 63)
        words, word = self._words, h >> self._shift
        old = words[word]
        maybe = old & mask == mask
        if not maybe:
            words[word] = old | mask
        if maybe or not self.warm:
            held = self.held_due_ms(message_id)
            if held is not None:
                self.duplicates += 1
                return held
            self.false_maybes += maybe
        self._unindexed[message_id] = due_ms
        if self._recording is not None:
            self._recording.append(h)
        return None

    def held_due_ms(self, message_id: bytes) -> int | None:
        """The due time of the held message with ``message_id``, or None (exact: the
        index is read)."""
        due_ms = self._unindexed.get(message_id)
        if due_ms is not None:
            return due_ms
        self.lookups += 1
        found = self.index.lookup(message_id)
        return found[0].due_ms if found else None

    def release(self, message_ids: list[bytes]) -> None:
        """Claimed ids whose records were not appended (the append failed): no longer
        held. Their filter bits stay; they only cost a lookup if the id comes back."""
        pop = self._unindexed.pop
        for message_id in message_ids:
            pop(message_id, None)

    def indexed(self, message_ids: list[bytes]) -> None:
        """The replayer put these ids in the index: the index answers for them now."""
        pop = self._unindexed.pop
        for message_id in message_ids:
            pop(message_id, None)
        self.held_estimate += len(message_ids)
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
        unindexed = [xxh64_intdigest(i) & U32 for i in self._unindexed]
        self._recording = []
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
        """Step 3: add at most ``max_hashes`` of the ids claimed meanwhile to ``built``;
        once none is left, ``built`` replaces the filter and True is returned. Call
        again (after other work: claims go on) until it is. None (the build failed)
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
        self._words, self._shift = built.inline_view()
        self.capacity = (1 << built.word_bits) * ENTRIES_PER_WORD
        self.held_estimate = built.added
        self.warm = True
        self.rebuilds += 1
        old.close()
        return True

    def close(self) -> None:
        self.filter.close()
