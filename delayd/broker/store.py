"""BrokerStore: the broker's files — commitlog, consume queues, index, reput checkpoint.

Layout under ``<data>/broker/``::

    commitlog/<20-digit offset>            storage.segmented_log, message records (record.py)
    consumequeue/<subject>/<queue>/...     storage.consumequeue, one per (subject, queue)
    index/<20-digit offset>                storage.indexfile: "i\\0<id>" and "k\\0<subject>\\0<key>"
    reput.checkpoint                       storage.checkpoint blob holding JSON (below)
    offsets/<20-digit generation>          offsets.py (the committed offsets' log)

The commitlog is the truth; consume queues and index are derived from it by the reput
(RocketMQ's ReputMessageService), only up to the commitlog's durable offset, so a crash
never leaves them ahead of it. The append path hands each appended batch to the reput in
memory (the record bytes and what the reput needs of each: queue, index keys), so
nothing is parsed again; after a restart :meth:`open` re-derives what the checkpoint
does not cover from the records.

Reput checkpoint (JSON in a crc-checked, atomically replaced blob)::

    {"offset": O, "queues": {"<subject>/<queue>": end_index}, "dedupe_from": D}

``offset``: every record below O is in its queue and in the index; ``queues``: the
end_index each queue's flush() returned after O was taken (entries past O may be among
them; rebuild skips those); ``dedupe_from``: where the idempotency window's rebuild scan
starts. Recovery (the consume queue author's recipe, docs/storage-format.md):
commitlog recovery, then per queue ``truncate_to(saved)`` — or ``truncate_beyond(O)``
for a queue the checkpoint does not name (created after it) — then
``storage.consumequeue.rebuild`` from O; the index is cut back to O (or to its own
``reindex_from``) and re-put from there.

Threading: everything runs on the event loop except the fsyncs (LogWriter's flusher and
:meth:`flush_derived`), which the storage classes allow in a worker thread.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import trio

from delayd.broker.config import BrokerConfig
from delayd.broker.record import (
    RECORD_TYPE,
    RecordError,
    decode_record,
    delivered,
    record_identity,
    record_position,
    record_summary,
)
from delayd.protocol.events import Message
from storage.checkpoint import read_checkpoint, write_checkpoint
from storage.consumequeue import ConsumeQueue, rebuild
from storage.errors import CorruptionError, DiskFullError, StorageError
from storage.flusher import FlushMode, LogWriter
from storage.framing import HEADER_SIZE
from storage.fs import REAL_FS, FileSystem, create_dirs_durably
from storage.index_store import IndexStore
from storage.segmented_log import Record, SegmentedLog

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "reput.checkpoint"
QueueKey = tuple[str, int]  # (subject, queue)
# Bytes a cached record costs beyond its payload: the bytes object's header (33), its
# dict entry (~48 at two-thirds load) and key (an int, 32), its commitlog offset in an
# array (8), with room for over-allocation.
CACHED_RECORD_OVERHEAD = 128
# A cache miss reads the commitlog span from the first missing record to the last with
# one scan when the records wanted make up at least this share of it (other queues'
# records lie in between), else each record with its own read. The scanned span's
# records are kept until the next scan (read-ahead): a consumer of several queues of a
# subject reads the same span for each of them, as its PULLs take the queues in turn.
MIN_SCAN_DENSITY = 1 / 8


def _no_limit() -> int:
    return 1 << 63


def id_index_key(message_id: str | bytes) -> bytes:
    raw = message_id.encode() if isinstance(message_id, str) else message_id
    return b"i\x00" + raw


def key_index_key(subject: str | bytes, key: str | bytes) -> bytes:
    s = subject.encode() if isinstance(subject, str) else subject
    k = key.encode() if isinstance(key, str) else key
    return b"k\x00" + s + b"\x00" + k


class _Until:
    """A commitlog read only below ``until`` (what ``rebuild`` scans)."""

    def __init__(self, commitlog: SegmentedLog, until: int) -> None:
        self.commitlog = commitlog
        self.until = until

    def iter_from(self, offset: int) -> Iterator[Record]:
        return self.commitlog.iter_from(offset, until=self.until)


@dataclass
class ReputCheckpoint:
    offset: int
    queues: dict[QueueKey, int] = field(default_factory=dict)
    dedupe_from: int | None = None

    def encode(self) -> bytes:
        queues = {f"{s}/{q}": end for (s, q), end in sorted(self.queues.items())}
        doc = {"offset": self.offset, "queues": queues, "dedupe_from": self.dedupe_from}
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def decode(cls, path: str, data: bytes) -> ReputCheckpoint:
        try:
            doc = json.loads(data)
            queues: dict[QueueKey, int] = {}
            for name, end in doc["queues"].items():
                subject, _, queue = name.rpartition("/")
                queues[(subject, int(queue))] = int(end)
            dedupe_from = doc["dedupe_from"]
            return cls(
                int(doc["offset"]), queues, None if dedupe_from is None else int(dedupe_from)
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptionError(path, 0, len(data), f"bad reput checkpoint: {exc}") from None


class _Appended(NamedTuple):
    """One appended batch, until the reput has moved it into queues and the index."""

    end: int  # commitlog offset after its last record
    store_ms: int
    offsets: list[int]  # commitlog offset of each record
    payloads: list[bytes]
    queue_keys: list[QueueKey]  # (subject, queue) of each record
    queue_offsets: list[int]
    index_keys: list[bytes]  # in put order
    key_records: list[int] | None  # record of each index key; None: one key per record


class _Held(NamedTuple):
    """A record hidden from PULL and QUERY (BrokerStore.hold_unacknowledged)."""

    offset: int  # in the commitlog
    end: int  # the commitlog offset after it: shown once the group acknowledged this far
    key: QueueKey
    queue_offset: int


class _Run:
    """Consecutive records of one queue: queue offsets ``base`` to ``end - 1``.

    Kept in containers the garbage collector does not walk: a dict of ints to bytes
    (CPython untracks it) and an array. A list of 270 000 payloads would be walked,
    element by element, by every full collection (~30 ms each at 64 MiB).
    """

    __slots__ = ("base", "head", "offsets", "payloads")

    def __init__(self, base: int) -> None:
        self.base = base
        self.head = 0  # position of ``base`` in ``offsets``; earlier ones are evicted
        self.offsets = array("Q")  # commitlog offset of each, from position ``head``
        self.payloads: dict[int, bytes] = {}  # by queue offset

    @property
    def end(self) -> int:
        return self.base + len(self.offsets) - self.head

    def extend(self, offsets: list[int], payloads: list[bytes]) -> None:
        end = self.end
        self.payloads.update(zip(range(end, end + len(payloads)), payloads, strict=True))
        self.offsets.extend(offsets)

    def drop(self, count: int) -> None:
        """Forget the oldest ``count`` records (evicted array slots are cut in bulk once
        they are half of it: O(1) per record, not a move of the whole run each time)."""
        payloads = self.payloads
        for queue_offset in range(self.base, self.base + count):
            del payloads[queue_offset]
        self.base += count
        self.head += count
        if self.head * 2 >= len(self.offsets):
            del self.offsets[: self.head]
            self.head = 0

    def read(self, start: int, stop: int) -> tuple[list[int], list[bytes]]:
        stop = min(stop, self.end)
        i = start - self.base + self.head
        offsets = self.offsets[i : i + stop - start].tolist()
        return offsets, list(map(self.payloads.__getitem__, range(start, stop)))


class RecentRecords:
    """The newest records of each queue, by queue offset, bounded in bytes.

    PULLs near the head of a queue (the common case: long-polling consumers) are served
    from here without reading the consume queue or the commitlog. The reput adds the
    records of each pass per queue, in queue order, so a queue's cached records are one
    dense run ending at the queue's end, exactly what its consume queue entries point
    at: nothing read from here needs checking. Eviction is FIFO across queues, a reput
    pass's records of one queue at a time.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._runs: dict[QueueKey, _Run] = {}
        self._chunks: deque[tuple[_Run, int, int]] = deque()  # (run, records, bytes)

    def __len__(self) -> int:
        return sum(run.end - run.base for run in self._runs.values())

    def extend(
        self, key: QueueKey, queue_offset: int, offsets: list[int], payloads: list[bytes]
    ) -> None:
        """Cache the records of queue ``key`` from ``queue_offset`` on (the next ones)."""
        if not self.max_bytes:
            return
        run = self._runs.get(key)
        if run is None or run.end != queue_offset:
            # A queue's first records this run (a gap cannot happen: the reput adds every
            # record of a queue, in order; a run left empty by eviction just moves on).
            assert run is None or run.end == run.base, (key, run.end, queue_offset)
            run = self._runs[key] = _Run(queue_offset)
        run.extend(offsets, payloads)
        size = sum(map(len, payloads)) + CACHED_RECORD_OVERHEAD * len(payloads)
        self._chunks.append((run, len(payloads), size))
        self.bytes += size
        while self.bytes > self.max_bytes:
            run, count, size = self._chunks.popleft()
            run.drop(count)
            self.bytes -= size

    def forget(self, keys: Iterable[QueueKey]) -> None:
        """Drop what is cached of the queues ``keys``: they grew by a reput that does not
        cache (a follower's), so their runs no longer end at the queue's end. Their
        bytes stay counted until the FIFO eviction reaches them."""
        for key in keys:
            self._runs.pop(key, None)

    def read(self, key: QueueKey, start: int, stop: int) -> tuple[list[int], list[bytes]]:
        """(commitlog offsets, payloads) of the cached records of ``key`` with queue
        offsets in [start, stop); empty unless ``start`` is cached."""
        run = self._runs.get(key)
        if run is None or not run.base <= start < run.end:
            return [], []
        return run.read(start, stop)

    def cached_from(self, key: QueueKey) -> int | None:
        """The oldest queue offset of ``key`` cached, None when none is."""
        run = self._runs.get(key)
        return run.base if run is not None and run.end > run.base else None


class BrokerStore:
    """The broker's on-disk state; see the module docstring. Use :meth:`open`."""

    def __init__(self, directory: str, config: BrokerConfig, fs: FileSystem) -> None:
        self.directory = directory
        self.config = config
        self.fs = fs
        self.commitlog: SegmentedLog
        self.writer: LogWriter
        self.index: IndexStore
        self.checkpoint: ReputCheckpoint | None = None  # as found at open
        self.queues: dict[QueueKey, ConsumeQueue] = {}
        # The queue offset the next record of each queue gets; Broker.append_batch takes
        # them in the same synchronous step as it appends the records.
        self.next_queue_offset: dict[QueueKey, int] = {}
        self.reput_offset = 0  # every record below it is in its queue and the index
        self.recent = RecentRecords(config.recent_cache_bytes)
        self._read_ahead: dict[int, bytes] = {}  # the last span scanned, by offset
        self.last_store_ms = 0  # store_ms of the newest record seen
        self.on_arrival: Callable[[set[QueueKey]], None] = lambda keys: None
        # Called after every append and every fsync of the commitlog: replication's
        # growth signal (BrokerStreams.grew).
        self.on_grew: Callable[[], None] = lambda: None
        # How far the reput may go: a replicated group's high watermark (what the group
        # acknowledged, delayd.broker.gate), else no bound beyond durability.
        self.reput_limit: Callable[[], int] = _no_limit
        self.messages_stored = 0
        # Appended batches not yet reput, each an _Appended.
        self._pending: deque[_Appended] = deque()
        # Records a promoted member holds in its queues that its group may not have
        # acknowledged (hold_unacknowledged), in commitlog order. PULL and QUERY see
        # none of them until ``reput_limit()`` passes their end (release_held).
        self._held: deque[_Held] = deque()
        self._held_from: dict[QueueKey, int] = {}  # each queue's first held offset
        # Why the last reput pass could not run (a full disk), None when it did.
        self.reput_blocked: DiskFullError | None = None
        # A checkpoint written in a worker thread and a follower's truncation of the
        # derived state take turns; a checkpoint snapshot taken before a truncation
        # (``_cuts`` moved since) is not written: it could name offsets past the cut.
        self._derived_lock = threading.Lock()
        self._cuts = 0

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, data_dir: str, config: BrokerConfig, *, fs: FileSystem = REAL_FS) -> BrokerStore:
        """Open (creating) ``<data_dir>/broker`` and recover it; see the module docstring.

        Raises CorruptionError for damage a crash cannot explain.
        """
        store = cls(os.path.join(data_dir, "broker"), config, fs)
        create_dirs_durably(fs, store.directory)
        store.commitlog = SegmentedLog.open(
            os.path.join(store.directory, "commitlog"), fs=fs, segment_size=config.segment_size
        )
        try:
            store._recover()
        except BaseException:
            store.commitlog.close()
            raise
        # The reput runs in the flusher's step, right after each fsync (reput_durable).
        store.writer = LogWriter(store.commitlog, config.flush, on_durable=store._after_fsync)
        return store

    def _recover(self) -> None:
        fs, commitlog = self.fs, self.commitlog
        path = os.path.join(self.directory, CHECKPOINT_NAME)
        raw = read_checkpoint(fs, path)
        checkpoint = None if raw is None else ReputCheckpoint.decode(path, raw)
        start = commitlog.min_offset
        if checkpoint is not None:
            if checkpoint.offset > commitlog.end_offset:
                raise CorruptionError(
                    path,
                    0,
                    len(raw or b""),
                    f"reput checkpoint is at commitlog offset {checkpoint.offset} but the "
                    f"commitlog ends at {commitlog.end_offset}: durable records are missing",
                )
            start = max(start, checkpoint.offset)
        self.checkpoint = checkpoint
        saved = checkpoint.queues if checkpoint is not None else {}
        for key in self._queue_dirs():
            queue = self._open_queue(key)
            if key in saved:
                queue.truncate_to(saved[key])
            else:
                queue.truncate_beyond(start)
        index_kwargs = {}
        if self.config.index_slot_count is not None:
            index_kwargs["slot_count"] = self.config.index_slot_count
        if self.config.index_max_entries is not None:
            index_kwargs["max_entries"] = self.config.index_max_entries
        self.index = IndexStore.open(os.path.join(self.directory, "index"), fs=fs, **index_kwargs)
        index_from = start
        if self.index.reindex_from is not None:
            index_from = max(commitlog.min_offset, min(start, self.index.reindex_from))
        self.index.truncate_beyond(index_from)
        if index_from < start:
            for record in commitlog.iter_from(index_from, until=start):
                self._index_record(record.offset, record.payload)
        self.index.prepare(commitlog.end_offset)
        rebuilt = self._reput_records(start, commitlog.end_offset)
        log.info(
            "broker store recovered: commitlog [%d, %d), reput from %d re-put %d queue "
            "entries, %d queues",
            commitlog.min_offset,
            commitlog.end_offset,
            start,
            rebuilt,
            len(self.queues),
        )

    def _reput_records(self, start: int, until: int) -> int:
        """Put the commitlog's records in [start, until) into their consume queues and
        the index, as recovery does (and a follower, for the records it received);
        returns how many queue entries were written. Raises CorruptionError when a
        record or a queue does not agree with the commitlog."""
        commitlog = self.commitlog
        last_offset: dict[QueueKey, int] = {}

        def queue_for(record: Record) -> tuple[ConsumeQueue, int]:
            if record.type != RECORD_TYPE:
                raise CorruptionError(
                    commitlog.directory, record.offset, 0, f"record type {record.type}"
                )
            message = self._index_record(record.offset, record.payload)
            key = (message.subject, message.queue)
            last_offset[key] = message.queue_offset
            queue = self.queues.get(key) or self._open_queue(key)
            return queue, 0

        rebuilt = rebuild(queue_for, _Until(commitlog, until), start)
        for key, queue in self.queues.items():
            self.next_queue_offset[key] = queue.end_index
            if key in last_offset and last_offset[key] + 1 != queue.end_index:
                raise CorruptionError(
                    queue.directory,
                    0,
                    0,
                    f"queue {key} ends at index {queue.end_index} but its last record in the "
                    f"commitlog has queue_offset {last_offset[key]}",
                )
        self.reput_offset = until
        return rebuilt

    def _index_record(self, offset: int, payload: bytes) -> Message:
        try:
            message = decode_record(payload, offset)
        except RecordError as exc:
            raise CorruptionError(
                self.commitlog.directory, offset, len(payload), str(exc)
            ) from None
        self.index.put(id_index_key(message.message_id), offset, message.store_ms)
        if message.key is not None:
            self.index.put(key_index_key(message.subject, message.key), offset, message.store_ms)
        self.last_store_ms = max(self.last_store_ms, message.store_ms)
        return message

    def _queue_dirs(self) -> list[QueueKey]:
        root = os.path.join(self.directory, "consumequeue")
        if not self.fs.exists(root):
            return []
        keys = []
        for subject in sorted(self.fs.listdir(root)):
            for queue in self.fs.listdir(os.path.join(root, subject)):
                if queue.isdigit():
                    keys.append((subject, int(queue)))
        return keys

    def _open_queue(self, key: QueueKey, durable_ancestor: str | None = None) -> ConsumeQueue:
        subject, queue_id = key
        path = os.path.join(self.directory, "consumequeue", subject, str(queue_id))
        queue = ConsumeQueue.open(path, fs=self.fs, durable_ancestor=durable_ancestor)
        self.queues[key] = queue
        return queue

    def scan_ids(self, start: int, until: int | None = None) -> Iterator[tuple[int, bytes, int]]:
        """(offset, message_id bytes, store_ms) of every record from ``start`` on (below
        ``until``): the idempotency window's rebuild. Raises CorruptionError for a bad
        record."""
        for record in self.commitlog.iter_from(max(start, self.commitlog.min_offset), until):
            try:
                message_id, store_ms = record_summary(record.payload)
            except RecordError as exc:
                raise CorruptionError(
                    self.commitlog.directory, record.offset, len(record.payload), str(exc)
                ) from None
            self.last_store_ms = max(self.last_store_ms, store_ms)
            yield record.offset, message_id, store_ms

    # ------------------------------------------------------------------ appending

    def append(
        self,
        payloads: list[bytes],
        queue_keys: list[QueueKey],
        queue_offsets: list[int],
        index_keys: list[bytes],
        key_records: list[int] | None,
        store_ms: int,
    ) -> list[int]:
        """Append the records ``payloads`` (record.py), all stored at ``store_ms``, and
        hand the reput what it needs of them: each one's queue and queue offset (just
        assigned, in order), and the index keys to put, in order — one per record when
        ``key_records`` is None, else ``key_records[j]`` is the record of key ``j``.
        Returns their commitlog offsets. Written to the OS, not yet durable: await
        :meth:`wait_durable`. Synchronous on purpose: queue offsets and dedupe entries are
        assigned in the same step, so no other task can interleave.

        Raises DiskFullError when the disk is full (nothing of the batch stored, the
        commitlog still usable), StorageError otherwise (the log is then unusable; the
        broker must stop).
        """
        offsets = self.commitlog.append_batch(payloads, RECORD_TYPE)
        end = offsets[-1] + HEADER_SIZE + len(payloads[-1])
        self._pending.append(
            _Appended(
                end,
                store_ms,
                offsets,
                payloads,
                queue_keys,
                queue_offsets,
                index_keys,
                key_records,
            )
        )
        self.messages_stored += len(payloads)
        self.on_grew()
        # Every append asks for an fsync at once, in either flush mode: the reput that
        # follows it makes the records visible (in ``async`` mode, one fsync after the
        # append rather than one flush interval; acks there still do not wait).
        self.writer.request_flush()
        return offsets

    async def _flush(self) -> None:
        """LogWriter.flush, except that a writer stopped by the same cancellation that is
        stopping this task reads as that cancellation, not as a storage failure (on
        shutdown the flusher may exit before the tasks waiting for it)."""
        try:
            await self.writer.flush()
        except StorageError:
            await trio.lowlevel.checkpoint_if_cancelled()
            raise

    async def make_room(self) -> None:
        """Back-pressure before an append: wait while the unsynced bytes exceed half the
        log's bound, so that the append itself never has to fsync on the event loop."""
        while self.commitlog.unsynced_bytes > self.commitlog.max_unsynced_bytes // 2:
            await self._flush()

    async def wait_durable(self) -> None:
        """Return once everything appended so far may be acknowledged under the flush
        policy: durable for ``sync``, at once for ``async``.

        The flusher runs the reput pass right after each fsync, before its waiters wake
        (``on_durable``), so an acknowledged message is already visible to PULL and
        QUERY; the pass here covers records made durable by a flush outside the writer.
        """
        if self.config.flush.mode is FlushMode.SYNC:
            await self._flush()
            self.reput_durable()

    # ------------------------------------------------------------------ reput

    def _after_fsync(self) -> None:
        self.reput_durable()
        self.on_grew()

    def reput_durable(self) -> set[QueueKey]:
        """One reput pass over the appended batches that are durable now (synchronous):
        moves them into their consume queues and the index, then calls ``on_arrival``
        with the queues that grew (which wakes held PULLs: RocketMQ's
        messageArrivingListener). Never ahead of ``durable_offset``, nor of
        ``reput_limit()`` (a batch past it waits for a later pass). Records held at a
        promotion that ``reput_limit()`` now covers are shown first (release_held)."""
        self.release_held()
        durable = min(self.commitlog.durable_offset, self.reput_limit())
        pending = self._pending
        # Per queue: its first queue offset in this pass, offsets, payloads.
        grown: dict[QueueKey, tuple[int, list[int], list[bytes]]] = {}
        taken = 0  # batches of ``pending`` this pass covers
        for batch in pending:
            if batch.end > durable:
                break
            taken += 1
            for key, queue_offset, offset, payload in zip(
                batch.queue_keys, batch.queue_offsets, batch.offsets, batch.payloads, strict=True
            ):
                group = grown.get(key)
                if group is None:
                    group = grown[key] = (queue_offset, [], [])
                group[1].append(offset)
                group[2].append(payload)
        if not taken:
            return set()
        # The consume queues first, all or nothing: a full disk leaves the pass to the
        # next one (the flusher's next fsync, or the checkpoint loop), with nothing of
        # it applied, and never stops the flusher.
        appended: list[tuple[ConsumeQueue, int]] = []
        try:
            for key, (_, offsets, payloads) in grown.items():
                # A queue new while serving: its directories are fsynced by the next
                # flush_derived (before the checkpoint that covers it), not on the loop.
                queue = self.queues.get(key) or self._open_queue(
                    key, durable_ancestor=self.directory
                )
                first = queue.append_records(offsets, [HEADER_SIZE + len(p) for p in payloads])
                appended.append((queue, first))
        except DiskFullError as exc:
            for queue, first in appended:
                queue.truncate_to(first)
            self.reput_blocked = exc
            return set()
        self.reput_blocked = None
        index_put_batch = self.index.put_batch
        for _ in range(taken):
            batch = pending.popleft()
            offsets = batch.offsets
            key_records = batch.key_records
            index_put_batch(
                batch.index_keys,
                offsets if key_records is None else [offsets[j] for j in key_records],
                batch.store_ms,
            )
            self.reput_offset = batch.end
        for key, (queue_offset, offsets, payloads) in grown.items():
            self.recent.extend(key, queue_offset, offsets, payloads)
        self.on_arrival(set(grown))
        return set(grown)

    # ------------------------------------------------------------------ following

    def drop_pending(self) -> None:
        """Forget the appended batches not reput yet (a leader becoming a follower):
        from now on ``reput_replicated`` puts records, reading them from the commitlog
        from ``reput_offset``, so none is put twice."""
        self._pending.clear()
        self._hold([])

    def hold_unacknowledged(self, acknowledged: int) -> None:
        """A member promoted with its queues holding every record it copied: hide the
        ones from commitlog offset ``acknowledged`` (a record boundary: what its old
        leader last told it the group acknowledged) from PULL and QUERY until
        ``reput_limit()`` passes each (:meth:`release_held`). A follower copies ahead of
        the group's acknowledgement, so a record only this member holds may still be
        cut by a later leader: no consumer may have seen it."""
        held = []
        start = max(acknowledged, self.commitlog.min_offset)
        for record in self.commitlog.iter_from(start, until=self.reput_offset):
            message = decode_record(record.payload, record.offset)
            end = record.offset + HEADER_SIZE + len(record.payload)
            key = (message.subject, message.queue)
            held.append(_Held(record.offset, end, key, message.queue_offset))
        self._hold(held)

    def release_held(self) -> None:
        """Show the held records ``reput_limit()`` now covers, waking the PULLs held on
        their queues."""
        limit = self.reput_limit()
        held = self._held
        if not held or held[0].end > limit:
            return
        released = set()
        while held and held[0].end <= limit:
            released.add(held.popleft().key)
        self._hold(held)
        self.on_arrival(released)

    def _hold(self, held: Iterable[_Held]) -> None:
        self._held = deque(held)
        self._held_from = {}
        for record in self._held:
            self._held_from.setdefault(record.key, record.queue_offset)

    def reput_replicated(self) -> set[QueueKey]:
        """A follower's reput: put the records replication appended, up to the durable
        end, into their queues and the index with the code recovery uses; calls
        ``on_arrival`` with the queues that grew and returns them."""
        durable = self.commitlog.durable_offset
        if durable <= self.reput_offset:
            return set()
        before = {key: queue.end_index for key, queue in self.queues.items()}
        self._reput_records(self.reput_offset, durable)
        grown = {key for key, queue in self.queues.items() if queue.end_index != before.get(key)}
        self.recent.forget(grown)  # a leader again, its reput caches from the new ends
        self.on_arrival(grown)
        return grown

    def truncate_commitlog(self, offset: int, dedupe_from: int | None) -> None:
        """Cut the commitlog back to ``offset`` (a follower told to by its leader), and
        first what was derived from the records past it, durably, so that recovery
        after a crash at any point finds nothing derived ahead of the commitlog: a
        reput checkpoint at the cut that names no queue (recovery then cuts every queue
        and the index back to it and re-puts from there, as for queues created after a
        checkpoint), then the queues and the index, then the commitlog, then a full
        checkpoint. Raises ValueError when ``offset`` is not a record boundary of the
        commitlog."""
        if offset >= self.commitlog.end_offset:
            return
        if offset < self.commitlog.min_offset:
            raise ValueError(f"cannot truncate the commitlog below {self.commitlog.min_offset}")
        with self._derived_lock:
            self._cuts += 1
            reput = min(self.reput_offset, offset)
            dedupe_from = reput if dedupe_from is None else min(dedupe_from, reput)
            write_checkpoint(
                self.fs,
                os.path.join(self.directory, CHECKPOINT_NAME),
                ReputCheckpoint(reput, {}, dedupe_from).encode(),
            )
            for queue in self.queues.values():
                queue.truncate_beyond(offset)
            self.index.truncate_beyond(offset)
            self.reput_offset = reput
            self.commitlog.truncate(offset)
            self._flush_derived(self.checkpoint_snapshot(dedupe_from))
        self.index.prepare(offset)
        self.next_queue_offset = {key: queue.end_index for key, queue in self.queues.items()}
        self.recent = RecentRecords(self.config.recent_cache_bytes)
        self._read_ahead = {}
        self.drop_pending()
        self.on_grew()

    # ------------------------------------------------------------------ reading

    def queue_end(self, subject: str, queue: int) -> int:
        """The queue's end_index: one past the newest offset a consumer can read."""
        q = self.queues.get((subject, queue))
        return 0 if q is None else q.end_index

    def queue_min(self, subject: str, queue: int) -> int:
        q = self.queues.get((subject, queue))
        return 0 if q is None else q.min_index

    def read_queue(
        self, subject: str, queue: int, start: int, max_messages: int, max_bytes: int
    ) -> tuple[int, list[bytes]]:
        """Up to ``max_messages`` messages of (subject, queue) from ``start``, as delivered
        (each record's bytes with ``commitlog_offset`` set), stopping once they reach
        ``max_bytes`` (at least one message when any is there); and the queue offset
        after the last one (a ``start`` below the queue's oldest entry is moved up).

        Raises CorruptionError when a queue entry points at a record of another queue.
        """
        key = (subject, queue)
        q = self.queues.get(key)
        if q is None or max_messages <= 0:
            return start, []
        start = max(start, q.min_index)
        stop = min(self._held_from.get(key, q.end_index), start + max_messages)
        if stop <= start:
            return start, []
        cached_from = self.recent.cached_from(key)
        if cached_from is None:
            cached_from = stop
        out: list[bytes] = []
        total = 0
        if start < cached_from:  # older than the cache: consume queue and commitlog
            out = self._read_stored(q, subject, queue, start, min(stop, cached_from), max_bytes)
            total = sum(map(len, out))
        if total < max_bytes and start + len(out) < stop:
            offsets, payloads = self.recent.read(key, start + len(out), stop)
            for offset, payload in zip(offsets, payloads, strict=True):
                out.append(delivered(payload, offset))
                total += len(payload)
                if total >= max_bytes:
                    break
        return start + len(out), out

    def _read_stored(
        self, q: ConsumeQueue, subject: str, queue: int, start: int, stop: int, max_bytes: int
    ) -> list[bytes]:
        """The messages of queue offsets [start, stop) read through the consume queue and
        the commitlog, each checked against its entry, until ``max_bytes``."""
        entries = q.read_range(start, stop - start)
        total = 0
        for count, entry in enumerate(entries, 1):  # entry sizes: the budget, unread
            total += entry[1]
            if total >= max_bytes:
                del entries[count:]
                break
        payloads = self._read_records(entries)
        subject_bytes = subject.encode()
        out = []
        for index, (offset, _, _) in enumerate(entries, start):
            payload = payloads.get(offset)
            if payload is None:
                raise CorruptionError(
                    q.directory,
                    index,
                    0,
                    f"entry {index} of {subject}/{queue} points at "
                    f"commitlog offset {offset}, where no record starts",
                )
            try:
                position = record_position(payload)
            except RecordError as exc:
                raise CorruptionError(self.commitlog.directory, offset, 0, str(exc)) from None
            if position != (subject_bytes, queue, index):
                raise CorruptionError(
                    q.directory,
                    index,
                    0,
                    f"entry {index} of {subject}/{queue} points at commitlog offset {offset}, "
                    f"which holds {position[0]!r}/{position[1]} offset {position[2]}",
                )
            out.append(delivered(payload, offset))
        return out

    def _read_records(self, entries: list) -> dict[int, bytes]:
        """The payloads of the records ``entries`` point at, by commitlog offset: from the
        read-ahead, else one scan of their span when dense enough, else one read each."""
        read_ahead = self._read_ahead
        payloads = {}
        unread = []
        for offset, size, _ in entries:
            payload = read_ahead.get(offset)
            if payload is None:
                unread.append((offset, size))
            else:
                payloads[offset] = payload
        if len(unread) > 1:
            first = unread[0][0]
            span_end = unread[-1][0] + unread[-1][1]
            if sum(size for _, size in unread) >= (span_end - first) * MIN_SCAN_DENSITY:
                self._read_ahead = read_ahead = {
                    record.offset: record.payload
                    for record in self.commitlog.iter_from(first, until=span_end)
                    if record.type == RECORD_TYPE
                }
                for offset, _ in unread:
                    payload = read_ahead.get(offset)
                    if payload is not None:
                        payloads[offset] = payload
                return payloads
        for offset, _ in unread:
            payloads[offset] = self.commitlog.read(offset).payload
        return payloads

    def _payload_at(self, offset: int) -> bytes | None:
        """The payload of the message record at ``offset``, or None when no message
        record starts there (any offset is safe to ask about)."""
        try:
            record = self.commitlog.read(offset)
        except (ValueError, StorageError):
            return None
        return record.payload if record.type == RECORD_TYPE else None

    def message_at(self, offset: int) -> Message | None:
        """The message of the record at ``offset``, or None when there is no message
        record starting there (any offset is safe to ask about)."""
        payload = self._payload_at(offset)
        if payload is None:
            return None
        try:
            return decode_record(payload, offset)
        except RecordError:
            return None

    def identity_at(self, offset: int) -> tuple[bytes, bytes, bytes | None] | None:
        """(message_id, subject, key) as bytes of the record at ``offset``, or None when
        no message record starts there. Never raises for a bad offset."""
        payload = self._payload_at(offset)
        if payload is None:
            return None
        try:
            return record_identity(payload)
        except RecordError:
            return None

    def lookup(self, index_key: bytes, matches: Callable[[int], bool], limit: int) -> list[int]:
        """Commitlog offsets whose record ``matches`` for ``index_key``, newest first
        (none that is held: hold_unacknowledged)."""
        found = self.index.lookup(index_key, lambda offset, _key: matches(offset), limit)
        if self._held:
            first_held = self._held[0].offset
            return [offset for offset in found if offset < first_held]
        return found

    # ------------------------------------------------------------------ checkpoint, close

    def checkpoint_snapshot(self, dedupe_from: int | None) -> tuple[int, list, int | None, int]:
        """What :meth:`flush_derived` needs, taken on the event loop at one instant."""
        if dedupe_from is None:
            dedupe_from = self.reput_offset
        return self.reput_offset, list(self.queues.items()), dedupe_from, self._cuts

    def flush_derived(self, snapshot: tuple[int, list, int | None, int]) -> None:
        """Flush queues and index, then replace the reput checkpoint (blocking: run it
        in a worker thread; appends may go on meanwhile)."""
        with self._derived_lock:
            if snapshot[3] == self._cuts:
                self._flush_derived(snapshot)

    def _flush_derived(self, snapshot: tuple[int, list, int | None, int]) -> None:
        offset, queues, dedupe_from, _ = snapshot
        ends = {key: queue.flush() for key, queue in queues}
        self.index.flush()
        checkpoint = ReputCheckpoint(offset, ends, dedupe_from)
        write_checkpoint(
            self.fs, os.path.join(self.directory, CHECKPOINT_NAME), checkpoint.encode()
        )

    def close(self, dedupe_from: int | None) -> None:
        """Make everything durable, reput it, checkpoint, and close every file."""
        try:
            self.commitlog.flush()
            self.reput_durable()
            try:
                self.flush_derived(self.checkpoint_snapshot(dedupe_from))
            except DiskFullError as exc:
                # The commitlog is durable; the previous checkpoint stands and the next
                # open re-derives queues and index past it.
                log.warning("broker closed without its reput checkpoint: %s", exc)
        finally:
            for queue in self.queues.values():
                queue.close()
            self.index.close()
            self.commitlog.close()
