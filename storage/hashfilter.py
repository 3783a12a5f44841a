"""HashFilter: "certainly not indexed" for 32-bit key hashes, in constant memory.

An IndexStore lookup costs a few preads per index file, far more than an intake of one
message; a lookup for every message sent would cut intake to a fraction. Nearly every id
sent is new, though, and a Bloom filter answers "new" for those in a few hundred
nanoseconds and "maybe" for the rest, which the index then settles exactly.

The filter is blocked (Putze, Sanders and Singler, "Cache-, Hash- and Space-Efficient
Bloom Filters"): each hash sets two bits of one 64-bit word, so a probe reads one word.
It is keyed by the 32-bit hash an IndexFile entry already stores (the low 32 bits of
xxh64), so it can be rebuilt from the index files alone, without reading a key::

    word = hash >> (32 - word_bits)                 the top bits pick the word
    mask = 1 << (hash & 63) | 1 << (hash >> 6 & 63) two bits of it

Four hashes a word give 1.7 % false "maybe" answers, two 0.5 %, one 0.2 % (measured);
2**22 words (32 MiB) hold 16 million hashes at 1.7 %. The words are anonymous memory,
resident only once touched. A filter never forgets: removing a key is not possible, and a key whose
record is gone only costs a false "maybe".

Not thread-safe: ``add`` is a read-modify-write of a word. A rebuild in a worker thread
fills a filter of its own, which then replaces the old one (delayd.logs.known_ids).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import xxhash

DEFAULT_WORD_BITS = 22  # 2**22 words of 8 bytes: 32 MiB
WORD_SIZE = 8
U32 = (1 << 32) - 1


def key_hash(key: bytes) -> int:
    """The 32-bit hash of ``key`` that IndexFile stores in its entries."""
    return xxhash.xxh64_intdigest(key) & U32


class HashFilter:
    """A blocked Bloom filter of 32-bit hashes; see the module docstring."""

    def __init__(self, word_bits: int = DEFAULT_WORD_BITS) -> None:
        if not 6 <= word_bits <= 26:
            raise ValueError(f"word_bits must be in 6..26, got {word_bits}")
        self.word_bits = word_bits
        self._shift = 32 - word_bits
        # Anonymous memory is zero and costs no RSS until a word is written.
        self._memory = mmap.mmap(-1, WORD_SIZE << word_bits)
        self._words = memoryview(self._memory).cast("Q")
        self.added = 0  # hashes added that were not in yet (add), or all (add_all)

    @property
    def size_bytes(self) -> int:
        return WORD_SIZE << self.word_bits

    def add(self, hash32: int) -> bool:
        """Put ``hash32`` in; returns whether it may have been in already."""
        word = hash32 >> self._shift
        mask = 1 << (hash32 & 63) | 1 << (hash32 >> 6 & 63)
        words = self._words
        old = words[word]
        if old & mask == mask:
            return True
        words[word] = old | mask
        self.added += 1
        return False

    def may_contain(self, hash32: int) -> bool:
        """False: ``hash32`` was never added. True: it may have been."""
        mask = 1 << (hash32 & 63) | 1 << (hash32 >> 6 & 63)
        return self._words[hash32 >> self._shift] & mask == mask

    def inline_view(self) -> tuple[memoryview, int]:
        """(the words, the word shift): for a caller that inlines ``add`` in its hot
        loop, as KnownIds.claim does. Word ``h >> shift`` holds ``h``'s two bits."""
        return self._words, self._shift

    def add_all(self, hashes: Sequence[int]) -> None:
        """``add`` of each of ``hashes`` (a rebuild: no answer wanted)."""
        words, shift = self._words, self._shift
        for h in hashes:
            words[h >> shift] |= 1 << (h & 63) | 1 << (h >> 6 & 63)
        self.added += len(hashes)

    def close(self) -> None:
        self._words.release()
        self._memory.close()
