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

The *current* record of an id is the one with the highest message_log offset: the
original, or the copy the latest reschedule appended (stamped with its tombstone's
offset). Older ones were moved away (RESCHEDULED entries).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from delayd.logs import message_log, schedule_log, tombstone
from delayd.logs.dispatch_files import DispatchFiles
from delayd.logs.dispatch_log import EntryKind, find_entry
from delayd.logs.id_index import IdIndex, Location
from delayd.protocol.codes import CancelOutcome, RescheduleOutcome
from delayd.replay.replayer import Replayer, TombstoneRecord
from delayd.sender.sender import Sender, Withdrawal
from delayd.wheel.manager import WheelManager, Whereabouts
from delayd.wheel.timer import pack_ref

log = logging.getLogger(__name__)

DELIVERED = (EntryKind.DISPATCHED, EntryKind.DEAD_LETTERED)


@dataclass(slots=True)
class Answer:
    """The outcome of one tombstone, for the connection that is waiting for it."""

    is_cancel: bool
    done: trio.Event = field(default_factory=trio.Event)
    outcome: CancelOutcome | RescheduleOutcome | None = None
    dispatched_ms: int | None = None


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
    ) -> None:
        self.manager = manager
        self.sender = sender
        self.dispatch = dispatch
        self.dispatch_lock = dispatch_lock
        self.clock = clock
        self._waiting: dict[int, Answer] = {}  # tombstone's message_log offset -> answer
        self.cancels: Counter[CancelOutcome] = Counter()
        self.reschedules: Counter[RescheduleOutcome] = Counter()

    def expect(self, offset: int, *, is_cancel: bool) -> Answer:
        """The Answer the tombstone appended at message_log ``offset`` will get."""
        answer = self._waiting[offset] = Answer(is_cancel)
        return answer

    async def wait(self, answer: Answer) -> Answer:
        """Wait for ``answer``. ALREADY_DELIVERED waits for dispatch_log to be durable
        too, so that a restart re-replaying the tombstone finds the same answer."""
        await answer.done.wait()
        if answer.dispatched_ms is not None:
            await self.sender.flush()
        return answer

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
        async with self.dispatch_lock:
            for offset, rtype, payload in records:
                self._resolve(replayer, offset, tombstone.decode(rtype, payload))

    async def before_checkpoint(self) -> None:
        """The replayer's: entries tombstones wrote are durable before it checkpoints."""
        await self.sender.flush()

    def _resolve(self, replayer: Replayer, offset: int, stone: tombstone.Tombstone) -> None:
        index = replayer.index
        if index is None:
            raise RuntimeError("cancel and reschedule need the id index")
        answer = self._waiting.pop(offset, None) or Answer(stone.is_cancel)
        current = self._current(index, stone.message_id)
        if current is None:
            self._answer(answer, None)
            return
        fate = self._withdraw(current, answer, is_cancel=stone.is_cancel)
        if fate is None:
            return  # in doubt: the sender's watcher answers
        if fate is EntryKind.RESCHEDULED:
            assert stone.due_ms is not None
            # The same message payload (id, sequence, body...) with the new due_ms,
            # which is its first field; the SCHEDULED prefix is rebuilt by append_copy.
            message = current.payload[schedule_log.PREFIX_SIZE :]
            moved = message_log.DUE_MS.pack(stone.due_ms) + message[message_log.DUE_MS.size :]
            replayer.append_copy(offset, moved)
            self._answer(answer, EntryKind.RESCHEDULED)
            return
        kind, at_ms = fate
        self._answer(answer, kind, at_ms)

    @staticmethod
    def _current(index: IdIndex, message_id: str) -> Location | None:
        locations = index.lookup(message_id)
        if not locations:
            return None
        return max(locations, key=lambda location: location.message_log_offset)

    def _withdraw(
        self, at: Location, answer: Answer, *, is_cancel: bool
    ) -> EntryKind | tuple[EntryKind, int] | None:
        """Withdraw the record at ``at`` if it is still pending and write its entry.

        Returns EntryKind.RESCHEDULED when a reschedule may now append the moved copy,
        (kind, at_ms) for a decided answer, None when the sender's watcher answers.
        """
        now_ms = self.clock()
        kind = EntryKind.CANCELLED if is_cancel else EntryKind.RESCHEDULED
        bucket_ms, offset = at.bucket_ms, at.offset
        bucket_id = self.manager.bucket_id(bucket_ms)
        if bucket_id is not None:
            ref = pack_ref(bucket_id, offset)
            withdrawal = self.sender.withdraw(ref)
            if withdrawal is Withdrawal.WITHDRAWN:
                self._record(bucket_ms, offset, kind, now_ms, bucket_id)
                return kind if kind is EntryKind.RESCHEDULED else (kind, now_ms)
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
            files = self.dispatch.files  # reads see unflushed entries: they are pwritten
            entry = find_entry(files.fs, files.path(bucket_ms), offset)
            if entry is not None and entry.kind in DELIVERED:
                return entry.kind, entry.at_ms
            if entry is not None and entry.kind is EntryKind.CANCELLED:
                return EntryKind.CANCELLED, entry.at_ms
            if where is Whereabouts.TAKEN and entry is None:
                # Fired, not held, no entry: cannot happen (the sender holds a message
                # from the wheel until its entry). Recorded, so no restart sends it.
                log.error("cancel: %s@%d is nowhere; recording it", bucket_ms, offset)
            # No entry (not loaded since the last start), or RESCHEDULED by this very
            # tombstone before a crash (replay repeats it): still pending.
            self._record(bucket_ms, offset, kind, now_ms, None)
        return kind if kind is EntryKind.RESCHEDULED else (kind, now_ms)

    def _record(
        self, bucket_ms: int, offset: int, kind: EntryKind, at_ms: int, bucket_id: int | None
    ) -> None:
        self.dispatch.record(bucket_ms, kind, [offset], at_ms, b"")
        if bucket_id is not None:
            self.manager.on_recorded(bucket_id, 1)

    def _watcher(self, answer: Answer) -> Callable[[EntryKind, int], None]:
        def watcher(kind: EntryKind, at_ms: int) -> None:
            self._answer(answer, kind, at_ms)

        return watcher

    def _answer(self, answer: Answer, kind: EntryKind | None, at_ms: int | None = None) -> None:
        """Fill ``answer`` from the fate of the message (None: no such id)."""
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
        answer.done.set()
