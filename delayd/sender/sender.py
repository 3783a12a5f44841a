"""Sender: hands due wheel entries to broker groups and records them in dispatch_log.

    ticker ─on_due─▶ [due channel, bounded] ─▶ dispatch loop: read records from
    schedule_log, route each message to a group ─▶ per-group queue ─▶ group loop:
    SEND_BATCH, up to ``batches_in_flight`` at once ─ack─▶ dispatch_log, manager
                                              └─fail─▶ retry heap (back-off, another group)

As QMQ's SenderProcessor and SenderGroup, a batch goes to one broker group; unlike QMQ,
failures are retried on another group with exponential back-off (a batch that went
unanswered, which that group's broker may have stored, waits for the same group up
to ``doubt_hold_ms``: dedupe is per group), after
``max_attempts`` a message is sent to its dead-letter subject (never dropped), each
group has a circuit breaker, and a slow group cannot hold up the others: its queue is
its own, and when it is full new messages are routed elsewhere.

The groups may change while it runs (``add_group``, ``set_accepting``: a group found in
etcd, one being drained; delayd.sender.discovery); with none yet, messages wait in the
parked list.

Memory is bounded: at most ``max_in_flight`` messages are between the wheel and
dispatch_log; beyond it the dispatch loop stops taking entries, the due channel fills,
and the ticker waits in ``on_due`` — due entries stay in the wheel (compact) instead of
piling up here as messages.

A message is recorded in dispatch_log only after a broker group acknowledged it
(OK or DUPLICATE). A crash before the record costs a resend after restart, which the
broker drops as a duplicate: consumers see each message once.

Cancel (docs/cancel.md): every entry the wheel releases is *held* from ``on_due``
until its dispatch_log entry; ``withdraw`` takes a held message back unless a broker
may already have it, and for those the canceller ``watch``es the outcome instead. The
bookkeeping — held, in doubt, withdrawn, retried, parked — is delayd.sender.ledger,
pure logic; this module is the trio wiring that moves the messages and writes their
entries.

A full disk (docs/operations.md, "A full disk"): a broker answering DISK_FULL stored
nothing, so those messages are retried with back-off without counting an attempt (a
full disk is not the message's fault: it must not end in the dead-letter subject), and
a dispatch_log entry that finds no space is written again after a back-off, the
messages held meanwhile (a crash before it costs a resend, which the broker answers
DUPLICATE).

A message that an earlier run may have sent (due before this sender started, with no
dispatch_log entry: its entry may have been lost with the unflushed tail, or its batch
was in flight at the crash) is in doubt wherever it is (``watch_earlier``). It is sent
as usual and never withdrawn.

Where a resend goes (docs/cluster.md, "A resend after a failover"): a broker drops
only the ids it holds itself, so a message sent again after a crash or a failover must
reach the group its first send went to, whatever the broker groups are by then. Before
a bucket's first send its **route set** (the groups taking deliveries, with their
weights) is recorded in its dispatch_log (ROUTE entries), and before a message is sent
anywhere but the set's rendezvous choice (a circuit open, a group added or drained
since) that group is recorded for it (ROUTED): both durable, and in a replicated group
copied by the in-sync followers (``acknowledge``), before the send. The common send —
to the set's first choice, in a bucket already recorded — records nothing and waits
for nothing. A message an earlier run may have sent waits for the group its bucket's
records route it to as for an unanswered send (``doubt_hold_ms``).
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from itertools import repeat

import trio

from delayd.logs.dispatch_files import DispatchFiles
from delayd.logs.dispatch_log import EntryKind, RouteSet, check_group_name
from delayd.logs.schedule_reader import ScheduleReader
from delayd.nowait_acquire import holding
from delayd.sender.circuit import CircuitBreaker, CircuitState
from delayd.sender.histogram import Histogram
from delayd.sender.ledger import Item, Ledger, Watcher, Withdrawal
from delayd.sender.retry import RetryPolicy, dead_letter_subject
from delayd.sender.route_sets import RouteSets, route_set_of
from delayd.sender.routing import GroupWeight, Router
from delayd.sender.targets import SendTarget, TargetUnavailable
from delayd.sender.wire import encode_batch
from delayd.wheel.manager import WheelManager
from delayd.wheel.timer import OFFSET_BITS, DueEntries
from delayd.write_refusals import DISPATCH_LOG, WriteRefusals
from storage.errors import DiskFullError

log = logging.getLogger(__name__)

# How long a batch whose route records went unacknowledged holds its slot before it is
# tried again (``Sender._wait_for_routes``).
ROUTES_RETRY_S = 0.1

READ_INLINE_MAX = 64  # entries read on the event loop; more go to a worker thread
# Lateness is whole milliseconds: an on-time delivery is exactly 0, which the 0 bucket
# keeps at 0 in a quantile (with 1 ms as the first bound it would read as 0.5 ms).
LATENESS_BOUNDS_S = (0, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 5, 30, 300)
BATCH_BOUNDS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)
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
    # How long a message whose send went unanswered waits for that group (whose
    # broker may have it) before it may go to another (and perhaps be stored twice).
    doubt_hold_ms: int = 30_000


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


class RoutesNotRecorded(TargetUnavailable):
    """A batch's routes could not be made durable (or acknowledged by the group) before
    its send: nothing was sent."""

    def __init__(self, message: str) -> None:
        super().__init__(message, nothing_stored=True)


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
        self.queue: deque[Item] = deque()
        self.ready = trio.Event()
        self.answered = trio.Event()  # set whenever a batch's outcome is recorded
        self.slots = trio.Semaphore(config.batches_in_flight)
        self.stats = GroupStatistics(self.name, CircuitState.CLOSED, 0)
        # False for a group being drained (docs/cluster.md): no new batch is routed to
        # it, what it was already sent finishes.
        self.accepting = True
        # A drained group that still runs takes the resends of what it may hold (a send
        # it did not answer): sent elsewhere, a message could be stored twice. False
        # once it is retired or gone.
        self.takes_resends = True


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
        self._groups = {target.name: _Group(target, weight, config) for target, weight in groups}
        if len(self._groups) != len(groups):
            raise ValueError("broker group names must be unique")
        self._seed = seed
        self._router = self._new_router()
        self._route_sets = RouteSets()
        self._route_set = self._current_route_set()
        # Buckets whose route set is durable and acknowledged in this run.
        self._routes_acked: set[int] = set()
        self._routing = trio.Lock()  # one batch at a time records routes
        self._denied = [0]  # groups of the route set passed over by routing (a count)
        # Waits until the group acknowledged the dispatch_log buckets (start ms) up to
        # what is durable here; False when this member may no longer lead. None alone.
        self.acknowledge: Callable[[Collection[int]], Awaitable[bool]] | None = None
        self.manager = manager
        self.reader = reader
        self.dispatch = dispatch
        self.dispatch_lock = dispatch_lock
        self.clock = clock
        self.ledger = Ledger(config.retry, config.max_in_flight, random.Random(seed))
        self._due_send, self._due_recv = trio.open_memory_channel[tuple](2)
        self._dispatching = False  # the dispatch loop is between a chunk and its routing
        self._room = trio.Event()
        self._retry_wake = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._recorded = trio.Event()  # dispatch_log entries written since the flush
        self._flushes_started = 0  # flush() group commit: numbered in order of start
        self._flushes_done = 0
        self._flush_running: trio.Event | None = None
        self.started_ms: int | None = None  # this run sent nothing due at or after it
        self.routes_unacknowledged = 0  # batches put back for it (``_wait_for_routes``)
        self.lateness_s = Histogram(LATENESS_BOUNDS_S)
        self.batch_sizes = Histogram(BATCH_BOUNDS)
        self.refusals = WriteRefusals()  # the server shares its own

    def _new_router(self) -> Router:
        weights = [GroupWeight(g.name, g.weight) for g in self._groups.values()]
        return Router(weights, seed=self._seed)

    def _current_route_set(self) -> RouteSet:
        """The groups taking new deliveries now, interned."""
        groups = route_set_of((g.name, g.weight) for g in self._groups.values() if g.accepting)
        return self._route_sets.intern(groups)

    # ------------------------------------------------------------------ groups

    @property
    def group_names(self) -> list[str]:
        return list(self._groups)

    def add_group(self, target: SendTarget, weight: int = 1) -> None:
        """Deliver to ``target`` too, from now on (a broker group found while running;
        delayd.sender.discovery). Its share of the keys moves to it, as rendezvous
        hashing moves them: only those. Raises ValueError for a name already used."""
        if target.name in self._groups:
            raise ValueError(f"broker group {target.name!r} is already a target")
        group = self._groups[target.name] = _Group(target, weight, self.config)
        self._router = self._new_router()
        self._route_set = self._current_route_set()
        if self._nursery is not None:
            self._nursery.start_soon(self._group_loop, group)
        if self.ledger.parked:
            self._retry_wake.set()  # what waited for a usable group may go there now

    def set_accepting(
        self, name: str, accepting: bool, *, takes_resends: bool | None = None
    ) -> None:
        """Route new batches to group ``name`` (True) or no longer (False: it is being
        drained or was removed). Batches it was already sent finish, and their outcome
        counts as usual; what is queued for it and not yet sent is routed elsewhere,
        except, while it ``takes_resends`` (default: ``accepting``; a drained group that
        still runs), the messages it may hold already (doubt_hold_ms)."""
        group = self._groups[name]
        group.takes_resends = accepting if takes_resends is None else takes_resends
        if group.accepting == accepting:
            return
        group.accepting = accepting
        self._route_set = self._current_route_set()
        log.info("broker group %s: %s", name, "takes deliveries" if accepting else "drained")
        if accepting:
            if self.ledger.parked:
                self._retry_wake.set()
            return
        if group.queue:
            moved = list(group.queue)
            group.queue.clear()
            self._route(moved, None)

    # ------------------------------------------------------------------ input

    async def on_due(self, entries: DueEntries, now_ms: int) -> None:
        """The ticker's callback: queue due entries in chunks of ``max_batch``; waits
        while the sender is full (back-pressure on the ticker).

        A few entries, while the dispatch loop is idle and the sender has room, are
        read and routed here and then, and their send batches started: the common case
        of a steady trickle of due messages then costs no hop through the dispatch and
        group loops (each a scheduling step of the whole event loop)."""
        # Held from here, before any await: nothing can be released and not held.
        self.ledger.release(entries.ref)
        if (
            len(entries) <= READ_INLINE_MAX
            and not self._dispatching
            and self.ledger.has_room
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
            while not self.ledger.has_room:
                self._room = trio.Event()
                await self._room.wait()
            self._take(await self._read(refs))
            self._dispatching = False

    def _take(self, items: list[Item]) -> None:
        """Hold the items read for released entries (except those withdrawn meanwhile)
        and route them."""
        items = self.ledger.take(items)
        started_ms = self.started_ms
        if started_ms is not None:
            for item in items:
                if item.due_ms < started_ms:
                    self._resend_where_recorded(item)
        self._route(items, None)

    def _resend_where_recorded(self, item: Item) -> None:
        """An earlier run may have sent ``item``: if its bucket's dispatch_log says
        where (a route set an earlier run recorded), it waits for that group as for an
        unanswered send (doubt_hold_ms), and goes elsewhere only after a ROUTED entry."""
        routes = self.dispatch.known_routes(item.bucket_ms)  # read when its load began
        if routes is None or not routes.earlier or item.doubt_group is not None:
            return
        route = routes.deviations.get(item.offset)
        if route is None:
            route = self._route_sets.first_choice(routes.route_set, _route_key(item))
        item.route = route
        if route is not None:
            item.doubt_group, item.doubt_since_ms = route, self.clock()

    async def _read(self, refs) -> list[Item]:
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

    def _read_plan(self, plan: list[tuple[int, int, list[int]]]) -> list[Item]:
        items = []
        for bucket_id, bucket_ms, offsets in plan:
            payloads = self.reader.read_payloads(bucket_ms, offsets)
            items += map(Item, repeat(bucket_id), repeat(bucket_ms), offsets, payloads)
        return items

    def _usable_now(self) -> Callable[[str], bool]:
        """``usable(name)`` for the routing of one batch: each breaker's state is read
        once (it changes only when the loop runs other tasks), the queue's length every
        time (it grows as the batch is routed)."""
        now_ms = self.clock()
        limit = self.config.group_queue_limit
        queues, resend_queues = {}, {}
        route_set_names = {name for name, _ in self._route_set}
        denied = self._denied
        for name, group in self._groups.items():
            if not group.takes_resends:
                continue
            breaker = group.breaker
            state = breaker.state(now_ms)
            if not (
                state is CircuitState.OPEN
                or (state is CircuitState.HALF_OPEN and breaker.probe_in_flight)
            ):
                resend_queues[name] = group.queue
                if group.accepting:
                    queues[name] = group.queue

        def usable(name: str, *, resend: bool = False) -> bool:
            """Whether group ``name`` takes a batch now: a new one (``accepting``), or
            with ``resend`` the resend of messages it may hold (``takes_resends``)."""
            queue = (resend_queues if resend else queues).get(name)
            if queue is not None and len(queue) < limit:
                return True
            if not resend and name in route_set_names:
                denied[0] += 1  # a group of the route set passed over: not its first choice
            return False

        return usable

    def _route(self, items: list[Item], failed_group: str | None, *, wake: bool = True) -> None:
        """Queue each item on a usable group (not ``failed_group`` when another one is
        usable); items with none wait in the parked list, looked at again by the retry
        loop every ledger.PARKED_RETRY_S (``wake``: tell it there are some)."""
        choose, usable = self._router.choose, self._usable_now()
        now_ms = self.clock()
        exclude = () if failed_group is None else (failed_group,)
        route_set, denied = self._route_set, self._denied
        touched = set()
        for item in items:
            if item.withdrawn:
                continue  # cancelled while it waited for a retry or a usable group
            # A keyless message is routed by its id rather than at random, so that when
            # it is sent again after a restart (sent, but not yet in dispatch_log) it goes
            # to the same group, whose broker drops it as a duplicate: dedupe is per
            # broker, and another group would store it a second time.
            held = None if item.doubt_group is None else self._held_by(item, now_ms)
            if held is not None:
                # A broker of that group may have stored it, and dedupe is per group:
                # sent elsewhere, it could be stored (and consumed) twice. It waits for
                # the group instead (a new leader, its circuit closing), up to
                # doubt_hold_ms — a drained group too, while it runs; a group retired
                # or removed lets it go at once.
                if usable(held.name, resend=True):
                    held.queue.append(item)
                    touched.add(held)
                else:
                    self.ledger.park(item)
                continue
            route_key = item.message_id if item.key is None else item.key
            passed_over = denied[0]
            name = choose(route_key, usable, exclude)
            if name is None and exclude:
                name = choose(route_key, usable)
            if name is None:
                self.ledger.park(item)
                continue
            # Every group of the set was there to choose: the set's first choice.
            item.planned = route_set if not exclude and denied[0] == passed_over else None
            group = self._groups[name]
            group.queue.append(item)
            touched.add(group)
        for group in touched:
            self._start_ready_batches(group)
            if group.queue:  # what is left waits for its loop
                group.ready.set()
        if self.ledger.parked and wake:
            self._retry_wake.set()

    def _held_by(self, item: Item, now_ms: int) -> _Group | None:
        """The group an unanswered send of ``item`` went to, while it holds the item:
        it takes deliveries and doubt_hold_ms has not passed since."""
        if item.doubt_group is None:
            return None
        group = self._groups.get(item.doubt_group)
        if (
            group is None
            or not group.takes_resends
            or now_ms - item.doubt_since_ms >= self.config.doubt_hold_ms
        ):
            return None
        return group

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

    async def _send(self, group: _Group, batch: list[Item]) -> None:
        now_ms = self.clock()
        ok, charged = False, True
        failure = "the send was cancelled or failed"
        try:
            if self._routes_unrecorded(group, batch):
                await self._record_routes(group, batch)
            if group.send_encoded is not None:
                results = await group.send_encoded(encode_batch(batch, now_ms))
            else:
                messages = [item.message(now_ms) for item in batch]
                results = await group.target.send_batch(messages)
            ok = True
        except RoutesNotRecorded as exc:
            charged = False
            await self._wait_for_routes(group, batch, str(exc))
            return
        except TargetUnavailable as exc:
            failure = str(exc)
            group.stats.failed += len(batch)
            # A broker of the group may have stored them, unless the target knows not.
            self.ledger.unanswered(batch, None if exc.nothing_stored else group.name, now_ms)
            # While the group holds them (doubt_hold_ms) they wait for it: its being
            # away is not the messages' fault, and must not dead-letter them.
            held = not exc.nothing_stored and group.takes_resends and self.config.doubt_hold_ms > 0
            self._retry(batch, group, failure, count_attempt=not held)
            return
        finally:
            if charged:
                self._record_outcome(group, ok, failure)
            else:
                group.answered.set()
            group.slots.release()
        self.batch_sizes.observe_many((len(batch),))
        outcomes = self.ledger.sort_answers(batch, results)
        if outcomes.acked:
            await self._record(group, outcomes.acked, now_ms)
        if outcomes.withdrawn:
            await self._withdraw_refused(outcomes.withdrawn)
        if outcomes.refused:
            group.stats.failed += len(outcomes.refused)
            self._retry(outcomes.refused, group, outcomes.refused[0].reason)
        if outcomes.disk_full:
            full = outcomes.disk_full
            group.stats.failed += len(full)
            self._retry(full, group, full[0].reason, count_attempt=False)

    async def _wait_for_routes(self, group: _Group, batch: list[Item], why: str) -> None:
        """Route records of ``batch`` went unacknowledged: this member may no longer
        lead (a demotion then stops this delivery; a promotion builds a new one from
        the logs). Not the broker group's fault — its circuit is not charged — nor a
        reason to route the batch elsewhere: a ROUTED entry written now, durable here,
        would send the message's resend after a later promotion away from a group that
        may hold it. The batch goes back to the head of its group's queue, and this
        batch's slot is held for ROUTES_RETRY_S before it is tried again."""
        for item in batch:
            item.sending = False
        group.queue.extendleft(reversed(batch))
        if not self.routes_unacknowledged:
            log.warning("%s: sends wait until route records are acknowledged", why)
        self.routes_unacknowledged += 1
        await trio.sleep(ROUTES_RETRY_S)

    def _routes_unrecorded(self, group: _Group, batch: list[Item]) -> bool:
        """Whether a resend of some message of ``batch`` after a crash would not go to
        ``group`` by what dispatch_log says now (its bucket's route set is not recorded
        and acknowledged yet, or routes it elsewhere): then ``_record_routes`` first.
        The common batch — first choices under the current set, in buckets recorded
        under it — is answered by an identity test per message."""
        name, acked, routes_of = group.name, self._routes_acked, self.dispatch.known_routes
        bucket_ms, routes = None, None
        for item in batch:
            if item.bucket_ms != bucket_ms:
                bucket_ms = item.bucket_ms
                routes = routes_of(bucket_ms) if bucket_ms in acked else None
                if routes is None:
                    return True
            if item.route is not None:
                if item.route != name:
                    return True
            elif item.planned is not routes.route_set or item.offset in routes.deviations:
                return True
        return False

    async def _record_routes(self, group: _Group, batch: list[Item]) -> None:
        """Make dispatch_log route every message of ``batch`` to ``group``: the route
        set of each bucket that has none (the current one), and a ROUTED entry for each
        message that it routes elsewhere; flushed and, in a replicated group,
        acknowledged before the send. A full disk does not stop the send (nor does it
        stop the entries' writer: docs/operations.md, "A full disk"): the batch goes
        without the records that did not fit. Raises RoutesNotRecorded when this member
        may no longer lead (nothing is sent)."""
        async with self._routing:
            async with holding(self.dispatch_lock):
                try:
                    buckets = self._write_routes(group, batch, self.clock())
                except DiskFullError as exc:
                    self.refusals.refuse(DISPATCH_LOG, exc)
                    return
            if not buckets:
                return
            await self.flush()
            if self.acknowledge is not None and not await self.acknowledge(buckets):
                raise RoutesNotRecorded(
                    f"broker group {group.name}: the group did not acknowledge the routes "
                    "of a batch (this member may no longer lead)"
                )
            self._routes_acked.update(buckets)

    def _write_routes(self, group: _Group, batch: list[Item], now_ms: int) -> set[int]:
        """Append what ``_record_routes`` needs; the buckets to flush and have
        acknowledged. ``item.route`` follows what is written. Call with the dispatch
        lock held; raises DiskFullError (what was written stays, and counts)."""
        name, dispatch, route_sets = group.name, self.dispatch, self._route_sets
        buckets: set[int] = set()
        elsewhere: dict[int, list[Item]] = {}
        for item in batch:
            bucket_ms = item.bucket_ms
            routes = dispatch.routes(bucket_ms)
            if routes.route_set is None:
                dispatch.record_route_set(bucket_ms, self._route_set, now_ms)
            routes.route_set = route_set = route_sets.intern(routes.route_set)
            if bucket_ms not in self._routes_acked:
                buckets.add(bucket_ms)
            route = item.route or routes.deviations.get(item.offset)
            if route is None:
                route = (
                    name
                    if item.planned is route_set
                    else route_sets.first_choice(route_set, _route_key(item))
                )
            item.route = route
            if route != name:
                elsewhere.setdefault(bucket_ms, []).append(item)
        for bucket_ms, items in elsewhere.items():
            offsets = [item.offset for item in items]
            dispatch.record(bucket_ms, EntryKind.ROUTED, offsets, now_ms, group.raw_name)
            for item in items:
                item.route = name
            buckets.add(bucket_ms)
        return buckets

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

    async def _record(self, group: _Group, items: list[Item], at_ms: int) -> None:
        by_bucket: dict[tuple[int, int, EntryKind], list[int]] = {}
        dead = 0
        for item in items:
            dead += item.dead
            key = (item.bucket_ms, item.bucket_id, item.entry_kind)
            by_bucket.setdefault(key, []).append(item.offset)
        unwritten = [
            (bucket_ms, kind, offsets) for (bucket_ms, _, kind), offsets in by_bucket.items()
        ]
        wait_s = DISK_FULL_RETRY_S[0]
        while True:
            async with holding(self.dispatch_lock):
                if self._write_entries(unwritten, at_ms, group.raw_name):
                    # Under the lock with the last entries: a canceller that holds it
                    # sees a held message or its entry (or both), never neither.
                    self.ledger.settle(items, at_ms)
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
        if self.ledger.has_room:
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

    async def _withdraw_refused(self, items: list[Item]) -> None:
        """Record as CANCELLED watched items a broker refused (see the module
        docstring), instead of retrying them."""
        now_ms = self.clock()
        unwritten = [(item.bucket_ms, EntryKind.CANCELLED, [item.offset]) for item in items]
        wait_s = DISK_FULL_RETRY_S[0]
        while True:
            async with holding(self.dispatch_lock):
                if self._write_entries(unwritten, now_ms, b""):
                    self.ledger.withdraw_refused(items, now_ms)
                    break
            await trio.sleep(wait_s)  # the disk is full: held until the entries fit
            wait_s = min(2 * wait_s, DISK_FULL_RETRY_S[1])
        self._recorded.set()
        for item in items:
            self.manager.on_recorded(item.bucket_id, 1)
        self._room.set()

    # ------------------------------------------------------------------ cancel

    def withdraw(self, ref: int) -> Withdrawal:
        """Take the message of wheel ``ref`` back, if it is held and no broker may have
        it (Ledger.withdraw). Synchronous; call with the dispatch lock held. WITHDRAWN:
        the caller writes its entry and calls ``manager.on_recorded``; it is never
        sent."""
        withdrawal = self.ledger.withdraw(ref)
        if withdrawal is Withdrawal.WITHDRAWN:
            self._room.set()
        return withdrawal

    def watch(self, ref: int, watcher: Watcher, *, withdraw_on_refusal: bool) -> None:
        """Call ``watcher`` with the fate of the held, IN_DOUBT message of ``ref``."""
        self.ledger.watch(ref, watcher, withdraw_on_refusal=withdraw_on_refusal)

    def holds(self, ref: int) -> bool:
        """Whether the message of wheel ``ref`` is between the wheel and dispatch_log."""
        return self.ledger.holds(ref)

    def watch_earlier(self, bucket_ms: int, offset: int, ref: int | None, watcher: Watcher) -> None:
        """Call ``watcher`` with the fate of the message at (bucket, offset), which an
        earlier run may have sent (Ledger.watch_earlier). Synchronous; call with the
        dispatch lock held."""
        self.ledger.watch_earlier(bucket_ms, offset, ref, watcher)

    def _retry(
        self, items: list[Item], group: _Group, reason: str, *, count_attempt: bool = True
    ) -> None:
        """Put the items back for another group after the back-off (Ledger.retry) and
        wake the retry loop."""
        group.stats.retried += len(items)
        dead = self.ledger.retry(
            items, group.name, reason, self.clock(), count_attempt=count_attempt
        )
        for item in dead:
            log.warning(
                "message %s: %d attempts failed (%s); sending it to %s",
                item.message_id,
                item.attempts,
                item.reason,
                dead_letter_subject(item.subject),
            )
        self._retry_wake.set()

    async def _retry_loop(self) -> None:
        ledger = self.ledger
        while True:
            self._retry_wake = trio.Event()
            now_ms = self.clock()
            for items, failed_group in ledger.due_retries(now_ms):
                self._route(items, failed_group, wake=False)
            if ledger.parked:
                self._route(ledger.unpark(), None, wake=False)
            with trio.move_on_after(ledger.wait_s(now_ms)):
                await self._retry_wake.wait()

    def entries_written(self) -> None:
        """Entries the sender did not write went into dispatch_log (the wheel's
        COMPLETE marks): the next flush makes them durable, as the sender's own."""
        self._recorded.set()

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
                        if self.dispatch.on_durable is not None:
                            self.dispatch.on_durable()
                self._flushes_done = number
            finally:
                self._flush_running = None
                running.set()

    # ------------------------------------------------------------------ metrics

    @property
    def route_set(self) -> RouteSet:
        """The broker groups (name, weight) that new deliveries are routed over now."""
        return self._route_set

    @property
    def in_flight(self) -> int:
        return self.ledger.in_flight

    @property
    def parked(self) -> int:
        return self.ledger.parked

    @property
    def withdrawn_total(self) -> int:
        return self.ledger.withdrawn_total

    def group_statistics(self) -> list[GroupStatistics]:
        now_ms = self.clock()
        out = []
        for group in self._groups.values():
            group.stats.circuit = group.breaker.state(now_ms)
            group.stats.queued = len(group.queue)
            out.append(group.stats)
        return out


def _route_key(item: Item) -> str:
    """What ``item`` is routed by: its key, or its id when it has none (so that a
    resend goes where the first send went)."""
    return item.message_id if item.key is None else item.key
