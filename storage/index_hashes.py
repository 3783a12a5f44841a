"""The key hashes of an index file's entries, read without the IndexFile's lock.

delayd's known-ids filter (delayd.logs.known_ids) is built from the hashes every
entry already carries (storage.indexfile: ``key_hash`` is an entry's first u32), so it
never reads the records. ``IndexFile.hash_source`` takes a consistent snapshot: the
entries on disk, named by the file's descriptor, and the buffered ones copied.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterator, Sequence

from storage.indexfile import ENTRY_SIZE, REPLAY_CHUNK, HashSource

_BIG_ENDIAN = sys.byteorder == "big"


def read_key_hashes(source: HashSource) -> Iterator[Sequence[int]]:
    """The key hashes of ``source``'s entries, oldest first, a chunk at a time. Reads
    with the file's own descriptor, so it may run in a worker thread; raises OSError when
    the file was closed meanwhile (retention deleted it: its keys need no hashes)."""
    done = 0
    while done < source.flushed:
        count = min(REPLAY_CHUNK, source.flushed - done)
        position = source.entries_start + done * ENTRY_SIZE
        data = source.fs.pread(source.fd, count * ENTRY_SIZE, position)
        if len(data) < count * ENTRY_SIZE:
            raise OSError(f"index entries end early at byte {position + len(data)}")
        yield _key_hashes(data)
        done += count
    if source.pending:
        yield _key_hashes(source.pending)


def _key_hashes(entries: bytes) -> Sequence[int]:
    """The first u32 of every ENTRY_SIZE-byte entry of ``entries``."""
    words = array("I", entries)
    if _BIG_ENDIAN:
        words.byteswap()
    return words[:: ENTRY_SIZE // 4]
