"""Sender: hands due wheel entries to broker groups and records them in dispatch_log.

    ticker ─on_due─▶ [due channel, bounded] ─▶ dispatch loop: read records from
    schedule_log, route each message to a group ─▶ per-group queue ─▶ group loop:
    SEND_BATCH, up to ``batches_in_flight`` at once ─ack─▶ dispatch_log, manager
                                              └─fail─▶ retry heap (back-off, another group)

As QMQ's SenderProcessor and SenderGroup, a batch goes to one broker group; unlike QMQ,
failures are retried on another group with exponential back-off, after
``max_attempts`` a message is sent to its dead-letter subject (never dropped), each
group has a circuit breaker, and a slow group cannot hold up the others: its queue is
its own, and when it is full new messages are routed elsewhere.

Memory is bounded: at most ``max_in_flight`` messages are between the wheel and
dispatch_log; beyond it the dispatch loop stops taking entries, the due channel fills,
and the ticker waits in ``on_due`` — due entries stay in the wheel (compact) instead of
piling up here as messages.

A message is recorded in dispatch_log only after a broker group acknowledged it
(OK or DUPLICATE). A crash before the record costs a resend after restart, which the
broker drops as a duplicate: consumers see each message once.

Cancel (docs/cancel.md): every entry the wheel releases is *held* here, by its wheel
ref, from ``on_due`` until its dispatch_log entry. ``withdraw`` takes a held message
back unless a broker may already have it: one in a send batch whose answer has not
come, or one whose earlier batch failed without an answer (the broker may have stored
it). For those the canceller ``watch``es the outcome instead: acknowledged → already
delivered; refused by the broker (it answered, and stored nothing) → a watcher that
asked for it withdraws the message there and then, instead of retrying it.

A full disk (docs/operations.md, "A full disk"): a broker answering DISK_FULL stored
nothing, so those messages are retried with back-off without counting an attempt (a
full disk is not the message's fault: it must not end in the dead-letter subject), and
a dispatch_log entry that finds no space is written again after a back-off, the
messages held meanwhile (a crash before it costs a resend, which the broker answers
DUPLICATE).

A message that an earlier run may have sent (due before this sender started, with no
dispatch_log entry: its entry may have been lost with the unflushed tail, or its batch
was in flight at the crash) is in doubt wherever it is: ``watch_earlier`` watches it
held, or, when it is still in the wheel or not loaded yet, from the moment it is read
(it is overdue, so that comes soon). It is sent as usual and never withdrawn.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import logging
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat

import trio

from delayd.logs.dispatch_files import DispatchFiles
from delayd.logs.dispatch_log import EntryKind, check_group_name
from delayd.logs.message_log import MessageRecord
from delayd.logs.schedule_log import decode_scheduled
from delayd.logs.schedule_reader import ScheduleReader
from delayd.nowait_acquire import holding
from delayd.protocol import EncodedMessages, Message
from delayd.protocol.codec import encode_message
from delayd.protocol.codes import ResultCode
from delayd.sender.circuit import CircuitBreaker, CircuitState
from delayd.sender.histogram import Histogram
from delayd.sender.retry import RetryPolicy, dead_letter_subject
from delayd.sender.routing import GroupWeight, Router
from delayd.sender.targets import SendTarget, TargetUnavailable
from delayd.sender.wire import TAIL, TEXT_AT, ScheduledHead, read_head
from delayd.wheel.manager import WheelManager
from delayd.wheel.timer import OFFSET_BITS, DueEntries
from delayd.write_refusals import DISPATCH_LOG, WriteRefusals
from storage.errors import DiskFullError

log = logging.getLogger(__name__)

ACKED = (ResultCode.OK, ResultCode.DUPLICATE)
READ_INLINE_MAX = 64  # entries read on the event loop; more go to a worker thread
PARKED_RETRY_S = 0.05  # how often messages with no usable group look again
# Lateness is whole milliseconds: an on-time delivery is exactly 0, which the 0 bucket
# keeps at 0 in a quantile (with 1 ms as the first bound it would read as 0.5 ms).
LATENESS_BOUNDS_S = (0, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 5, 30, 300)
BATCH_BOUNDS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
DEAD_LETTER_REASON = "delayd.dead_letter.reason"
ORIGINAL_SUBJECT = "delayd.original_subject"
_OFFSET_MASK = (1 << OFFSET_BITS) - 1
DISK_FULL_RETRY_S = (0.05, 1.0)  # first and longest wait before a refused entry again


@dataclass(frozen=True, slots=True)
class SenderConfig:
    """How the sender batches, limits and retries (docs/configuration.md, [delivery])."""

    max_batch: int = 512
    max_in_flight: int = 50_000
    group_queue_limit: int = 10_000
    batches_in_flight: int = 4
    failure_threshold: int = 5
    open_ms: int = 1_000
    max_open_ms: int = 30_000
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    dispatch_flush_interval_s: float = 0.2


Watcher = Callable[[EntryKind, int], object]
"""``watcher(kind, at_ms)``: the fate of a watched message, once its entry is written
(DISPATCHED, DEAD_LETTERED, or CANCELLED when a watcher withdrew it on a refusal)."""


class Withdrawal(enum.Enum):
    """What ``Sender.withdraw`` did."""

    NOT_HELD = "not held"  # not between the wheel and dispatch_log
    WITHDRAWN = "withdrawn"  # taken back: the caller records it and tells the manager
    IN_DOUBT = "in doubt"  # a broker may have it: watch the outcome


class _Item:
    """One message between the wheel and dispatch_log: its schedule_log payload and what
    routing and sending read of it (the full record is decoded only when needed)."""

    __slots__ = (
        "_record",
        "attempts",
        "bucket_id",
        "bucket_ms",
        "dead",
        "due_ms",
        "key",
        "maybe_sent",
        "message_id",
        "offset",
        "payload",
        "reason",
        "sending",
        "subject",
        "watchers",
        "wire_head",
        "withdrawn",
    )

    def __init__(self, bucket_id: int, bucket_ms: int, offset: int, payload: bytes):
        """Raises RecordFormatError when ``payload`` is not a SCHEDULED payload."""
        self.bucket_id = bucket_id
        self.bucket_ms = bucket_ms
        self.offset = offset
        self.payload = payload
        head = read_head(payload)
        if head is None:  # malformed: the full decode raises and says why
            record = decode_scheduled(payload).message
            head = ScheduledHead(record.due_ms, record.message_id, record.subject, record.key, None)
        self._record: MessageRecord | None = None
        self.due_ms = head.due_ms
        self.message_id = head.message_id
        self.subject = head.subject
        self.key = head.key
        self.wire_head = head.wire_head  # None: encode it from a Message
        self.attempts = 0
        self.dead = False
        self.reason = ""
        self.sending = False  # in a send batch whose outcome is not recorded yet
        self.maybe_sent = False  # a batch holding it failed unanswered: a broker may have it
        self.withdrawn = False  # cancelled or moved: skipped wherever it still sits
        self.watchers: list[tuple[bool, Watcher]] | None = None  # (withdraw on refusal, cb)

    @property
    def ref(self) -> int:
        return self.bucket_id << OFFSET_BITS | self.offset

    @property
    def record(self) -> MessageRecord:
        """The decoded message_log record (decoded on first use)."""
        if self._record is None:
            self._record = decode_scheduled(self.payload).message
        return self._record

    def message(self, dispatched_ms: int) -> Message:
        r = self.record
        if not self.dead:
            return Message(
                r.message_id,
                r.subject,
                r.key,
                r.properties,
                r.body,
                due_ms=r.due_ms,
                dispatched_ms=dispatched_ms,
            )
        properties = {**r.properties, DEAD_LETTER_REASON: self.reason, ORIGINAL_SUBJECT: r.subject}
        return Message(
            r.message_id,
            dead_letter_subject(r.subject),
            r.key,
            properties,
            r.body,
            due_ms=r.due_ms,
            dispatched_ms=dispatched_ms,
        )


@dataclass(slots=True)
class GroupStatistics:
    """Counters of one broker group, for metrics (messages, not batches)."""

    name: str
    circuit: CircuitState
    queued: int
    sent: int = 0
    failed: int = 0
    retried: int = 0
    dead_lettered: int = 0


class _Group:
    def __init__(self, target: SendTarget, weight: int, config: SenderConfig) -> None:
        self.name = target.name
        self.raw_name = check_group_name(target.name)
        self.target = target
        self.weight = weight
        self.breaker = CircuitBreaker(
            failure_threshold=config.failure_threshold,
            open_ms=config.open_ms,
            max_open_ms=config.max_open_ms,
        )
        # The embedded broker takes batches in their wire encoding: no Messages built.
        self.send_encoded = getattr(target, "send_encoded", None)
        self.queue: deque[_Item] = deque()
        self.ready = trio.Event()
        self.answered = trio.Event()  # set whenever a batch's outcome is recorded
        self.slots = trio.Semaphore(config.batches_in_flight)
        self.stats = GroupStatistics(self.name, CircuitState.CLOSED, 0)


class Sender:
    """See the module docstring. ``on_due`` is the ticker's callback; ``run`` the task."""

    def __init__(
        self,
        groups: Sequence[tuple[SendTarget, int]],
        manager: WheelManager,
        reader: ScheduleReader,
        dispatch: DispatchFiles,
        dispatch_lock: trio.Lock,
        *,
        clock: Callable[[], int],
        config: SenderConfig | None = None,
        seed: int | None = None,
    ) -> None:
        self.config = config = config or SenderConfig()
        if not groups:
            raise ValueError("the sender needs at least one broker group")
        self._groups = {target.name: _Group(target, weight, config) for target, weight in groups}
        if len(self._groups) != len(groups):
            raise ValueError("broker group names must be unique")
        self._router = Router(
            [GroupWeight(g.name, g.weight) for g in self._groups.values()], seed=seed
        )
        self.manager = manager
        self.reader = reader
        self.dispatch = dispatch
        self.dispatch_lock = dispatch_lock
        self.clock = clock
        self._rng = random.Random(seed)
        self._due_send, self._due_recv = trio.open_memory_channel[tuple](2)
        self._dispatching = False  # the dispatch loop is between a chunk and its routing
        self._in_flight = 0
        self._room = trio.Event()
        self._retries: list[tuple[int, int, list[_Item], str]] = []  # (ready_ms, n, items, group)
        self._retry_seq = itertools.count()
        self._retry_wake = trio.Event()
        self._parked: list[_Item] = []  # no usable group when routed
        self._nursery: trio.Nursery | None = None
        self._recorded = trio.Event()  # dispatch_log entries written since the flush
        self._flushes_started = 0  # flush() group commit: numbered in order of start
        self._flushes_done = 0
        self._flush_running: trio.Event | None = None
        # Wheel ref -> its item (None until read) for every entry released by the wheel
        # and not yet recorded; bounded by max_in_flight plus the due channel.
        self._held: dict[int, _Item | None] = {}
        self._withdrawn_unread: set[int] = set()  # refs withdrawn before they were read
        # (bucket start, offset) -> watchers of messages in doubt from an earlier run
        # that this sender has not read yet (see watch_earlier).
        self._earlier: dict[tuple[int, int], list[tuple[bool, Watcher]]] = {}
        self.started_ms: int | None = None  # this run sent nothing due at or after it
        self.withdrawn_total = 0
        self.lateness_s = Histogram(LATENESS_BOUNDS_S)
        self.batch_sizes = Histogram(BATCH_BOUNDS)
        self.refusals = WriteRefusals()  # the server shares its own

    # ------------------------------------------------------------------ input

    async def on_due(self, entries: DueEntries, now_ms: int) -> None:
        """The ticker's callback: queue due entries in chunks of ``max_batch``; waits
        while the sender is full (back-pressure on the ticker).

        A few entries, while the dispatch loop is idle and the sender has room, are
        read and routed here and then, and their send batches started: the common case
        of a steady trickle of due messages then costs no hop through the dispatch and
        group loops (each a scheduling step of the whole event loop)."""
        # Held from here, before any await: nothing can be released and not held.
        self._held.update(dict.fromkeys(entries.ref))
        if (
            len(entries) <= READ_INLINE_MAX
            and not self._dispatching
            and self._in_flight < self.config.max_in_flight
            and self._due_send.statistics().current_buffer_used == 0
            and self._nursery is not None
        ):
            self._take(self._read_plan(self._plan(entries.ref)))
            return
        step = self.config.max_batch
        for i in range(0, len(entries), step):
            await self._due_send.send((entries.due_ms[i : i + step], entries.ref[i : i + step]))

    # ------------------------------------------------------------------ tasks

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every sender task until cancelled; errors propagate."""
        self.started_ms = self.clock()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._dispatch_loop)
            nursery.start_soon(self._retry_loop)
            nursery.start_soon(self._flush_loop)
            for group in self._groups.values():
                nursery.start_soon(self._group_loop, group)
            task_status.started()

    async def _dispatch_loop(self) -> None:
        async for _due, refs in self._due_recv:
            self._dispatching = True  # on_due queues behind this chunk, keeping order
            while self._in_flight >= self.config.max_in_flight:
                self._room = trio.Event()
                await self._room.wait()
            self._take(await self._read(refs))
            self._dispatching = False

    def _take(self, items: list[_Item]) -> None:
        """Hold the items read for released entries (except those withdrawn meanwhile)
        and route them."""
        withdrawn = self._withdrawn_unread
        if withdrawn:
            kept = []
            for item in items:
                ref = item.ref
                if ref in withdrawn:
                    withdrawn.discard(ref)
                else:
                    kept.append(item)
            items = kept
        held = self._held
        for item in items:
            held[item.ref] = item
        if self._earlier:
            self._adopt_earlier(items)
        self._in_flight += len(items)
        self._route(items, None)

    async def _read(self, refs) -> list[_Item]:
        """The records of the wheel refs; many are read in a worker thread."""
        plan = self._plan(refs)
        if len(refs) <= READ_INLINE_MAX:
            return self._read_plan(plan)
        return await trio.to_thread.run_sync(self._read_plan, plan)

    def _plan(self, refs) -> list[tuple[int, int, list[int]]]:
        """The wheel refs grouped per bucket for the reads: (bucket id, start, offsets)."""
        bucket_of_id = self.manager.bucket_of_id
        wanted: dict[int, list[int]] = {}
        for ref in refs:
            wanted.setdefault(ref >> OFFSET_BITS, []).append(ref & _OFFSET_MASK)
        return [
            (bucket_id, bucket_of_id(bucket_id), offsets) for bucket_id, offsets in wanted.items()
        ]

    def _read_plan(self, plan: list[tuple[int, int, list[int]]]) -> list[_Item]:
        items = []
        for bucket_id, bucket_ms, offsets in plan:
            payloads = self.reader.read_payloads(bucket_ms, offsets)
            items += map(_Item, repeat(bucket_id), repeat(bucket_ms), offsets, payloads)
        return items

    def _usable_now(self) -> Callable[[str], bool]:
        """``usable(name)`` for the routing of one batch: each breaker's state is read
        once (it changes only when the loop runs other tasks), the queue's length every
        time (it grows as the batch is routed)."""
        now_ms = self.clock()
        limit = self.config.group_queue_limit
        queues = {}
        for name, group in self._groups.items():
            breaker = group.breaker
            state = breaker.state(now_ms)
            if not (
                state is CircuitState.OPEN
                or (state is CircuitState.HALF_OPEN and breaker.probe_in_flight)
            ):
                queues[name] = group.queue

        def usable(name: str) -> bool:
            queue = queues.get(name)
            return queue is not None and len(queue) < limit

        return usable

    def _route(self, items: list[_Item], failed_group: str | None, *, wake: bool = True) -> None:
        """Queue each item on a usable group (not ``failed_group`` when another one is
        usable); items with none wait in the parked list, looked at again by the retry
        loop every PARKED_RETRY_S (``wake``: tell it there are some)."""
        choose, usable = self._router.choose, self._usable_now()
        exclude = () if failed_group is None else (failed_group,)
        touched = set()
        for item in items:
            if item.withdrawn:
                continue  # cancelled while it waited for a retry or a usable group
            # A keyless message is routed by its id rather than at random, so that when
            # it is sent again after a restart (sent, but not yet in dispatch_log) it goes
            # to the same group, whose broker drops it as a duplicate: dedupe is per
            # broker, and another group would store it a second time.
            route_key = item.message_id if item.key is None else item.key
            name = choose(route_key, usable, exclude)
            if name is None and exclude:
                name = choose(route_key, usable)
            if name is None:
                self._parked.append(item)
                continue
            group = self._groups[name]
            group.queue.append(item)
            touched.add(group)
        for group in touched:
            self._start_ready_batches(group)
            if group.queue:  # what is left waits for its loop
                group.ready.set()
        if self._parked and wake:
            self._retry_wake.set()

    async def _group_loop(self, group: _Group) -> None:
        nursery = self._nursery
        assert nursery is not None
        max_batch = self.config.max_batch
        while True:
            if not group.queue:
                group.ready = trio.Event()
                await group.ready.wait()
                continue
            await group.slots.acquire()
            breaker = group.breaker
            was = breaker.state(self.clock())
            if not group.queue or not breaker.allow(self.clock()):
                group.slots.release()
                if group.queue and breaker.state(self.clock()) is CircuitState.OPEN:
                    # Opened while these waited: send them elsewhere, no attempt spent.
                    moved = list(group.queue)
                    group.queue.clear()
                    self._route(moved, group.name)
                elif group.queue:
                    # Half-open with the probe out: its answer decides (closed: send
                    # these; open again: move them elsewhere).
                    group.answered = trio.Event()
                    await group.answered.wait()
                continue
            if was is CircuitState.HALF_OPEN:
                log.info(
                    "broker group %s: circuit half-open after %d ms open; sending one probe batch",
                    group.name,
                    breaker.open_ms,
                )
            self._start_batch(group, nursery, max_batch)

    def _start_ready_batches(self, group: _Group) -> None:
        """Start send batches of a group whose circuit is closed, while it has free
        slots: what its loop would do next, without the hop (the loop still handles
        everything else: no free slot, an open or half-open circuit)."""
        nursery = self._nursery
        if nursery is None or group.breaker.state(self.clock()) is not CircuitState.CLOSED:
            return
        slots, max_batch = group.slots, self.config.max_batch
        while group.queue and slots.value > 0:  # a free slot: no task waits for one
            slots.acquire_nowait()
            self._start_batch(group, nursery, max_batch)

    def _start_batch(self, group: _Group, nursery: trio.Nursery, max_batch: int) -> None:
        """With a slot of ``group`` taken and its breaker's allow: send the next batch
        from its queue (the slot is released when there is nothing to send)."""
        queue, batch = group.queue, []
        while queue and len(batch) < max_batch:
            item = queue.popleft()
            if not item.withdrawn:
                item.sending = True
                batch.append(item)
        if not batch:
            group.slots.release()
            return
        nursery.start_soon(self._send, group, batch)

    async def _send(self, group: _Group, batch: list[_Item]) -> None:
        now_ms = self.clock()
        ok = False
        failure = "the send was cancelled or failed"
        try:
            if group.send_encoded is not None:
                results = await group.send_encoded(self._encode(batch, now_ms))
            else:
                messages = [item.message(now_ms) for item in batch]
                results = await group.target.send_batch(messages)
            ok = True
        except TargetUnavailable as exc:
            failure = str(exc)
            group.stats.failed += len(batch)
            for item in batch:
                item.sending = False
                item.maybe_sent = True  # unanswered: the broker may have stored it
            self._retry(batch, group, failure)
            return
        finally:
            self._record_outcome(group, ok, failure)
            group.slots.release()
        self.batch_sizes.observe_many((len(batch),))
        # Acknowledged items (and refused ones a watcher withdraws) stay ``sending``
        # until their entries are written under the dispatch lock: a cancel that takes
        # the lock while _record waits for it must see them in doubt, not withdraw a
        # message a broker has just acknowledged.
        acked, refused, withdraw, disk_full = [], [], [], []
        for item, result in zip(batch, results, strict=True):
            if result.code in ACKED:
                acked.append(item)
            else:
                item.reason = f"{ResultCode(result.code).name}: {result.reason}"
                if item.watchers and not item.maybe_sent and any(w for w, _ in item.watchers):
                    withdraw.append(item)  # refused, so stored nowhere: the cancel wins
                else:
                    item.sending = False  # stored nowhere: it may be withdrawn now
                    full = result.code == ResultCode.DISK_FULL
                    (disk_full if full else refused).append(item)
        if acked:
            await self._record(group, acked, now_ms)
        if withdraw:
            await self._withdraw_refused(withdraw)
        if refused:
            group.stats.failed += len(refused)
            self._retry(refused, group, refused[0].reason)
        if disk_full:
            group.stats.failed += len(disk_full)
            self._retry(disk_full, group, disk_full[0].reason, count_attempt=False)

    @staticmethod
    def _encode(batch: list[_Item], dispatched_ms: int) -> EncodedMessages:
        """The batch in the wire encoding, as ``encode_message`` of each item's Message
        would give it, mostly copied from the schedule_log payloads (wire.py)."""
        out = bytearray()
        bounds = [0]
        tail = TAIL.pack
        for item in batch:
            head = item.wire_head
            if head is None or item.dead:
                out += encode_message(item.message(dispatched_ms))
            else:
                out += head
                out += memoryview(item.payload)[TEXT_AT:]
                out += tail(item.due_ms, dispatched_ms)
            bounds.append(len(out))
        return EncodedMessages(bytes(out), tuple(bounds))

    def _record_outcome(self, group: _Group, ok: bool, failure: str) -> None:
        """Tell the group's breaker how a batch went, log the circuit's transitions, and
        wake a group loop waiting for a probe's answer."""
        breaker = group.breaker
        now_ms = self.clock()
        was_open = breaker.state(now_ms) is not CircuitState.CLOSED
        probe = breaker.probe_in_flight
        opened = breaker.opened_total
        if ok:
            breaker.record_success(now_ms)
            if was_open:
                what = "the probe batch" if probe else "a batch"
                log.info("broker group %s: circuit closed: %s succeeded", group.name, what)
        else:
            breaker.record_failure(now_ms)
            if breaker.opened_total != opened:
                if probe:
                    why = f"the probe batch failed: {failure}"
                else:
                    why = f"{breaker.consecutive_failures} batches failed in a row, last: {failure}"
                log.warning(
                    "broker group %s: circuit open for %d ms: %s",
                    group.name,
                    breaker.open_ms,
                    why,
                )
        group.answered.set()

    async def _record(self, group: _Group, items: list[_Item], at_ms: int) -> None:
        by_bucket: dict[tuple[int, int, EntryKind], list[int]] = {}
        dead = 0
        for item in items:
            kind = EntryKind.DEAD_LETTERED if item.dead else EntryKind.DISPATCHED
            dead += item.dead
            by_bucket.setdefault((item.bucket_ms, item.bucket_id, kind), []).append(item.offset)
        unwritten = [
            (bucket_ms, kind, offsets) for (bucket_ms, _, kind), offsets in by_bucket.items()
        ]
        wait_s = DISK_FULL_RETRY_S[0]
        while True:
            async with holding(self.dispatch_lock):
                if self._write_entries(unwritten, at_ms, group.raw_name):
                    # Under the lock with the last entries: a canceller that holds it
                    # sees a held message or its entry (or both), never neither.
                    held = self._held
                    for item in items:
                        held.pop(item.ref, None)
                        if item.watchers:
                            kind = EntryKind.DEAD_LETTERED if item.dead else EntryKind.DISPATCHED
                            for _, watcher in item.watchers:
                                watcher(kind, at_ms)
                    break
            # The disk is full: the messages stay held (a cancel finds them in doubt)
            # until their entries are written.
            await trio.sleep(wait_s)
            wait_s = min(2 * wait_s, DISK_FULL_RETRY_S[1])
        self._recorded.set()
        for (_, bucket_id, _), offsets in by_bucket.items():
            self.manager.on_recorded(bucket_id, len(offsets))
        self.lateness_s.observe_many((at_ms - item.due_ms) / 1000 for item in items)
        group.stats.sent += len(items) - dead
        group.stats.dead_lettered += dead
        self._in_flight -= len(items)
        if self._in_flight < self.config.max_in_flight:
            self._room.set()

    def _write_entries(
        self, unwritten: list[tuple[int, EntryKind, list[int]]], at_ms: int, group: bytes
    ) -> bool:
        """Append the dispatch_log entries of ``unwritten`` (bucket, kind, offsets),
        removing each from it once written; whether all are (False: the disk is full,
        and ``unwritten`` holds the rest). Call with the dispatch lock held."""
        try:
            while unwritten:
                bucket_ms, kind, offsets = unwritten[0]
                self.dispatch.record(bucket_ms, kind, offsets, at_ms, group)
                del unwritten[0]
        except DiskFullError as exc:
            self.refusals.refuse(DISPATCH_LOG, exc)
            return False
        self.refusals.clear(DISPATCH_LOG)
        return True

    async def _withdraw_refused(self, items: list[_Item]) -> None:
        """Record as CANCELLED watched items a broker refused (see the module
        docstring), instead of retrying them."""
        now_ms = self.clock()
        unwritten = [(item.bucket_ms, EntryKind.CANCELLED, [item.offset]) for item in items]
        wait_s = DISK_FULL_RETRY_S[0]
        while True:
            async with holding(self.dispatch_lock):
                if self._write_entries(unwritten, now_ms, b""):
                    for item in items:
                        self._held.pop(item.ref, None)
                        item.withdrawn = True
                        for _, watcher in item.watchers or ():
                            watcher(EntryKind.CANCELLED, now_ms)
                    break
            await trio.sleep(wait_s)  # the disk is full: held until the entries fit
            wait_s = min(2 * wait_s, DISK_FULL_RETRY_S[1])
        self._recorded.set()
        for item in items:
            self.manager.on_recorded(item.bucket_id, 1)
        self.withdrawn_total += len(items)
        self._in_flight -= len(items)
        self._room.set()

    # ------------------------------------------------------------------ cancel

    def withdraw(self, ref: int) -> Withdrawal:
        """Take the message of wheel ``ref`` back, if it is held and no broker may have
        it. Synchronous; call with the dispatch lock held. WITHDRAWN: the caller writes
        its entry and calls ``manager.on_recorded``; it is never sent."""
        if ref not in self._held:
            return Withdrawal.NOT_HELD
        item = self._held[ref]
        if item is None:  # released by the wheel, not read yet: dropped once read
            self._withdrawn_unread.add(ref)
        elif item.sending or item.maybe_sent:
            return Withdrawal.IN_DOUBT
        else:
            item.withdrawn = True  # skipped where it waits (group queue, retries, parked)
            self._in_flight -= 1
            self._room.set()
        del self._held[ref]
        self.withdrawn_total += 1
        return Withdrawal.WITHDRAWN

    def watch(self, ref: int, watcher: Watcher, *, withdraw_on_refusal: bool) -> None:
        """Call ``watcher`` with the fate of the held, IN_DOUBT message of ``ref``."""
        item = self._held[ref]
        assert item is not None
        if item.watchers is None:
            item.watchers = []
        item.watchers.append((withdraw_on_refusal, watcher))

    def holds(self, ref: int) -> bool:
        """Whether the message of wheel ``ref`` is between the wheel and dispatch_log."""
        return ref in self._held

    def watch_earlier(self, bucket_ms: int, offset: int, ref: int | None, watcher: Watcher) -> None:
        """Call ``watcher`` with the fate of the message at (bucket, offset) — wheel
        ``ref``, None when its bucket has no wheel id — which an earlier run may have
        sent: it is marked as maybe sent (a refusal then does not prove it is stored
        nowhere), held or from the moment it is read. Synchronous; call with the
        dispatch lock held, for a message that has no dispatch_log entry and is due
        (the wheel releases it at once, or the loader loads it soon and then it is)."""
        item = self._held.get(ref) if ref is not None else None
        if item is None:  # in the wheel, not loaded, or released and not read yet
            self._earlier.setdefault((bucket_ms, offset), []).append((False, watcher))
            return
        item.maybe_sent = True
        if item.watchers is None:
            item.watchers = []
        item.watchers.append((False, watcher))

    def _adopt_earlier(self, items: list[_Item]) -> None:
        earlier = self._earlier
        for item in items:
            watchers = earlier.pop((item.bucket_ms, item.offset), None)
            if watchers is not None:
                item.maybe_sent = True
                item.watchers = [*(item.watchers or ()), *watchers]

    def _retry(
        self, items: list[_Item], group: _Group, reason: str, *, count_attempt: bool = True
    ) -> None:
        """Count an attempt for each item (unless ``count_attempt`` is False: a refusal
        that is not the message's fault, a full disk) and put them back after the
        back-off; past ``max_attempts`` an item goes to its dead-letter subject instead
        (and keeps being retried there: never dropped)."""
        policy = self.config.retry
        group.stats.retried += len(items)
        attempts = 1
        for item in items:
            item.attempts += count_attempt
            if count_attempt and not item.dead and policy.exhausted(item.attempts):
                item.dead = True
                item.reason = item.reason or reason
                log.warning(
                    "message %s: %d attempts failed (%s); sending it to %s",
                    item.message_id,
                    item.attempts,
                    item.reason,
                    dead_letter_subject(item.subject),
                )
            attempts = max(attempts, item.attempts)
        ready_ms = self.clock() + policy.delay_ms(attempts, self._rng)
        heapq.heappush(self._retries, (ready_ms, next(self._retry_seq), items, group.name))
        self._retry_wake.set()

    async def _retry_loop(self) -> None:
        while True:
            self._retry_wake = trio.Event()
            now_ms = self.clock()
            while self._retries and self._retries[0][0] <= now_ms:
                _, _, items, failed_group = heapq.heappop(self._retries)
                self._route(items, failed_group, wake=False)
            if self._parked:
                parked, self._parked = self._parked, []
                self._route(parked, None, wake=False)
            timeout_s = float("inf")
            if self._retries:
                timeout_s = (self._retries[0][0] - now_ms) / 1000
            if self._parked:
                timeout_s = min(timeout_s, PARKED_RETRY_S)
            with trio.move_on_after(max(0.0, timeout_s)):
                await self._retry_wake.wait()

    async def _flush_loop(self) -> None:
        """Flush dispatch_log ``dispatch_flush_interval_s`` after the first entry that
        is not yet durable (so an idle sender does not wake)."""
        interval = self.config.dispatch_flush_interval_s
        while True:
            await self._recorded.wait()
            await trio.sleep(interval)
            self._recorded = trio.Event()
            await self.flush()

    async def flush(self) -> None:
        """Make the dispatch_log entries written so far durable. Group commit: every
        caller that comes while a flush runs shares the next one (a flush that began
        before the call may miss its entries), so a thousand cancels waiting for their
        entries cost one fsync per file, not a thousand."""
        ticket = self._flushes_started
        while self._flushes_done <= ticket:  # no flush begun after the call is done
            if self._flush_running is not None:
                await self._flush_running.wait()
                continue
            self._flushes_started += 1
            number = self._flushes_started
            running = self._flush_running = trio.Event()
            try:
                async with self.dispatch_lock:
                    if self.dispatch.dirty:
                        await trio.to_thread.run_sync(self.dispatch.flush)
                self._flushes_done = number
            finally:
                self._flush_running = None
                running.set()

    # ------------------------------------------------------------------ metrics

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def parked(self) -> int:
        return len(self._parked)

    def group_statistics(self) -> list[GroupStatistics]:
        now_ms = self.clock()
        out = []
        for group in self._groups.values():
            group.stats.circuit = group.breaker.state(now_ms)
            group.stats.queued = len(group.queue)
            out.append(group.stats)
        return out
