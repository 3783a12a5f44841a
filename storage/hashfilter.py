"""HashFilter: "certainly not indexed" for 32-bit key hashes, in constant memory.

An IndexStore lookup costs a few preads per index file, far more than an intake of one
message; a lookup for every message sent would cut intake to a fraction. Nearly every id
sent is new, though, and a Bloom filter answers "new" for those in ~0.15 µs and "maybe"
for the rest, which the index then settles exactly.

The filter is blocked (Putze, Sanders and Singler, "Cache-, Hash- and Space-Efficient
Bloom Filters"): each hash sets two bits of one 64-bit word, so a probe reads one word.
It is keyed by the 32-bit hash an IndexFile entry already stores (the low 32 bits of
xxh64), so it can be rebuilt from the index files alone, without reading a key. Any
wider hash may be given; only its low 32 bits count::

    word = hash >> (32 - word_bits) & (2**word_bits - 1)   the top bits pick the word
    mask = MASKS[hash & 4095]                              two bits of it, from the low 12:
         = 1 << (hash & 63) | 1 << (hash >> 6 & 63)        a table spares the arithmetic

Up to 2**20 words the word and mask bits are independent: four hashes a word give 1.7 %
false "maybe" answers, two 0.5 % (measured). Bigger filters share bits between the two
(32 bits are all an index entry keeps): 3.7 % at 2**22 words and four a word, 7 % at
2**24. The words are anonymous memory, resident only once touched. A filter never
forgets: a key whose record is gone only costs a false "maybe".

Not thread-safe: ``add`` is a read-modify-write of a word. A rebuild in a worker thread
fills a filter of its own, which then replaces the old one (delayd.logs.known_ids).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Sequence

WORD_SIZE = 8
MAX_WORD_BITS = 26  # 512 MiB
MASK_BITS = 12
MASKS = tuple(1 << (low & 63) | 1 << (low >> 6 & 63) for low in range(1 << MASK_BITS))


class HashFilter:
    """A blocked Bloom filter of 32-bit hashes; see the module docstring."""

    def __init__(self, word_bits: int) -> None:
        if not 6 <= word_bits <= MAX_WORD_BITS:
            raise ValueError(f"word_bits must be in 6..{MAX_WORD_BITS}, got {word_bits}")
        self.word_bits = word_bits
        self._shift = 32 - word_bits
        self._word_mask = (1 << word_bits) - 1
        # Anonymous memory is zero and costs no RSS until a word is written.
        self._memory = mmap.mmap(-1, WORD_SIZE << word_bits)
        self._words = memoryview(self._memory).cast("Q")
        self.added = 0  # hashes added by add_all (a rebuild), for the log and metrics

    @property
    def size_bytes(self) -> int:
        return WORD_SIZE << self.word_bits

    def may_contain(self, hash_: int) -> bool:
        """False: ``hash_`` was never added. True: it may have been."""
        mask = MASKS[hash_ & 4095]
        return self._words[hash_ >> self._shift & self._word_mask] & mask == mask

    def add_many(self, hashes: Iterable[int]) -> list[int] | None:
        """Add each of ``hashes``; returns those that may have been in already (an
        earlier one of ``hashes`` counts), or None when none was. One loop for a batch,
        with no more per hash than the probe: this is intake's hot path."""
        words, shift, word_mask, masks = self._words, self._shift, self._word_mask, MASKS
        maybes: list[int] | None = None
        for h in hashes:
            mask = masks[h & 4095]
            word = h >> shift & word_mask
            old = words[word]
            if old & mask != mask:
                words[word] = old | mask
            elif maybes is None:
                maybes = [h]
            else:
                maybes.append(h)
        return maybes

    def add_all(self, hashes: Sequence[int]) -> None:
        """Add each of ``hashes`` (a rebuild: no answer wanted)."""
        words, shift, word_mask, masks = self._words, self._shift, self._word_mask, MASKS
        for h in hashes:
            words[h >> shift & word_mask] |= masks[h & 4095]
        self.added += len(hashes)

    def close(self) -> None:
        self._words.release()
        self._memory.close()
