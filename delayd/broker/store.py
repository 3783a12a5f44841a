"""BrokerStore: the broker's files — commitlog, consume queues, index, reput checkpoint.

Layout under ``<data>/broker/``::

    commitlog/<20-digit offset>            storage.segmented_log, message records (record.py)
    consumequeue/<subject>/<queue>/...     storage.consumequeue, one per (subject, queue)
    index/<20-digit offset>                storage.indexfile: "i\\0<id>" and "k\\0<subject>\\0<key>"
    reput.checkpoint                       storage.checkpoint blob holding JSON (below)
    offsets.json                           offsets.py

The commitlog is the truth; consume queues and index are derived from it by the reput
(RocketMQ's ReputMessageService), only up to the commitlog's durable offset, so a crash
never leaves them ahead of it. The append path hands each appended batch to the reput in
memory (the same Message objects it encoded, so nothing is parsed twice); after a
restart :meth:`open` re-derives what the checkpoint does not cover from the records.

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
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import trio

from delayd.broker.config import BrokerConfig
from delayd.broker.record import (
    RECORD_TYPE,
    RecordError,
    decode_record,
    encode_record,
    record_identity,
    record_summary,
    set_commitlog_offset,
)
from delayd.protocol.events import Message
from storage.checkpoint import read_checkpoint, write_checkpoint
from storage.consumequeue import ConsumeQueue, rebuild
from storage.errors import CorruptionError, StorageError
from storage.flusher import FlushMode, LogWriter
from storage.framing import HEADER_SIZE
from storage.fs import REAL_FS, FileSystem, create_dirs_durably
from storage.indexfile import IndexStore
from storage.segmented_log import Record, SegmentedLog

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "reput.checkpoint"
QueueKey = tuple[str, int]  # (subject, queue)
# Rough bytes a cached Message costs beyond its body (object, strings, dict).
CACHED_MESSAGE_OVERHEAD = 400


def id_index_key(message_id: str | bytes) -> bytes:
    raw = message_id.encode() if isinstance(message_id, str) else message_id
    return b"i\x00" + raw


def key_index_key(subject: str | bytes, key: str | bytes) -> bytes:
    s = subject.encode() if isinstance(subject, str) else subject
    k = key.encode() if isinstance(key, str) else key
    return b"k\x00" + s + b"\x00" + k


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


class RecentMessages:
    """Decoded messages of the newest records, by commitlog offset, bounded in bytes.

    Consumers near the head (the common case: long-polling) are served from here without
    reading or decoding the commitlog. FIFO eviction.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._messages: dict[int, Message] = {}
        self._bytes = 0

    def get(self, offset: int) -> Message | None:
        return self._messages.get(offset)

    def add(self, offset: int, message: Message) -> None:
        if not self.max_bytes:
            return
        self._messages[offset] = message
        self._bytes += len(message.body) + CACHED_MESSAGE_OVERHEAD
        messages = self._messages
        while self._bytes > self.max_bytes and messages:
            oldest = next(iter(messages))
            gone = messages.pop(oldest)
            self._bytes -= len(gone.body) + CACHED_MESSAGE_OVERHEAD


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
        self.next_queue_offset: dict[QueueKey, int] = {}
        self.reput_offset = 0  # every record below it is in its queue and the index
        self.recent = RecentMessages(config.recent_cache_bytes)
        self.last_store_ms = 0  # store_ms of the newest record seen
        self.on_arrival: Callable[[set[QueueKey]], None] = lambda keys: None
        self.messages_stored = 0
        self._pending: deque[tuple[int, list[int], list[Message], list[int]]] = deque()
        self._appended = trio.Event()

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
        store.writer = LogWriter(store.commitlog, config.flush)
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

        rebuilt = rebuild(queue_for, commitlog, start)
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
        self.reput_offset = commitlog.end_offset
        log.info(
            "broker store recovered: commitlog [%d, %d), reput from %d re-put %d queue "
            "entries, %d queues",
            commitlog.min_offset,
            commitlog.end_offset,
            start,
            rebuilt,
            len(self.queues),
        )

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

    def _open_queue(self, key: QueueKey) -> ConsumeQueue:
        subject, queue_id = key
        path = os.path.join(self.directory, "consumequeue", subject, str(queue_id))
        queue = ConsumeQueue.open(path, fs=self.fs)
        self.queues[key] = queue
        return queue

    def scan_ids(self, start: int) -> Iterator[tuple[int, bytes, int]]:
        """(offset, message_id bytes, store_ms) of every record from ``start`` on: the
        idempotency window's rebuild. Raises CorruptionError for a bad record."""
        for record in self.commitlog.iter_from(max(start, self.commitlog.min_offset)):
            try:
                message_id, store_ms = record_summary(record.payload)
            except RecordError as exc:
                raise CorruptionError(
                    self.commitlog.directory, record.offset, len(record.payload), str(exc)
                ) from None
            self.last_store_ms = max(self.last_store_ms, store_ms)
            yield record.offset, message_id, store_ms

    # ------------------------------------------------------------------ appending

    def assign_queue_offset(self, subject: str, queue: int) -> int:
        """The next queue offset of (subject, queue), consumed: the record must be
        appended in the same synchronous step (see :meth:`append`)."""
        key = (subject, queue)
        offset = self.next_queue_offset.get(key, 0)
        self.next_queue_offset[key] = offset + 1
        return offset

    def append(self, messages: list[Message]) -> list[int]:
        """Append records for ``messages`` (built by record.stored_message, with their
        queue offsets just assigned, in order); returns their commitlog offsets and sets
        each message's ``commitlog_offset``. Written to the OS, not yet durable: await
        :meth:`wait_durable`. Synchronous on purpose: queue offsets and dedupe entries are
        assigned in the same step, so no other task can interleave.

        Raises StorageError (the log is then unusable; the broker must stop).
        """
        payloads = [encode_record(m) for m in messages]
        offsets = self.commitlog.append_batch(payloads, RECORD_TYPE)
        for message, offset in zip(messages, offsets, strict=True):
            set_commitlog_offset(message, offset)
        sizes = [HEADER_SIZE + len(p) for p in payloads]
        self._pending.append((offsets[-1] + sizes[-1], offsets, messages, sizes))
        self.messages_stored += len(messages)
        self._appended.set()
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

        In ``sync`` mode it also runs the reput pass for what just became durable, so an
        acknowledged message is already visible to PULL and QUERY (and the first task
        woken after a group commit does the reput for all of them, sooner than the
        reput task would be scheduled).
        """
        if self.config.flush.mode is FlushMode.SYNC:
            await self._flush()
            self.reput_durable()

    # ------------------------------------------------------------------ reput

    async def run_reput(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
        """The reput task: moves durable appended records into their consume queues and
        the index, then calls ``on_arrival`` with the queues that grew (which wakes held
        PULLs: RocketMQ's messageArrivingListener). Never ahead of ``durable_offset``.

        In ``sync`` mode its flush request joins the producers' group commit; in
        ``async`` mode it asks for an fsync once per pass, so consumers see a message
        within one fsync of its append instead of one flush interval.
        """
        task_status.started()
        while True:
            await self._appended.wait()
            self._appended = trio.Event()
            await self._flush()
            self.reput_durable()

    def reput_durable(self) -> set[QueueKey]:
        """One reput pass over the appended batches that are durable now (synchronous)."""
        durable = self.commitlog.durable_offset
        pending = self._pending
        grown: dict[QueueKey, list[tuple[int, int, int]]] = {}
        index_put = self.index.put
        recent_add = self.recent.add
        while pending and pending[0][0] <= durable:
            end, offsets, messages, sizes = pending.popleft()
            for message, offset, size in zip(messages, offsets, sizes, strict=True):
                key = (message.subject, message.queue)
                entries = grown.get(key)
                if entries is None:
                    entries = grown[key] = []
                entries.append((offset, size, 0))
                store_ms = message.store_ms
                index_put(b"i\x00" + message.message_id.encode(), offset, store_ms)
                if message.key is not None:
                    index_put(key_index_key(message.subject, message.key), offset, store_ms)
                recent_add(offset, message)
            self.reput_offset = end
        for key, entries in grown.items():
            queue = self.queues.get(key) or self._open_queue(key)
            queue.append_batch(entries)
        if grown:
            self.on_arrival(set(grown))
        return set(grown)

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
    ) -> list[Message]:
        """Up to ``max_messages`` messages of (subject, queue) from ``start``, stopping
        after ``max_bytes`` body bytes (always at least one message when any is there).

        Raises CorruptionError when a queue entry points at a record of another queue.
        """
        q = self.queues.get((subject, queue))
        if q is None or max_messages <= 0:
            return []
        start = max(start, q.min_index)
        entries = q.read_range(start, max_messages)
        out: list[Message] = []
        total = 0
        recent = self.recent._messages
        for index, (offset, _, _) in enumerate(entries, start):
            message = recent.get(offset)
            if message is None:
                message = self._read_message(offset)
            if (
                message.queue_offset != index
                or message.queue != queue
                or message.subject != subject
            ):
                raise CorruptionError(
                    q.directory,
                    index,
                    0,
                    f"entry {index} of {subject}/{queue} points at commitlog offset {offset}, "
                    f"which holds {message.subject}/{message.queue} offset {message.queue_offset}",
                )
            out.append(message)
            total += len(message.body)
            if total >= max_bytes:
                break
        return out

    def _read_message(self, offset: int) -> Message:
        record = self.commitlog.read(offset)
        try:
            return decode_record(record.payload, offset)
        except RecordError as exc:
            raise CorruptionError(self.commitlog.directory, offset, 0, str(exc)) from None

    def message_at(self, offset: int) -> Message | None:
        """The message of the record at ``offset``, or None when there is no message
        record starting there (any offset is safe to ask about)."""
        message = self.recent.get(offset)
        if message is not None:
            return message
        try:
            record = self.commitlog.read(offset)
            if record.type != RECORD_TYPE:
                return None
            return decode_record(record.payload, offset)
        except (ValueError, StorageError):  # RecordError is a ValueError
            return None

    def identity_at(self, offset: int) -> tuple[bytes, bytes, bytes | None] | None:
        """(message_id, subject, key) as bytes of the record at ``offset``, or None when
        no message record starts there. Never raises for a bad offset."""
        message = self.recent.get(offset)
        if message is not None:
            key = None if message.key is None else message.key.encode()
            return message.message_id.encode(), message.subject.encode(), key
        try:
            record = self.commitlog.read(offset)
            if record.type != RECORD_TYPE:
                return None
            return record_identity(record.payload)
        except (ValueError, StorageError):
            return None

    def lookup(self, index_key: bytes, matches: Callable[[int], bool], limit: int) -> list[int]:
        """Commitlog offsets whose record ``matches`` for ``index_key``, newest first."""
        return self.index.lookup(index_key, lambda offset, _key: matches(offset), limit)

    # ------------------------------------------------------------------ checkpoint, close

    def checkpoint_snapshot(self, dedupe_from: int | None) -> tuple[int, list, int | None]:
        """What :meth:`flush_derived` needs, taken on the event loop at one instant."""
        if dedupe_from is None:
            dedupe_from = self.reput_offset
        return self.reput_offset, list(self.queues.items()), dedupe_from

    def flush_derived(self, snapshot: tuple[int, list, int | None]) -> None:
        """Flush queues and index, then replace the reput checkpoint (blocking: run it
        in a worker thread; appends may go on meanwhile)."""
        offset, queues, dedupe_from = snapshot
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
            self.flush_derived(self.checkpoint_snapshot(dedupe_from))
        finally:
            for queue in self.queues.values():
                queue.close()
            self.index.close()
            self.commitlog.close()
