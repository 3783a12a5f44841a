"""Canceller: resolves cancel and reschedule tombstones as the replayer meets them.

    CANCEL ─▶ message_log (tombstone, acked by the flush policy) ─▶ replayer, in log order
          ─▶ id index ─▶ the current schedule_log record of the id ─▶ where is it?
             wheel / being loaded / not loaded / sender (not in doubt)  → withdrawn now
             in a send batch, or a broker may have it                   → watch the outcome
             dispatch_log says DISPATCHED / DEAD_LETTERED / CANCELLED   → that is the answer

The decision is taken synchronously with the append lock (no loader step begins a
bucket) and the dispatch lock (the sender records nothing) held, so the message is in
exactly one of those places and no await can move it meanwhile. docs/cancel.md has the
argument, the formats and what recovery does.

The *current* record of an id is the one with the highest message_log offset that is
not a void copy: the original, or the copy the latest successful reschedule appended
(stamped with its tombstone's offset). Older ones were moved away (RESCHEDULED
entries). A reschedule (type 5) appends its copy whatever it decides, as every
follower's replay does (delayd.logs.moves); a copy it does not move the message to is
recorded NOT_MOVED, never delivered.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

import trio

from delayd.logs import message_log, moves, tombstone
from delayd.logs.dispatch_files import DispatchFiles
from delayd.logs.dispatch_log import DispatchEntry, EntryKind, find_entry
from delayd.logs.id_index import Location
from delayd.nowait_acquire import holding
from delayd.protocol.codes import CancelOutcome, RescheduleOutcome
from delayd.replay.replayer import Replayer, TombstoneRecord
from delayd.sender.sender import Sender, Withdrawal
from delayd.wheel.manager import WheelManager, Whereabouts
from delayd.wheel.timer import pack_ref

log = logging.getLogger(__name__)

DELIVERED = (EntryKind.DISPATCHED, EntryKind.DEAD_LETTERED)
TAKE_OVER_STEP = 1000  # tombstones decided again between two yields to other tasks


class Waiter:
    """The answers one request waits for (a CANCEL's one, a CANCEL_BATCH's many):
    ``done`` is set when the last of them is decided."""

    __slots__ = ("done", "left")

    def __init__(self, count: int) -> None:
        self.left = count
        self.done = trio.Event()

    def decided_one(self) -> None:
        self.left -= 1
        if not self.left:
            self.done.set()


@dataclass(slots=True)
class Answer:
    """The outcome of one tombstone, for the connection that is waiting for it
    (``waiter`` None: a tombstone replayed after a restart, which nobody waits for)."""

    is_cancel: bool
    waiter: Waiter | None = None
    outcome: CancelOutcome | RescheduleOutcome | None = None
    dispatched_ms: int | None = None
    # The buckets whose dispatch_log entries decide it: the record it acted on, and the
    # copy a reschedule appended. In a group the answer waits until the group has them.
    buckets: set[int] = field(default_factory=set)

    @property
    def decided(self) -> bool:
        return self.outcome is not None


class Canceller:
    """See the module docstring. ``on_tombstones`` is the replayer's hook; ``expect``
    registers a connection's wait for the tombstone at a message_log offset."""

    def __init__(
        self,
        manager: WheelManager,
        sender: Sender,
        dispatch: DispatchFiles,
        dispatch_lock: trio.Lock,
        *,
        clock: Callable[[], int],
        earlier_end: int,
    ) -> None:
        self.manager = manager
        self.sender = sender
        self.dispatch = dispatch
        self.dispatch_lock = dispatch_lock
        self.clock = clock
        # message_log's end when this process started: records below it were there
        # for an earlier run, which may have sent them (_earlier_may_have_sent).
        self.earlier_end = earlier_end
        self._waiting: dict[int, Answer] = {}  # tombstone's message_log offset -> answer
        # Entries decided in this on_tombstones call, written together: (bucket, kind,
        # at_ms) -> offsets. One append per bucket instead of one per tombstone.
        self._unwritten: dict[tuple[int, EntryKind, int], list[int]] = {}
        self.cancels: Counter[CancelOutcome] = Counter()
        self.reschedules: Counter[RescheduleOutcome] = Counter()

    def expect(self, offset: int, *, is_cancel: bool) -> Answer:
        """The Answer the tombstone appended at message_log ``offset`` will get."""
        return self.expect_many([offset], is_cancel=is_cancel)[0]

    def expect_many(self, offsets: list[int], *, is_cancel: bool) -> list[Answer]:
        """The Answers of the tombstones at ``offsets``, awaited together."""
        waiter = Waiter(len(offsets))
        answers = [Answer(is_cancel, waiter) for _ in offsets]
        self._waiting.update(zip(offsets, answers, strict=True))
        return answers

    async def wait(self, answer: Answer) -> Answer:
        """``wait_all`` for one answer."""
        await self.wait_all([answer])
        return answer

    async def wait_all(self, answers: list[Answer]) -> None:
        """Wait until every one of ``answers`` is decided, then for dispatch_log to be
        durable: the entry that decided each (written or read) survives any crash, so
        a restart that replays the tombstone again finds the same answer. Without its
        entry a restart could not tell a message this tombstone cancelled from one an
        earlier run sent (docs/cancel.md, "Durability and recovery"). One fsync for
        the lot (and for every other request waiting at that moment)."""
        waiters = {id(a.waiter): a.waiter for a in answers if a.waiter is not None}
        for waiter in waiters.values():
            await waiter.done.wait()
        await self.sender.flush()

    def stats(self) -> dict[str, str | int | float]:
        """STATS values: cancels and reschedules by outcome (units in the names)."""
        out: dict[str, str | int | float] = {}
        for cancel in CancelOutcome:
            out[f"cancel.total/{cancel.name.lower()}"] = self.cancels[cancel]
        for reschedule in RescheduleOutcome:
            out[f"reschedule.total/{reschedule.name.lower()}"] = self.reschedules[reschedule]
        return out

    def refuse_reschedule(self) -> None:
        """Count a reschedule refused at intake (past max_delay)."""
        self.reschedules[RescheduleOutcome.DELAY_TOO_LONG] += 1

    # ------------------------------------------------------------------ the hook

    async def on_tombstones(self, replayer: Replayer, records: list[TombstoneRecord]) -> None:
        """The replayer's hook: resolve ``records`` in order (append lock held)."""
        async with holding(self.dispatch_lock):
            try:
                for offset, rtype, payload in records:
                    self._resolve(replayer, offset, tombstone.decode(rtype, payload))
            finally:
                with trio.CancelScope(shield=True):  # decided entries are written
                    await self._write_entries_off_loop()

    async def before_checkpoint(self) -> None:
        """The replayer's: entries tombstones wrote are durable before it checkpoints."""
        await self.sender.flush()

    async def take_over(self, replayer: Replayer) -> int:
        """Decide again, before delivery starts, every tombstone a follower's replay
        passed without deciding (``Replayer.derive_tombstones``); returns how many.

        The old leader's decisions reach a follower with its dispatch_log, as far as
        replication brought them. Deciding again is what a restart does with the
        tombstones past its checkpoint, and gives the same answer where the entry is
        there (a record moved by RESCHEDULED is moved again, a delivered or cancelled
        one stays so); where it is missing, the new leader decides now. Every record
        the old leader held may have been sent by it: ``earlier_end`` moves to the log's
        end, so a due one without an entry is in doubt (docs/cancel.md, case 0). A copy
        is never appended here (replay did that): one that does not hold the message
        is voided (NOT_MOVED) where it lies. Type 4 reschedules were decided by the
        servers that wrote them; they are left as replay copied them.

        Only the tombstones are read, at the offsets the replayer's index holds
        (``Replayer.tombstones``: noted by replay, found below its start by one scan
        at start, which this waits for if it has not finished). They are read in a
        worker thread, most of them before the locks are taken (the replayer goes on
        meanwhile), the rest — what replay passed since — under them; the decisions
        yield to other tasks every TAKE_OVER_STEP tombstones. A promotion takes time
        in proportion to the tombstones of message_log, and never stalls the event
        loop."""
        await replayer.scan_tombstones()
        self.earlier_end = replayer.log.end_offset
        start, read_up_to = replayer.log.min_offset, replayer.position
        earlier = await trio.to_thread.run_sync(replayer.tombstones_between, start, read_up_to)
        decided = 0
        async with holding(replayer.append_lock), holding(self.dispatch_lock):
            try:
                later = await trio.to_thread.run_sync(
                    replayer.tombstones_between, read_up_to, replayer.position
                )
                for offset, rtype, payload in chain(earlier, later):
                    stone = tombstone.decode(rtype, payload)
                    if stone.is_cancel or stone.always_copies:
                        self._decide_again(replayer, offset, stone)
                        decided += 1
                        if decided % TAKE_OVER_STEP == 0:
                            await trio.sleep(0)
            finally:
                with trio.CancelScope(shield=True):
                    await self._write_entries_off_loop()
        await self.sender.flush()
        return decided

    def _decide_again(self, replayer: Replayer, offset: int, stone: tombstone.Tombstone) -> None:
        """``_resolve`` for a tombstone whose copy replay already appended."""
        assert replayer.index is not None
        found = replayer.index.lookup(stone.message_id)
        current = self._current([at for at in found if at.message_log_offset < offset])
        if current is None:
            fate = None
        else:
            fate = self._withdraw(current, Answer(stone.is_cancel), is_cancel=stone.is_cancel)
        copy = next((at for at in found if at.message_log_offset == offset), None)
        if copy is not None and fate is not EntryKind.RESCHEDULED:
            self._void(copy.bucket_ms, copy.offset, copy.due_ms)

    def _resolve(self, replayer: Replayer, offset: int, stone: tombstone.Tombstone) -> None:
        index = replayer.index
        if index is None:
            raise RuntimeError("cancel and reschedule need the id index")
        answer = self._waiting.pop(offset, None) or Answer(stone.is_cancel)
        locations = index.lookup(stone.message_id)
        current = self._current(locations)
        # The copy every member's replay appends for this tombstone (type 5), moved to
        # or not: appended in this synchronous block, so "both" and "neither" stay
        # impossible, at the place a follower's replay puts it.
        copy = None
        if stone.due_ms is not None and stone.always_copies:
            copy = moves.moved_copy(locations, stone.due_ms)
        fate = None
        if current is not None:
            answer.buckets.add(current.bucket_ms)
            fate = self._withdraw(current, answer, is_cancel=stone.is_cancel)
        moved = fate is EntryKind.RESCHEDULED
        if moved and copy is None:  # type 4: the copy is appended only when it moves
            assert stone.due_ms is not None and current is not None
            copy = moves.moved_copy([current], stone.due_ms)
        if copy is not None:
            bucket_ms, copy_offset = replayer.append_copy(offset, copy)
            answer.buckets.add(bucket_ms)
            if not moved:
                self._void(bucket_ms, copy_offset, message_log.due_ms_of(copy))
        if current is None:
            self._answer(answer, None)
        elif moved:
            self._answer(answer, EntryKind.RESCHEDULED)
        elif fate is not None:  # None: in doubt, the sender's watcher answers
            kind, at_ms = fate
            self._answer(answer, kind, at_ms)

    def _current(self, locations: list[Location]) -> Location | None:
        """The record that holds the message now (delayd.logs.moves.current)."""
        return moves.current(locations, lambda at: self._entry(at.bucket_ms, at.offset))

    def _void(self, bucket_ms: int, offset: int, due_ms: int) -> None:
        """Record the copy just appended at (bucket, offset) NOT_MOVED and take it out
        of the loading path the append offered it to (the wheel, a loading bucket's
        skip set): it must never be sent. Nothing can have sent it (appended under the
        locks this decision holds)."""
        where = self.manager.withdraw(bucket_ms, offset, due_ms)
        if where not in (Whereabouts.REMOVED, Whereabouts.SKIPPED, Whereabouts.NOT_LOADED):
            log.error("reschedule: the void copy %s@%d is %s", bucket_ms, offset, where.value)
        bucket_id = self.manager.bucket_id(bucket_ms) if where is Whereabouts.REMOVED else None
        self._record(bucket_ms, offset, EntryKind.NOT_MOVED, self.clock(), bucket_id)

    def _withdraw(
        self, at: Location, answer: Answer, *, is_cancel: bool
    ) -> EntryKind | tuple[EntryKind, int] | None:
        """Withdraw the record at ``at`` if it is still pending and write its entry.

        Returns EntryKind.RESCHEDULED when a reschedule may now append the moved copy,
        (kind, at_ms) for a decided answer, None when the sender's watcher answers.
        """
        now_ms = self.clock()
        kind = EntryKind.CANCELLED if is_cancel else EntryKind.RESCHEDULED
        withdrawn = kind if kind is EntryKind.RESCHEDULED else (kind, now_ms)
        bucket_ms, offset = at.bucket_ms, at.offset
        bucket_id = self.manager.bucket_id(bucket_ms)
        ref = None if bucket_id is None else pack_ref(bucket_id, offset)
        if self._earlier_may_have_sent(at, now_ms):
            if ref is None or not self.sender.holds(ref):  # held: no entry yet
                entry = self._entry(bucket_ms, offset)
                if entry is not None and entry.kind is not EntryKind.RESCHEDULED:
                    return entry.kind, entry.at_ms  # delivered or cancelled: decided
                if entry is not None:
                    # Moved by an earlier replay of this very tombstone: withdrawn
                    # then, never sent, skipped by the loader. Still to be moved.
                    self._record(bucket_ms, offset, kind, now_ms, None)
                    return withdrawn
            # No entry: in doubt from an earlier run. It is due, so it is sent soon;
            # the answer is that send's outcome, never a withdrawal.
            self.sender.watch_earlier(bucket_ms, offset, ref, self._watcher(answer))
            return None
        if ref is not None:
            withdrawal = self.sender.withdraw(ref)
            if withdrawal is Withdrawal.WITHDRAWN:
                self._record(bucket_ms, offset, kind, now_ms, bucket_id)
                return withdrawn
            if withdrawal is Withdrawal.IN_DOUBT:
                self.sender.watch(ref, self._watcher(answer), withdraw_on_refusal=is_cancel)
                return None
        where = self.manager.withdraw(bucket_ms, offset, at.due_ms)
        if where is Whereabouts.REMOVED:
            self._record(bucket_ms, offset, kind, now_ms, bucket_id)
        elif where is Whereabouts.SKIPPED or (
            is_cancel and where is Whereabouts.NOT_LOADED and bucket_ms > now_ms
        ):
            # Nothing of a bucket that starts in the future can have been sent (never
            # early), so a cancel need not read its dispatch_log: the hot path. If it
            # was cancelled already the answer is the same (a second entry is
            # harmless: the first one of an offset counts). A reschedule reads it: a
            # cancelled message must not come back.
            self._record(bucket_ms, offset, kind, now_ms, None)
        else:
            entry = self._entry(bucket_ms, offset)
            if entry is not None and entry.kind is not EntryKind.RESCHEDULED:
                return entry.kind, entry.at_ms  # delivered or cancelled: decided
            if where in (Whereabouts.TAKEN, Whereabouts.RECORDED) and entry is None:
                # Fired, not held, no entry: cannot happen (the sender holds a message
                # from the wheel until its entry; the loader skips only listed ones).
                # Recorded, so no restart sends it.
                log.error("cancel: %s@%d is nowhere; recording it", bucket_ms, offset)
            # No entry (not loaded since the last start), or RESCHEDULED by this very
            # tombstone before a crash (replay repeats it): still pending.
            self._record(bucket_ms, offset, kind, now_ms, None)
        return withdrawn

    def _earlier_may_have_sent(self, at: Location, now_ms: int) -> bool:
        """Whether a run before this one may have sent the record at ``at``: it was in
        message_log when this process started (a reschedule's copy counts from its
        tombstone) and it fell due before this process could send anything (before
        the sender started; before now while it has not — the earlier run ended
        before now, and nothing is sent early). Its dispatch_log entry may then have
        been lost with the unflushed tail, or the crash came while its batch was at a
        broker (docs/cancel.md)."""
        if at.message_log_offset >= self.earlier_end:
            return False
        started_ms = self.sender.started_ms
        return at.due_ms < (now_ms if started_ms is None else started_ms)

    def _entry(self, bucket_ms: int, offset: int) -> DispatchEntry | None:
        """The first dispatch_log entry of (bucket, offset): its fate, if it has one."""
        self._write_entries()  # an earlier tombstone of this step may have decided it
        files = self.dispatch.files  # reads see unflushed entries: they are pwritten
        return find_entry(files.fs, files.path(bucket_ms), offset)

    def _record(
        self, bucket_ms: int, offset: int, kind: EntryKind, at_ms: int, bucket_id: int | None
    ) -> None:
        offsets = self._unwritten.get((bucket_ms, kind, at_ms))
        if offsets is None:
            self._unwritten[(bucket_ms, kind, at_ms)] = [offset]
        else:
            offsets.append(offset)
        if bucket_id is not None:
            self.manager.on_recorded(bucket_id, 1)

    async def _write_entries_off_loop(self) -> None:
        """``_write_entries``, in a worker thread when it must open a file (create one:
        a directory fsync; first read of one: a scan of it): cancels of messages due
        over hours touch a file per bucket, which must not stall the event loop."""
        files = self.dispatch.files
        if all(files.is_open(bucket_ms) for bucket_ms, _, _ in self._unwritten):
            self._write_entries()
        else:
            await trio.to_thread.run_sync(self._write_entries)

    def _write_entries(self) -> None:
        """Append the entries ``_record`` collected (dispatch lock held)."""
        if self._unwritten:
            unwritten, self._unwritten = self._unwritten, {}
            for (bucket_ms, kind, at_ms), offsets in unwritten.items():
                self.dispatch.record(bucket_ms, kind, offsets, at_ms, b"")

    def _watcher(self, answer: Answer) -> Callable[[EntryKind, int], None]:
        def watcher(kind: EntryKind, at_ms: int) -> None:
            self._answer(answer, kind, at_ms)

        return watcher

    def _answer(self, answer: Answer, kind: EntryKind | None, at_ms: int | None = None) -> None:
        """Fill ``answer`` from the fate of the message (None: no such id)."""
        if kind is EntryKind.NOT_MOVED:
            kind = None  # a lone void copy: its original went with retention
        if answer.is_cancel:
            if kind is None:
                outcome = CancelOutcome.UNKNOWN
            elif kind in DELIVERED:
                outcome = CancelOutcome.ALREADY_DELIVERED
            else:
                outcome = CancelOutcome.CANCELLED
            self.cancels[outcome] += 1
        else:
            if kind is None or kind is EntryKind.CANCELLED:
                r_outcome = RescheduleOutcome.UNKNOWN  # no pending message by that id
            elif kind in DELIVERED:
                r_outcome = RescheduleOutcome.ALREADY_DELIVERED
            else:
                r_outcome = RescheduleOutcome.RESCHEDULED
            self.reschedules[r_outcome] += 1
            outcome = r_outcome
        answer.outcome = outcome
        if kind in DELIVERED:
            answer.dispatched_ms = at_ms
        if answer.waiter is not None:
            answer.waiter.decided_one()
