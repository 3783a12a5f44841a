"""KnownIds: does the delay server already hold a message with this id?

Idempotent intake asks it once per message sent: a message id the server holds —
scheduled, delivered or cancelled, for as long as its schedule_log record is kept — is
answered DUPLICATE, never scheduled twice (a cancel answered CANCELLED must not leave an
older copy to be delivered; docs/protocol.md, "Idempotent intake").

Where an id can be, from the moment intake accepts it:

- accepted, appended to message_log, not yet replayed: in ``_unindexed`` (id -> due_ms),
  which the replayer empties as it indexes (``indexed``);
- replayed: in the id index (IdIndex, on disk), which ``lookup`` settles exactly.

Looking every id up in the index would cost several preads per message, so a HashFilter
stands in front of it: an id it has never seen is new at the cost of one hash and one
word. Every id intake accepts is added, and at start-up ``warm_up`` adds every id the
index held before this process (in a worker thread: 10 million entries take seconds).
Until then the filter is not trusted and every id is looked up.

Pure logic, one thread (the event loop), except ``build_warm_filter``.
"""

from __future__ import annotations

from xxhash import xxh64_intdigest

from delayd.logs.id_index import IdIndex
from storage.hashfilter import DEFAULT_WORD_BITS, U32, HashFilter
from storage.indexfile import HashSource, read_key_hashes


class KnownIds:
    """The ids this delay server holds; see the module docstring.

    Counters for metrics: ``lookups`` (index lookups made), ``duplicates`` (ids found
    held), ``false_maybes`` (lookups of ids the filter could not rule out that were
    new)."""

    def __init__(self, index: IdIndex, *, word_bits: int = DEFAULT_WORD_BITS) -> None:
        self.index = index
        self.filter = HashFilter(word_bits)
        self._words, self._shift = self.filter.inline_view()
        self.warm = False  # the filter holds every indexed id (warm_up done)
        self._unindexed: dict[bytes, int] = {}
        self.lookups = 0
        self.duplicates = 0
        self.false_maybes = 0

    @property
    def unindexed_count(self) -> int:
        return len(self._unindexed)

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

    def warm_sources(self) -> list[HashSource]:
        """What ``build_warm_filter`` reads: the index's entries as they are now. Take
        it on the event loop once replay has caught up with message_log, so every id
        held before this process started is in the index."""
        return self.index.store.hash_sources()

    def build_warm_filter(self, sources: list[HashSource]) -> HashFilter | None:
        """A filter of every key hash in ``sources`` (may run in a worker thread), or
        None when a file that still exists could not be read: a filter missing its ids
        would call resends new, so the caller keeps looking every id up. A file closed
        and gone meanwhile was deleted by retention: its ids are no longer held."""
        built = HashFilter(self.filter.word_bits)
        for source in sources:
            try:
                for hashes in read_key_hashes(source):
                    built.add_all(hashes)
            except OSError:
                if source.fs.exists(source.path):
                    built.close()
                    return None
        return built

    def close(self) -> None:
        self.filter.close()
