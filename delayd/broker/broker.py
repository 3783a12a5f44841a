"""Broker: the embeddable broker — store, idempotency, groups, offsets, long-polling PULL.

The delay server runs it in its own process and calls :meth:`Broker.send_batch`
directly; the TCP server (server.py) is a thin layer over the same methods::

    async with open_broker(data_dir, BrokerConfig()) as broker:
        results = await broker.send_batch([Message("id-1", "orders", body=b"...")])

The synchronous methods take ``now_ms`` and do no I/O waits; the ``async`` ones read the
clock (wall clock for store times and the idempotency window, trio's monotonic clock for
heartbeats and PULL deadlines) and wait.

PULL and commit semantics (what the clients rely on)
    A member's PULL returns messages from its assigned queues that no other member
    still holds (a queue in hand-over is served to nobody: delayd.broker.groups). For
    each (group, subject, queue) the broker keeps, in memory only, a *delivered
    cursor*: it starts at the committed offset whenever the queue is (re)assigned or
    the broker starts, and advances as messages are handed out. Consumers commit
    ``queue_offset + 1`` after processing; anything handed out but not committed is
    delivered again after a crash, an overdue hand-over or a restart (at-least-once).
    A commit beyond the cursor moves it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Hashable, Iterable, Sequence
from contextlib import asynccontextmanager
from itertools import pairwise

import trio

from delayd.broker.arrivals import ArrivalHub
from delayd.broker.config import BrokerConfig, StartFrom
from delayd.broker.dedupe import IdWindow
from delayd.broker.gate import ReplicationGate
from delayd.broker.groups import GroupKey, GroupRegistry
from delayd.broker.offsets import OffsetStore
from delayd.broker.record import encode_record, stamp_records
from delayd.broker.routing import QueueSelector, key_hash
from delayd.broker.store import BrokerStore, QueueKey, id_index_key, key_index_key
from delayd.errors import NotLeaderError, RejectedError
from delayd.protocol.bodies import new_send_result
from delayd.protocol.codes import ErrorCode, ResultCode
from delayd.protocol.events import EncodedMessages, Message, SendResult, validate_subject
from delayd.protocol.message_layout import (
    MSG_AT_MS,
    MSG_DELAY_MS,
    decode_message,
    read_heads,
)
from delayd.protocol.primitives import MAX_STR_BYTES
from delayd.timestamps import wall_ms
from delayd.write_refusals import BROKER_COMMITLOG, CHECKPOINT, WriteRefusals
from storage.errors import DiskFullError
from storage.fs import REAL_FS, FileSystem

log = logging.getLogger(__name__)

MAX_QUERY_RESULTS = 64
REFUSE_DELAYED = "this is the broker; send delayed messages (at_ms/delay_ms) to the delay server"


MAX_CACHED_SUBJECTS = 10_000  # subjects known valid, to skip the regex per message
_DELAY_BITS = MSG_AT_MS | MSG_DELAY_MS  # the broker refuses delayed messages


def _check_name(what: str, value: str) -> None:
    """Group names and consumer ids: non-empty, at most 255 characters, no control
    characters (they appear in the offsets log, STATS names and logs)."""
    if not value or len(value) > 255 or any(ord(c) < 32 for c in value) or "/" in value:
        raise RejectedError(
            ErrorCode.INVALID_REQUEST,
            f"{what} {value[:100]!r} must be 1 to 255 characters without '/' or control characters",
        )


def _check_subject(subject: str) -> None:
    problem = validate_subject(subject)
    if problem is not None:
        raise RejectedError(ErrorCode.INVALID_REQUEST, problem)


class Broker:
    """The broker; see the module docstring. Use :func:`open_broker`, or
    :meth:`open` then ``await nursery.start(broker.run)`` (run closes it on exit)."""

    def __init__(
        self,
        store: BrokerStore,
        offsets: OffsetStore,
        config: BrokerConfig,
        clock: Callable[[], int] = wall_ms,
    ) -> None:
        self.store = store
        self.offsets = offsets
        self.config = config
        self.clock = clock
        self.groups = GroupRegistry(config.heartbeat_timeout_ms)
        self.hub = ArrivalHub()
        self.selector = QueueSelector()
        self.window = IdWindow(config.dedupe_max_ids, config.dedupe_window_ms, self._stored_id)
        self.duplicates = 0
        self.checkpoints = 0
        self.disk_full_refused = 0  # messages refused because the commitlog's disk is full
        self.refusals = WriteRefusals()  # the delay server shares its own
        self._offsets_write_lock = trio.Lock()  # durable commits: one write at a time
        # Subjects already validated -> their number of queues (skips the regex and the
        # config lookup per message).
        self._valid_subjects: dict[str, int] = {}
        self._subject_names: dict[bytes, str] = {}  # UTF-8 -> str, for encoded heads
        self.refused = 0
        # (group, subject) -> queue -> [owner consumer_id, next offset to hand out]
        self._cursors: dict[GroupKey, dict[int, list]] = {}
        self._pull_turn = 0
        self._membership_changed = trio.Event()
        # Members with a PULL held right now -> (how many, their connection): alive
        # however long the wait, though they send no heartbeat meanwhile.
        self._holding: dict[tuple[str, str, str], tuple[int, Hashable]] = {}
        self._closed = False
        # A follower's broker (follow / promote): replication writes its commitlog and
        # offsets, it derives the rest; it stores nothing and commits nothing itself.
        self.following = False
        # A member of a replicated group: acks wait for the group, PULL sees only what
        # it acknowledged (attach_gate; delayd.broker.gate).
        self.gate: ReplicationGate | None = None
        store.on_arrival = self.hub.notify

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def open(
        cls,
        data_dir: str,
        config: BrokerConfig | None = None,
        *,
        fs: FileSystem = REAL_FS,
        clock: Callable[[], int] = wall_ms,
    ) -> Broker:
        """Open and recover the broker's files under ``<data_dir>/broker`` (blocking).

        Rebuilds the idempotency window by scanning the commitlog from the checkpoint's
        ``dedupe_from`` (see docs/broker.md for the cost). Raises CorruptionError.
        """
        config = config or BrokerConfig()
        store = BrokerStore.open(data_dir, config, fs=fs)
        try:
            offsets = OffsetStore.open(store.directory, fs=fs)
            broker = cls(store, offsets, config, clock)
            checkpoint = store.checkpoint
            start = store.commitlog.min_offset
            if checkpoint is not None and checkpoint.dedupe_from is not None:
                start = checkpoint.dedupe_from
            broker._fill_window(start)
        except BaseException:
            store.close(None)
            raise
        return broker

    def _fill_window(self, start: int, until: int | None = None) -> None:
        """Add the ids of the commitlog's records from ``start`` (below ``until``) to
        the idempotency window, as a restart does."""
        began = time.perf_counter()
        scanned = 0
        for offset, message_id, store_ms in self.store.scan_ids(start, until):
            self.window.add(message_id, offset, store_ms)
            scanned += 1
        self.window.expire(self.clock())
        log.info(
            "idempotency window rebuilt: %d records scanned from offset %d in %.3f s, %d ids kept",
            scanned,
            start,
            time.perf_counter() - began,
            len(self.window),
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
        """Run the background tasks (flusher and reput, checkpoints, heartbeat expiry) until
        cancelled; then flush, checkpoint, persist offsets and close the files."""
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.store.writer.run)  # fsyncs, then reputs
                await nursery.start(self._checkpoint_loop)
                await nursery.start(self._expiry_loop)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                self.close()

    def close(self) -> None:
        """Make everything durable and close the files (idempotent, blocking)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.store.close(self.window.oldest_offset)
        finally:
            try:
                if self.offsets.needs_compaction():
                    self.offsets.compact()
                self.offsets.flush()
            except DiskFullError as exc:
                # The commits written stand: consumers see the ones that were not
                # again (at least once).
                log.warning("broker closed without writing every commit: %s", exc)
            finally:
                self.offsets.close()
        log.info("broker closed: %d messages stored this run", self.store.messages_stored)

    async def _checkpoint_loop(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        # Derived data and offsets are made durable every checkpoint_interval_ms, off
        # the event loop; a crash costs a re-put of that interval and redelivery of the
        # interval's commits.
        task_status.started()
        while True:
            await trio.sleep(self.config.checkpoint_interval_ms / 1000)
            self.window.expire(self.clock())
            if self.store.reput_blocked is not None:
                self.store.reput_durable()  # space may have returned: try the pass again
                if self.store.reput_blocked is not None:
                    self.refusals.refuse(CHECKPOINT, self.store.reput_blocked)
                    continue
            try:
                await self.checkpoint()
            except DiskFullError as exc:
                # The previous checkpoint stands; recovery re-derives from it. Next
                # interval tries again.
                self.refusals.refuse(CHECKPOINT, exc)
                continue
            self.refusals.clear(CHECKPOINT)

    async def checkpoint(self) -> None:
        """Flush consume queues and index, write the reput checkpoint, make the commits
        durable (compacting their log when it has grown)."""
        snapshot = self.store.checkpoint_snapshot(self.window.oldest_offset)
        await trio.to_thread.run_sync(self.store.flush_derived, snapshot)
        if not self.following:
            async with self._offsets_write_lock:
                if self.offsets.needs_compaction():
                    self.offsets.compact()
                if self.offsets.dirty:
                    await trio.to_thread.run_sync(self.offsets.flush, self.offsets.version)
                    self.offsets.on_grew()
        self.checkpoints += 1

    async def make_offsets_durable(self) -> None:
        """Return once every commit made before the call is durable in the offsets log.

        Callers that arrive while a flush is under way wait for it, then the first of
        them flushes once for all of them (group commit, as the commitlog's fsyncs):
        under many durable commits the fsyncs do not queue up one per commit. Raises
        OSError when a commit cannot be written (the commits stay in memory and go out
        with a later checkpoint).
        """
        wanted = self.offsets.version
        async with self._offsets_write_lock:
            if self.offsets.saved_version >= wanted:
                return
            if self.offsets.needs_compaction():
                self.offsets.compact()  # a commit the disk refused before: write it now
            await trio.to_thread.run_sync(self.offsets.flush, self.offsets.version)
            self.offsets.on_grew()

    async def _expiry_loop(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        # Sleeps until the next member could time out, or until membership changes.
        task_status.started()
        while True:
            next_ms = self.groups.next_expiry_ms()
            deadline = math.inf
            if next_ms is not None:
                deadline = trio.current_time() + max(0, next_ms - self.monotonic_ms()) / 1000
            with trio.move_on_at(deadline):
                await self._membership_changed.wait()
            self._membership_changed = trio.Event()
            now_ms = self.monotonic_ms()
            # A member waiting in a long poll cannot heartbeat: its held PULL is its
            # heartbeat (a wait_ms longer than heartbeat_timeout_ms must not cost it
            # its queues).
            for (group, subject, consumer_id), (_, connection) in self._holding.items():
                self.groups.touch(group, subject, consumer_id, connection, now_ms)
            self._rebalanced(self.groups.expire(now_ms))

    # ------------------------------------------------------------------ following

    def follow(self) -> None:
        """Become a follower's broker: from now on replication appends to the commitlog
        and the offsets log, :meth:`apply_replicated` derives the rest, and sends and
        commits are refused."""
        self.following = True
        self.offsets.following = True
        self.store.drop_pending()

    def promote(self) -> None:
        """Become the group's broker again (the leader's): everything replicated is
        derived, then sends and commits are accepted; consumers that rejoin start
        from the replicated committed offsets, and get back the queues they say they
        hold (every queue of a consumer group waits for its holder's claim, or for
        ``heartbeat_timeout_ms``: delayd.broker.groups). Call it once the follower
        stopped: what it appended is made durable here first, so that every record
        before the next append is in its queue (else new queue offsets would repeat
        its)."""
        self.store.commitlog.flush()
        self.offsets.flush()
        self.store.drop_pending()  # a leader again: what the reput held is put now
        self.apply_replicated()
        self.following = False
        self.offsets.following = False
        self._cursors.clear()
        self.offsets.drop_superseded()
        known = {(group, subject) for (group, subject, _), _ in self.offsets.items()}
        self.groups.promoted(known, self.monotonic_ms())
        self._membership_changed.set()  # the expiry task wakes when the claims end

    def apply_replicated(self) -> None:
        """Derive what the records replication made durable give (a follower, after
        each group commit): consume queues and index by the reput recovery runs, the
        idempotency window, the committed offsets table."""
        start = self.store.reput_offset
        self.store.reput_replicated()
        if self.store.reput_offset > start:
            self._fill_window(start, self.store.reput_offset)
        if self.offsets.apply_appended():
            self.offsets.drop_superseded()

    def truncate_commitlog(self, offset: int) -> None:
        """Cut the commitlog back to ``offset`` with everything derived from the records
        past it (a follower told to by its leader): queues and index by the store, the
        idempotency window rebuilt by the scan a restart runs."""
        oldest = self.window.oldest_offset
        self.store.truncate_commitlog(offset, oldest)
        self.window = IdWindow(
            self.config.dedupe_max_ids, self.config.dedupe_window_ms, self._stored_id
        )
        start = self.store.commitlog.min_offset if oldest is None else min(oldest, offset)
        self._fill_window(start)

    # ------------------------------------------------------------------ the group's acks

    def attach_gate(self, gate: ReplicationGate) -> None:
        """Acknowledge only what the group has (``gate``): a store once it acknowledged
        the commitlog up to the batch's end, a commit once it acknowledged the offsets
        log; and let PULL and QUERY see only records it acknowledged (the reput stops
        at ``gate.commitlog_acked()``: call :meth:`high_watermark_moved` when it moves)."""
        self.gate = gate
        self.store.reput_limit = gate.commitlog_acked

    def high_watermark_moved(self) -> None:
        """The group acknowledged more of the commitlog: the records now within it go
        into their queues, which wakes the PULLs held on them."""
        if not self.following:
            self.store.reput_durable()

    async def wait_stored(self, end: int) -> None:
        """Return once records appended up to commitlog offset ``end`` may be
        acknowledged: durable under the flush policy and, with a gate, acknowledged by
        the group (and visible to PULL). Raises NotLeaderError when the member stopped
        leading first: they may still be cut."""
        await self.store.wait_durable()
        if self.gate is None:
            return
        if not await self.gate.wait_commitlog(end):
            raise self._not_leader("the group did not acknowledge the stored messages")
        self.store.reput_durable()

    async def wait_commits_acknowledged(self) -> None:
        """Return once every commit made before the call may be acknowledged as
        durable: in the offsets log on disk and, with a gate, acknowledged by the group.
        Raises NotLeaderError when the member stopped leading first, OSError as
        :meth:`make_offsets_durable`."""
        await self.make_offsets_durable()
        if self.gate is None:
            return
        generation, end = self.offsets.position()
        if not await self.gate.wait_offsets(generation, end):
            raise self._not_leader("the group did not acknowledge the commit")

    @staticmethod
    def _not_leader(what: str) -> NotLeaderError:
        return NotLeaderError(
            ErrorCode.NOT_LEADER,
            f"{what}: this member no longer leads its group; send it to the leader",
            None,
        )

    def _refuse_if_following(self) -> None:
        if self.following:
            raise RejectedError(
                ErrorCode.INVALID_REQUEST,
                "this broker follows its group's leader: send and commit to the leader",
            )

    @staticmethod
    def monotonic_ms() -> int:
        """trio's clock in ms: heartbeats and deadlines (immune to wall-clock steps)."""
        return int(trio.current_time() * 1000)

    # ------------------------------------------------------------------ producing

    async def send_batch(self, messages: Sequence[Message]) -> list[SendResult]:
        """Store ``messages``; one SendResult per message, in order, once the flush
        policy allows the acknowledgement (``sync``: durable).

        OK: stored now. DUPLICATE: its id is already stored (within the idempotency
        window, or earlier in this batch) and it was not stored again. Other codes: not
        stored, ``reason`` says why. Raises StorageError when the commitlog fails (the
        broker is then unusable), NotLeaderError when a member of a group stopped
        leading before its group acknowledged the batch (:meth:`wait_stored`).
        """
        await self.store.make_room()
        results = self.append_batch(messages, self.clock())
        await self.wait_stored(self.store.commitlog.end_offset)
        return results

    async def send_encoded(self, encoded: EncodedMessages) -> list[SendResult]:
        """:meth:`send_batch` of messages given only in their wire encoding (the embedded
        delay server's sender builds them from its schedule_log records): no Message is
        built on the way to the commitlog. ``encoded`` must be well-formed
        (EncodedMessages promises it). Raises as send_batch."""
        await self.store.make_room()
        results = self.append_batch(None, self.clock(), encoded)
        await self.wait_stored(self.store.commitlog.end_offset)
        return results

    def append_batch(
        self,
        messages: Sequence[Message] | None,
        now_ms: int,
        encoded: EncodedMessages | None = None,
    ) -> list[SendResult]:
        """The synchronous half of :meth:`send_batch`: validate, dedupe, append (not yet
        durable — await ``store.wait_durable()`` before acknowledging). The TCP server
        calls it in request order, then waits for durability concurrently, so pipelined
        batches of one connection keep their order and still share fsyncs.

        ``encoded``, when given, holds the messages as they arrived (``SendBatch.encoded``,
        one span each): their records are then those bytes with the broker's integers
        stamped in, instead of the Messages encoded again — the same bytes, 0.3 µs per
        message instead of 1.3. ``messages`` may then be None: what the checks need is
        read from the encoded heads, and a Message is decoded only to explain a refusal.
        Raises ValueError when ``encoded`` does not hold one span per message, and
        RejectedError on a follower.
        """
        self._refuse_if_following()
        if messages is None:
            if encoded is None:
                raise ValueError("give the messages, their encoding, or both")
            heads = self._encoded_heads(encoded)
            data, bounds = encoded.data, encoded.bounds

            def message_at(i: int) -> Message:
                return decode_message(data, bounds[i], bounds[i + 1])

        else:
            if encoded is not None and len(encoded) != len(messages):
                raise ValueError(f"{len(encoded)} encoded spans for {len(messages)} messages")
            max_body = self.config.max_body_bytes
            heads = [
                (
                    m.message_id.encode() if m.message_id else b"",
                    m.subject,
                    m.key,
                    # The common message passes these cheap checks; anything else gets
                    # the full explanation from _refusal.
                    bool(m.message_id)
                    and m.at_ms is None
                    and m.delay_ms is None
                    and len(m.body) <= max_body
                    and not m.properties,
                    m.due_ms,
                )
                for m in messages
            ]
            message_at = messages.__getitem__
        store, window, config = self.store, self.window, self.config
        window.expire(now_ms)
        store_ms = max(now_ms, store.last_store_ms)
        results: list[SendResult | None] = [None] * len(heads)  # by message index
        # Per stored message, in order (columns, not a tuple each): its index in the
        # batch, (subject, queue), queue, queue offset, id and id fingerprint.
        indices: list[int] = []
        queue_keys: list[QueueKey] = []
        queues_of: list[int] = []
        queue_offsets: list[int] = []
        ids: list[bytes] = []
        stored_fps: list[int] = []
        index_keys: list[bytes] = []  # the reput's index keys, in put order
        key_records: list[int] | None = None  # record of each index key, once a key is seen
        copies: list[tuple[int, int]] = []  # (message index, message index of first copy)
        first_of: dict[bytes, int] = {}  # message id -> message index of its first copy
        valid_subjects = self._valid_subjects
        next_offset = store.next_queue_offset
        turns = self.selector.turns
        try:
            # (an empty or missing id is refused below, as EMPTY_ID)
            all_ids = [head[0] for head in heads]
            fps, found = window.find_batch(all_ids)
            for i, (id_bytes, subject, key, plain, _) in enumerate(heads):
                queues = valid_subjects.get(subject)
                if queues is None or not plain:
                    code, reason = self._refusal(message_at(i))
                    if code is not None:
                        self.refused += 1
                        results[i] = new_send_result(code, reason)
                        continue
                    queues = config.queues_for(subject)
                    if len(valid_subjects) < MAX_CACHED_SUBJECTS:
                        valid_subjects[subject] = queues
                earlier = first_of.get(id_bytes)
                if earlier is not None:
                    copies.append((i, earlier))
                    continue
                if found and i in found:
                    self.duplicates += 1
                    results[i] = self._duplicate_result(found[i])
                    continue
                first_of[id_bytes] = i
                if key is None:  # QueueSelector.select's round robin, inlined
                    turn = turns.get(subject, 0)
                    turns[subject] = turn + 1
                    queue = turn % queues
                else:
                    queue = key_hash(key) % queues
                    if key_records is None:  # until now one index key per record
                        key_records = list(range(len(index_keys)))
                queue_key = (subject, queue)
                queue_offset = next_offset.get(queue_key, 0)
                next_offset[queue_key] = queue_offset + 1
                # b"i\0" + id is id_index_key(id_bytes), spelled out on this hot path.
                index_keys.append(b"i\x00" + id_bytes)
                if key_records is not None:
                    key_records.append(len(ids))
                    if key is not None:
                        index_keys.append(key_index_key(subject, key))
                        key_records.append(len(ids))
                indices.append(i)
                queue_keys.append(queue_key)
                queues_of.append(queue)
                queue_offsets.append(queue_offset)
                ids.append(id_bytes)
                stored_fps.append(fps[i])
            if ids:
                if encoded is None:
                    assert messages is not None
                    payloads = [
                        encode_record(messages[i], store_ms, queue, queue_offset)
                        for i, queue, queue_offset in zip(
                            indices, queues_of, queue_offsets, strict=True
                        )
                    ]
                else:
                    payloads = stamp_records(
                        encoded.data, encoded.bounds, indices, store_ms, queues_of, queue_offsets
                    )
                offsets = store.append(
                    payloads, queue_keys, queue_offsets, index_keys, key_records, store_ms
                )
        except BaseException as exc:
            # Nothing of the batch is stored (or the log is failed): give the queue
            # offsets back so the queues stay dense (each queue to the first it gave).
            for queue_key, queue_offset in zip(
                reversed(queue_keys), reversed(queue_offsets), strict=True
            ):
                next_offset[queue_key] = queue_offset
            if not isinstance(exc, DiskFullError):
                raise
            # A full disk is an answer: the commitlog cut the refused append back, so
            # the messages it held are refused DISK_FULL (retryable), not stored.
            self.refusals.refuse(BROKER_COMMITLOG, exc)
            self.disk_full_refused += len(ids)
            reason = str(exc)
            for i in indices:
                results[i] = SendResult(ResultCode.DISK_FULL, reason)
            for slot, earlier in copies:
                results[slot] = results[earlier]
            return results  # type: ignore[return-value]
        if self.refusals.any:
            self.refusals.clear(BROKER_COMMITLOG)
        if ids:
            store.last_store_ms = store_ms
            window.add_batch(ids, offsets, store_ms, stored_fps)
            ok = ResultCode.OK
            for i, queue, queue_offset, offset in zip(
                indices, queues_of, queue_offsets, offsets, strict=True
            ):
                results[i] = new_send_result(
                    ok, "", store_ms, offset, queue, queue_offset, heads[i][4]
                )
        for slot, earlier in copies:
            first = results[earlier]
            assert first is not None
            self.duplicates += 1
            results[slot] = SendResult(
                ResultCode.DUPLICATE,
                "the same message id appears earlier in this batch",
                store_ms=first.store_ms,
                commitlog_offset=first.commitlog_offset,
                queue=first.queue,
                queue_offset=first.queue_offset,
                due_ms=first.due_ms,
            )
        return results  # type: ignore[return-value]

    def _encoded_heads(
        self, encoded: EncodedMessages
    ) -> list[tuple[bytes, str, str | None, bool, int | None]]:
        """Per encoded message: (id bytes, subject, key, passes the cheap checks,
        due_ms), read from its head without decoding it (message_layout.read_heads)."""
        names = self._subject_names
        max_body = self.config.max_body_bytes
        out = []
        for mask, message_id, raw_subject, raw_key, count, body_len, due_ms in read_heads(
            encoded.data, encoded.bounds
        ):
            subject = names.get(raw_subject)
            if subject is None:
                subject = raw_subject.decode()
                if len(names) < MAX_CACHED_SUBJECTS:
                    names[raw_subject] = subject
            key = None if raw_key is None else raw_key.decode()
            plain = (
                bool(message_id) and not mask & _DELAY_BITS and not count and body_len <= max_body
            )
            out.append((message_id, subject, key, plain, due_ms))
        return out

    def _refusal(self, m: Message) -> tuple[ResultCode | None, str]:
        config = self.config
        if not m.message_id:
            return ResultCode.EMPTY_ID, "message_id is empty; give every message a unique id"
        problem = None if m.subject in self._valid_subjects else validate_subject(m.subject)
        if problem is not None:
            return ResultCode.INVALID_SUBJECT, problem
        if m.at_ms is not None or m.delay_ms is not None:
            return ResultCode.INVALID_DELAY, REFUSE_DELAYED
        if len(m.body) > config.max_body_bytes:
            return (
                ResultCode.BODY_TOO_LARGE,
                f"body is {len(m.body)} bytes; this broker accepts at most {config.max_body_bytes}",
            )
        props = 0
        for name, value in m.properties.items():
            n, v = len(name.encode()), len(value.encode())
            if n > MAX_STR_BYTES or v > MAX_STR_BYTES:
                return (
                    ResultCode.PROPERTIES_TOO_LARGE,
                    f"property {name[:100]!r}: names and values are at most {MAX_STR_BYTES} bytes",
                )
            props += n + v
        if props > config.max_properties_bytes:
            return (
                ResultCode.PROPERTIES_TOO_LARGE,
                f"properties take {props} bytes; this broker accepts at most "
                f"{config.max_properties_bytes}",
            )
        if len(m.message_id.encode()) > MAX_STR_BYTES or (
            m.key is not None and len(m.key.encode()) > MAX_STR_BYTES
        ):
            return ResultCode.INTERNAL, f"message_id and key are at most {MAX_STR_BYTES} bytes"
        return None, ""

    def _duplicate_result(self, offset: int) -> SendResult:
        original = self.store.message_at(offset)
        if original is None:  # cannot happen: find() just read it
            return SendResult(ResultCode.DUPLICATE, "already stored", commitlog_offset=offset)
        return SendResult(
            ResultCode.DUPLICATE,
            "a message with this id is already stored",
            store_ms=original.store_ms,
            commitlog_offset=offset,
            queue=original.queue,
            queue_offset=original.queue_offset,
            due_ms=original.due_ms,
        )

    def _stored_id(self, offset: int) -> bytes | None:
        identity = self.store.identity_at(offset)
        return None if identity is None else identity[0]

    # ------------------------------------------------------------------ groups

    def queue_count(self, subject: str) -> int:
        """Queues of ``subject``: the configured number, or more when queues of an
        earlier, larger configuration still exist on disk (so they are drained)."""
        count = self.config.queues_for(subject)
        for s, q in self.store.queues:
            if s == subject and q >= count:
                count = q + 1
        return count

    def join(
        self,
        group: str,
        subject: str,
        consumer_id: str,
        connection: Hashable,
        now_ms: int,
        *,
        confirms: bool = True,
        held: Sequence[int] = (),
    ) -> tuple[int, ...]:
        """JOIN_GROUP: the member's queues. A group seen for the first time gets its
        start offsets (earliest or latest, per config) committed now, so a restart does
        not move them. ``confirms=False`` for a member that never says which queues it
        holds (the HTTP API's): its lost queues move at once. ``held``: the queues the
        member still holds (protocol version 3), which it gets back after a promotion
        (:meth:`promote`). Raises RejectedError for bad names."""
        self._refuse_if_following()
        _check_name("group", group)
        _check_subject(subject)
        _check_name("consumer_id", consumer_id)
        count = self.queue_count(subject)
        for queue in range(count):
            if self.offsets.get(group, subject, queue) is None:
                self.offsets.set(group, subject, queue, self._start_offset(subject, queue))
        queues, changed = self.groups.join(
            group, subject, consumer_id, count, connection, now_ms, confirms=confirms, held=held
        )
        self._membership_changed.set()
        if changed:
            self._rebalanced({(group, subject)})
        return queues

    def heartbeat(
        self,
        group: str,
        subject: str,
        consumer_id: str,
        connection: Hashable,
        now_ms: int,
        held: Sequence[int] | None = None,
    ) -> tuple[int, ...]:
        """HEARTBEAT: the member's current queues. ``held`` are the queues it still
        holds (it lets go of the others it was told it lost); None from a client of
        protocol version 1, which lets go of them when it reads the answer, as it always
        did. Raises RejectedError when it is not a member (never joined, timed out or
        its connection closed): join again."""
        queues = self.groups.touch(group, subject, consumer_id, connection, now_ms)
        if queues is None:
            raise RejectedError(ErrorCode.INVALID_REQUEST, "join the group first")
        still_held = queues if held is None else held
        if self.groups.confirm(group, subject, consumer_id, still_held, now_ms):
            self._rebalanced({(group, subject)})
        self._membership_changed.set()
        return queues

    def connection_closed(self, connection: Hashable) -> None:
        """Drop the members bound to a closed connection and reassign their queues."""
        self._rebalanced(self.groups.leave_connection(connection, self.monotonic_ms()))

    def _rebalanced(self, keys: Iterable[GroupKey]) -> None:
        for group, subject in keys:
            cursors = self._cursors.get((group, subject))
            if cursors:
                for queue in list(cursors):
                    reader = cursors[queue][0]
                    if queue not in self.groups.serving(group, subject, reader):
                        # Whoever reads it next starts from the committed offset: the old
                        # owner dropped what it had prefetched, and a crashed one's
                        # uncommitted messages are delivered again.
                        del cursors[queue]
            self.hub.notify([("group", group, subject)])
            log.info(
                "group %s on %s rebalanced: members %s",
                group,
                subject,
                self.groups.members(group, subject),
            )

    def _start_offset(self, subject: str, queue: int) -> int:
        if self.config.start_from is StartFrom.LATEST:
            return self.store.queue_end(subject, queue)
        return self.store.queue_min(subject, queue)

    def commit(self, group: str, subject: str, queue: int, offset: int) -> None:
        """COMMIT_OFFSET: ``group`` consumed ``queue`` below ``offset``. Acknowledged from
        memory, appended to the offsets log at once, durable with the next checkpoint
        (or :meth:`make_offsets_durable`). Raises RejectedError for an unknown
        queue or an offset past the end of the queue, and on a follower."""
        self._refuse_if_following()
        _check_name("group", group)
        _check_subject(subject)
        count = self.queue_count(subject)
        if not 0 <= queue < count:
            raise RejectedError(
                ErrorCode.INVALID_REQUEST, f"{subject} has queues 0..{count - 1}, not {queue}"
            )
        end = self.store.queue_end(subject, queue)
        if offset > end:
            raise RejectedError(
                ErrorCode.INVALID_REQUEST,
                f"offset {offset} is past the end of {subject}/{queue} ({end})",
            )
        self.offsets.set(group, subject, queue, offset)
        cursor = self._cursors.get((group, subject), {}).get(queue)
        if cursor is not None and cursor[1] < offset:
            cursor[1] = offset

    # ------------------------------------------------------------------ consuming

    async def pull(
        self,
        subject: str,
        group: str,
        consumer_id: str,
        max_messages: int,
        wait_ms: int,
        connection: Hashable = None,
    ) -> list[Message]:
        """PULL: up to ``max_messages`` messages from the member's queues; when there
        are none, wait up to ``wait_ms`` for one (long polling, woken by the reput).

        Counts as a heartbeat. Raises RejectedError when the consumer is not a member
        ("join the group first") or the arguments are bad.
        """
        encoded = await self.pull_encoded(
            subject, group, consumer_id, max_messages, wait_ms, connection
        )
        return [decode_message(encoded.data, a, b) for a, b in pairwise(encoded.bounds)]

    async def pull_encoded(
        self,
        subject: str,
        group: str,
        consumer_id: str,
        max_messages: int,
        wait_ms: int,
        connection: Hashable = None,
    ) -> EncodedMessages:
        """:meth:`pull`, with the messages as the wire carries them (what PullResult's
        ``encoded`` takes): the stored bytes, never decoded."""
        deadline = trio.current_time() + min(wait_ms, self.config.max_wait_ms) / 1000
        while True:
            encoded, queues = self._pull_now(subject, group, consumer_id, max_messages, connection)
            if encoded is not None or trio.current_time() >= deadline:
                return encoded or EncodedMessages.join([])
            keys: list[Hashable] = [(subject, q) for q in queues]
            keys.append(("group", group, subject))
            member = (group, subject, consumer_id)
            held, _ = self._holding.get(member, (0, None))
            self._holding[member] = (held + 1, connection)
            try:
                await self.hub.wait(keys, deadline)
            finally:
                held, _ = self._holding[member]
                if held == 1:
                    del self._holding[member]
                else:
                    self._holding[member] = (held - 1, connection)

    def pull_ready(
        self,
        subject: str,
        group: str,
        consumer_id: str,
        max_messages: int,
        connection: Hashable = None,
    ) -> EncodedMessages | None:
        """The PULL answered at once, synchronously: its messages when there are some,
        None when it would wait (then call :meth:`pull_encoded`, which looks again). The
        TCP server answers most PULLs of a busy subject this way, without a task and
        the scheduling step it costs. Raises as pull_encoded."""
        return self._pull_now(subject, group, consumer_id, max_messages, connection)[0]

    def _pull_now(
        self,
        subject: str,
        group: str,
        consumer_id: str,
        max_messages: int,
        connection: Hashable,
    ) -> tuple[EncodedMessages | None, Sequence[int]]:
        self._refuse_if_following()
        _check_subject(subject)
        if max_messages <= 0:
            raise RejectedError(ErrorCode.INVALID_REQUEST, "max_messages must be at least 1")
        max_messages = min(max_messages, self.config.max_pull_messages)
        queues = self.groups.touch(group, subject, consumer_id, connection, self.monotonic_ms())
        if queues is None:
            raise RejectedError(ErrorCode.INVALID_REQUEST, "join the group first")
        serving = self.groups.serving(group, subject, consumer_id)
        parts = self._take(group, subject, consumer_id, serving, max_messages)
        return (EncodedMessages.join(parts) if parts else None), queues

    def _take(
        self, group: str, subject: str, consumer_id: str, queues: Sequence[int], limit: int
    ) -> list[bytes]:
        cursors = self._cursors.setdefault((group, subject), {})
        out: list[bytes] = []
        budget = self.config.max_pull_bytes
        n = len(queues)
        self._pull_turn += 1
        for i in range(n):
            # Start at a different queue each time so that one busy queue cannot starve
            # the others of the same member.
            queue = queues[(self._pull_turn + i) % n]
            cursor = cursors.get(queue)
            if cursor is None or cursor[0] != consumer_id:
                committed = self.offsets.get(group, subject, queue)
                if committed is None:
                    committed = self._start_offset(subject, queue)
                    self.offsets.set(group, subject, queue, committed)
                cursor = cursors[queue] = [consumer_id, committed]
            if cursor[1] >= self.store.queue_end(subject, queue):
                continue
            after, got = self.store.read_queue(subject, queue, cursor[1], limit - len(out), budget)
            if got:
                cursor[1] = after
                out += got
                budget -= sum(map(len, got))
                if len(out) >= limit or budget <= 0:
                    break
        return out

    # ------------------------------------------------------------------ queries, stats

    def query(
        self, subject: str, *, message_id: str | None = None, key: str | None = None
    ) -> list[Message]:
        """QUERY through the index: the stored messages of ``subject`` with this id or
        key, newest first (at most 64), each verified against its record. Messages not
        yet reput (not yet durable) are not found."""
        _check_subject(subject)
        if (message_id is None) == (key is None):
            raise RejectedError(ErrorCode.INVALID_REQUEST, "query by exactly one of id and key")
        subject_bytes = subject.encode()
        store = self.store
        if message_id is not None:
            wanted = message_id.encode()

            def matches(offset: int) -> bool:
                found = store.identity_at(offset)
                return found is not None and found[0] == wanted and found[1] == subject_bytes

            index_key = id_index_key(wanted)
        else:
            assert key is not None
            wanted = key.encode()

            def matches(offset: int) -> bool:
                found = store.identity_at(offset)
                return found is not None and found[2] == wanted and found[1] == subject_bytes

            index_key = key_index_key(subject_bytes, wanted)
        offsets = store.lookup(index_key, matches, MAX_QUERY_RESULTS)
        return [m for m in map(store.message_at, offsets) if m is not None]

    def lags(self) -> list[tuple[str, str, int, int]]:
        """(group, subject, queue, messages not yet committed) for every known offset."""
        return [
            (group, subject, queue, max(0, self.store.queue_end(subject, queue) - offset))
            for (group, subject, queue), offset in sorted(self.offsets.items())
        ]

    def stats(self) -> dict[str, str | int | float]:
        """STATS: flat named values. Subjects, groups and queues are joined with '/'."""
        store = self.store
        out: dict[str, str | int | float] = {
            "broker.messages_stored_total": store.messages_stored,
            "broker.duplicates_total": self.duplicates,
            "broker.refused_total": self.refused,
            "broker.commitlog_end_offset": store.commitlog.end_offset,
            "broker.commitlog_durable_offset": store.commitlog.durable_offset,
            "broker.reput_offset": store.reput_offset,
            "broker.fsyncs_total": store.writer.fsyncs,
            "broker.dedupe_ids": len(self.window),
            "broker.dedupe_memory_bytes": self.window.memory_bytes,
            "broker.held_pulls": self.hub.held,
            "broker.checkpoints_total": self.checkpoints,
            "broker.offsets_unsaved": int(self.offsets.dirty),
            "broker.rebalance_handovers_total": self.groups.handovers,
            "broker.rebalance_handover_ms_total": self.groups.handover_wait_ms_total,
            "broker.rebalance_handover_queues": self.groups.queues_in_handover(),
            "broker.promotion_held_queues_total": self.groups.claim_holds,
            "broker.promotion_held_ms_total": self.groups.claim_hold_ms_total,
            "broker.promotion_unclaimed_queues_total": self.groups.unclaimed_given,
            "broker.promotion_held_queues": self.groups.queues_unclaimed(),
        }
        for subject, queue in sorted(store.queues):
            out[f"queue_end_offset/{subject}/{queue}"] = store.queue_end(subject, queue)
        for group, subject, queue, lag in self.lags():
            out[f"consumer_lag_messages/{group}/{subject}/{queue}"] = lag
        for group, subject in sorted(self.groups.keys()):
            out[f"group_members/{group}/{subject}"] = len(self.groups.members(group, subject))
        return out


@asynccontextmanager
async def open_broker(
    data_dir: str,
    config: BrokerConfig | None = None,
    *,
    fs: FileSystem = REAL_FS,
    clock: Callable[[], int] = wall_ms,
) -> AsyncIterator[Broker]:
    """Open, recover and run a broker for the duration of the block; on exit it flushes,
    checkpoints and closes. Recovery runs in a worker thread."""
    broker = await trio.to_thread.run_sync(
        lambda: Broker.open(data_dir, config, fs=fs, clock=clock)
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(broker.run)
        try:
            yield broker
        finally:
            nursery.cancel_scope.cancel()
