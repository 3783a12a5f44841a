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

Up to 2**20 words the word takes at most the top 20 bits and the mask the low 12: four
hashes a word give 1.7 % false "maybe" answers, two 0.5 % (measured). A bigger filter
leaves fewer than 12 bits for the mask (32 bits are all an index entry keeps), and
reading 12 anyway would make its word choose some of its mask bits: a mask's second
bit confined to a quarter of the word at 2**22 words, to one bit in 16 at 2**24 (3.7 %
and 7 % false "maybe" at four a word, which a filling server pays for in index
lookups). So a bigger filter takes its mask from the bits its word leaves, through a
table of that many two-bit masks spread over all 2,016 pairs of a word's bits
(``spread_masks``): the word and the mask stay independent, and four hashes a word give
1.5 % at 2**22 words, 2.6 % at 2**24 (where equal 32-bit hashes alone make 1.6 %).
The words are anonymous memory, resident only once touched. A filter never forgets: a
key whose record is gone only costs a false "maybe".

Not thread-safe: ``add`` is a read-modify-write of a word. A rebuild in a worker thread
fills a filter of its own, which then replaces the old one (delayd.logs.known_ids).
"""

from __future__ import annotations

import functools
import itertools
import mmap
import random
from collections.abc import Iterable, Sequence

WORD_SIZE = 8
MAX_WORD_BITS = 26  # 512 MiB
HASH_BITS = 32  # what an index entry keeps of a key's hash
MASK_BITS = 12
MASKS = tuple(1 << (low & 63) | 1 << (low >> 6 & 63) for low in range(1 << MASK_BITS))


@functools.cache
def spread_masks(bits: int) -> tuple[int, ...]:
    """``2**bits`` two-bit masks: pairs of a word's 64 bits drawn evenly from all 2,016
    (each once while there are enough), the masks of a filter whose word leaves only
    ``bits`` bits of the hash. The same on every run (a fixed seed)."""
    pairs = list(itertools.combinations(range(64), 2))
    random.Random(0).shuffle(pairs)
    return tuple(1 << a | 1 << b for a, b in itertools.islice(itertools.cycle(pairs), 1 << bits))


class HashFilter:
    """A blocked Bloom filter of 32-bit hashes; see the module docstring."""

    def __init__(self, word_bits: int) -> None:
        if not 6 <= word_bits <= MAX_WORD_BITS:
            raise ValueError(f"word_bits must be in 6..{MAX_WORD_BITS}, got {word_bits}")
        self.word_bits = word_bits
        self._shift = HASH_BITS - word_bits
        self._word_mask = (1 << word_bits) - 1
        if self._shift >= MASK_BITS:
            self._masks, self._mask_index = MASKS, (1 << MASK_BITS) - 1
        else:
            self._masks, self._mask_index = spread_masks(self._shift), (1 << self._shift) - 1
        # Anonymous memory is zero and costs no RSS until a word is written.
        self._memory = mmap.mmap(-1, WORD_SIZE << word_bits)
        self._words = memoryview(self._memory).cast("Q")
        self.added = 0  # hashes added by add_all (a rebuild), for the log and metrics

    @property
    def size_bytes(self) -> int:
        return WORD_SIZE << self.word_bits

    def may_contain(self, hash_: int) -> bool:
        """False: ``hash_`` was never added. True: it may have been."""
        mask = self._masks[hash_ & self._mask_index]
        return self._words[hash_ >> self._shift & self._word_mask] & mask == mask

    def add_many(self, hashes: Iterable[int]) -> list[int] | None:
        """Add each of ``hashes``; returns those that may have been in already (an
        earlier one of ``hashes`` counts), or None when none was. One loop for a batch,
        with no more per hash than the probe: this is intake's hot path."""
        words, shift, word_mask = self._words, self._shift, self._word_mask
        masks, mask_index = self._masks, self._mask_index
        maybes: list[int] | None = None
        for h in hashes:
            mask = masks[h & mask_index]
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
        words, shift, word_mask = self._words, self._shift, self._word_mask
        masks, mask_index = self._masks, self._mask_index
        for h in hashes:
            words[h >> shift & word_mask] |= masks[h & mask_index]
        self.added += len(hashes)

    def close(self) -> None:
        self._words.release()
        self._memory.close()
