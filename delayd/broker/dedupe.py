"""IdWindow: the message ids the broker stored recently, compact and exact.

This is what turns delayd's at-least-once delay sender into once-only delivery: a
message whose id is in the window is acknowledged DUPLICATE and not stored again. It
must never call a new id a duplicate, and must not cost a gigabyte (a Python set of
10 M str ids does), so it keeps no ids at all:

* a FIFO **ring** of (fingerprint u64, commitlog offset u64) per stored id, oldest first
  — 16 B per id, grown on demand up to ``max_ids``;
* an open-addressing **table** (linear probing, load <= 0.6) of u32 ring positions + 1
  (0 = empty), indexed by the fingerprint — 4 B per slot, 6.7 B per id at full load,
  allocated at full size up front so that it never rehashes (a 10 M rehash in Python
  would stall the broker for seconds);
* **time marks**: (ring sequence, store_ms) at most one per ``MARK_MS``, to evict by age
  without storing a time per id.

A fingerprint hit is a candidate only: ``read_id(offset)`` reads the record and the
ids are compared byte for byte, so a 64-bit collision (forced in the tests) costs a
read, never a wrong answer. Ids enter the ring in the same synchronous step as their
record enters the commitlog, before the reput has indexed them, so a resend arriving at
any later moment finds them.

Eviction keeps an id at least ``window_ms`` (by store time) unless ``max_ids`` newer ids
pushed it out: both are lower bounds on what is remembered, never upper bounds. Deletion
is Knuth's backward shift (TAOCP 6.4, Algorithm R), so the table has no tombstones
however long the FIFO churns. Memory at full load: 16 + 4 / 0.6 ~ 22.7 B per id (about
227 MB for 10 M ids). Time is an argument (``now_ms``); nothing here reads a clock.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Sequence

import xxhash

MAX_LOAD = 0.6  # linear probing: ~3.6 probes per miss at this load, 1.75 per hit
MARK_MS = 1000  # granularity of age-based eviction

Fingerprint = Callable[[bytes], int]
ReadId = Callable[[int], "bytes | None"]


def default_fingerprint(message_id: bytes) -> int:
    """xxh64 of the id's UTF-8 bytes, seed 0."""
    return xxhash.xxh64_intdigest(message_id)


def table_size_for(max_ids: int) -> int:
    """Slots for ``max_ids`` ids: the power of two keeping the load at most MAX_LOAD."""
    size = 8
    while size * MAX_LOAD < max_ids:
        size *= 2
    return size


class IdWindow:
    """The ids of the last ``max_ids`` records stored within ``window_ms``; see module doc.

    ``read_id(offset)`` returns the message id (UTF-8 bytes) of the record at a commitlog
    offset, or None when there is none there; ``fingerprint`` is injectable so that tests
    can force collisions.
    """

    def __init__(
        self,
        max_ids: int,
        window_ms: int,
        read_id: ReadId,
        fingerprint: Fingerprint = default_fingerprint,
    ) -> None:
        if not 0 < max_ids < 2**32:
            raise ValueError(f"max_ids must be in 1..2**32-1, got {max_ids}")
        if window_ms <= 0:
            raise ValueError(f"window_ms must be positive, got {window_ms}")
        self.max_ids = max_ids
        self.window_ms = window_ms
        self._read_id = read_id
        self._fingerprint = fingerprint
        size = table_size_for(max_ids)
        self._mask = size - 1
        self._table = array("I", bytes(4 * size))  # ring position + 1, 0 = empty
        self._fps = array("Q")  # ring: fingerprint per position
        self._offsets = array("Q")  # ring: commitlog offset per position
        self._head = 0  # sequence number of the next id added
        self._tail = 0  # sequence number of the oldest id kept
        self._marks: deque[tuple[int, int]] = deque()  # (first sequence, its store_ms)
        self.verifications = 0  # fingerprint hits checked against a record
        self.collisions = 0  # ... of which were another id

    def __len__(self) -> int:
        return self._head - self._tail

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the table and the ring (the time marks are negligible)."""
        return (
            self._table.itemsize * len(self._table)
            + self._fps.itemsize * len(self._fps)
            + self._offsets.itemsize * len(self._offsets)
        )

    @property
    def oldest_offset(self) -> int | None:
        """Commitlog offset of the oldest id kept: a rebuild after restart scans from here."""
        if self._head == self._tail:
            return None
        return self._offsets[self._tail % self.max_ids]

    def find(self, message_id: bytes) -> int | None:
        """The commitlog offset of the stored record with ``message_id``, or None.

        Every fingerprint hit is verified with ``read_id``; None is exact for ids in the
        window.
        """
        return self._probe(message_id, self._fingerprint(message_id))

    def find_batch(self, message_ids: Sequence[bytes]) -> tuple[list[int], dict[int, int]]:
        """:meth:`find` of every id, in one call: (the ids' fingerprints, for
        :meth:`add_batch`; {position in ``message_ids``: commitlog offset} of the ids
        stored). The append path looks up every id of a batch before adding any."""
        fps = list(map(self._fingerprint, message_ids))
        table, mask = self._table, self._mask
        hits: dict[int, int] = {}
        for i, fp in enumerate(fps):
            if table[fp & mask]:  # an empty home slot is a miss without probing
                offset = self._probe(message_ids[i], fp)
                if offset is not None:
                    hits[i] = offset
        return fps, hits

    def _probe(self, message_id: bytes, fp: int) -> int | None:
        table, fps, mask = self._table, self._fps, self._mask
        slot = fp & mask
        while True:
            entry = table[slot]
            if not entry:
                return None
            if fps[entry - 1] == fp:
                offset = self._offsets[entry - 1]
                self.verifications += 1
                if self._read_id(offset) == message_id:
                    return offset
                self.collisions += 1
            slot = (slot + 1) & mask

    def add(self, message_id: bytes, offset: int, store_ms: int) -> None:
        """Remember ``message_id`` stored at commitlog ``offset`` at ``store_ms``.

        A mark starts a new block when ``store_ms`` reaches the last mark + MARK_MS, so
        every id of a block was stored before its mark + MARK_MS even if the clock went
        back: age eviction stays conservative. The oldest id is evicted when ``max_ids``
        are kept.
        """
        if self._head - self._tail >= self.max_ids:
            self._evict_one()
        seq = self._head
        marks = self._marks
        if not marks or store_ms >= marks[-1][1] + MARK_MS:
            marks.append((seq, store_ms))
        position = seq % self.max_ids
        fp = self._fingerprint(message_id)
        if position == len(self._fps):
            self._fps.append(fp)
            self._offsets.append(offset)
        else:
            self._fps[position] = fp
            self._offsets[position] = offset
        table, mask = self._table, self._mask
        slot = fp & mask
        while table[slot]:
            slot = (slot + 1) & mask
        table[slot] = position + 1
        self._head = seq + 1

    def add_batch(
        self,
        message_ids: Sequence[bytes],
        offsets: Sequence[int],
        store_ms: int,
        fingerprints: Sequence[int] | None = None,
    ) -> None:
        """``add`` of each id at its offset, all stored at ``store_ms``: the same result,
        with the per-id work in one loop (the append path adds every stored id).
        ``fingerprints``, when given, are the ids' (from :meth:`find_batch`)."""
        if not message_ids:
            return
        if fingerprints is None:
            fingerprints = list(map(self._fingerprint, message_ids))
        elif len(fingerprints) != len(message_ids):
            raise ValueError(f"{len(fingerprints)} fingerprints for {len(message_ids)} ids")
        marks = self._marks
        if not marks or store_ms >= marks[-1][1] + MARK_MS:
            marks.append((self._head, store_ms))
        max_ids = self.max_ids
        table, mask, fps, ring_offsets = self._table, self._mask, self._fps, self._offsets
        seq = self._head
        for fp, offset in zip(fingerprints, offsets, strict=True):
            if seq - self._tail >= max_ids:
                self._head = seq
                self._evict_one()
            position = seq % max_ids
            if position == len(fps):
                fps.append(fp)
                ring_offsets.append(offset)
            else:
                fps[position] = fp
                ring_offsets[position] = offset
            slot = fp & mask
            while table[slot]:
                slot = (slot + 1) & mask
            table[slot] = position + 1
            seq += 1
        self._head = seq

    def expire(self, now_ms: int) -> int:
        """Forget ids stored more than ``window_ms`` before ``now_ms``; returns how many.

        An id is forgotten only once its whole mark block (ids stored within MARK_MS of
        each other) is older than the window, so the window is never cut short.
        """
        limit = now_ms - self.window_ms
        marks = self._marks
        forgotten = 0
        while marks and marks[0][1] + MARK_MS <= limit:
            marks.popleft()
            stop = marks[0][0] if marks else self._head
            while self._tail < stop:
                self._evict_one()
                forgotten += 1
        return forgotten

    def _evict_one(self) -> None:
        position = self._tail % self.max_ids
        table, fps, mask = self._table, self._fps, self._mask
        slot = fps[position] & mask
        while table[slot] != position + 1:
            slot = (slot + 1) & mask
        # Backward shift: pull later members of the cluster into the hole unless their
        # home slot lies cyclically in (hole, here], where they must stay.
        hole = slot
        probe = slot
        while True:
            probe = (probe + 1) & mask
            entry = table[probe]
            if not entry:
                break
            home = fps[entry - 1] & mask
            if (hole < probe and hole < home <= probe) or (
                hole > probe and (home > hole or home <= probe)
            ):
                continue
            table[hole] = entry
            hole = probe
        table[hole] = 0
        self._tail += 1
        marks = self._marks
        if len(marks) > 1 and marks[1][0] <= self._tail:
            marks.popleft()
