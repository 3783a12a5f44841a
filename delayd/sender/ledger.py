"""The sender's ledger: every message between the wheel and dispatch_log, and its fate.

A message is *held* from the moment the wheel releases its entry until its dispatch_log
entry is written; the ledger knows which are held, which a cancel may still take back
(``withdraw``), which a broker may already have (in doubt: ``watch`` them instead), and
which wait for a retry or for a usable group. delayd.sender.sender is the trio wiring
that moves the messages; this module decides, and never awaits, sleeps or reads the
clock: ``now_ms`` is an argument (STYLE.md #4, as delayd.wheel.timer), so tests drive
any history of failures and cancels directly.

In doubt: a message in a send batch whose answer has not come (``sending``), or one
whose earlier batch failed without an answer (``maybe_sent``: the broker may have
stored it), or one an earlier run may have sent (``watch_earlier``). Acknowledged →
already delivered; refused by the broker (it answered and stored nothing) → a watcher
that asked for it withdraws the message there and then, instead of retrying it.

Retries: a failed message counts an attempt (unless the failure is not its fault: a
full disk) and waits a back-off (RetryPolicy); past ``max_attempts`` it goes to its
dead-letter subject, and keeps being retried there: never dropped.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import random
from collections.abc import Callable, Iterable, Sequence

from delayd.logs import message_log, schedule_log
from delayd.logs.dispatch_log import EntryKind
from delayd.logs.message_log import MessageRecord, RecordFormatError
from delayd.logs.schedule_log import decode_scheduled
from delayd.protocol import Message, ResultCode, SendResult
from delayd.sender.retry import RetryPolicy, dead_letter_subject
from delayd.sender.wire import wire_head
from delayd.wheel.timer import OFFSET_BITS

ACKED = (ResultCode.OK, ResultCode.DUPLICATE)
PARKED_RETRY_S = 0.05  # how often messages with no usable group look again
DEAD_LETTER_REASON = "delayd.dead_letter.reason"
ORIGINAL_SUBJECT = "delayd.original_subject"

Watcher = Callable[[EntryKind, int], object]
"""``watcher(kind, at_ms)``: the fate of a watched message, once its entry is written
(DISPATCHED, DEAD_LETTERED, or CANCELLED when a watcher withdrew it on a refusal)."""


class Withdrawal(enum.Enum):
    """What ``Ledger.withdraw`` did."""

    NOT_HELD = "not held"  # not between the wheel and dispatch_log
    WITHDRAWN = "withdrawn"  # taken back: the caller records it and tells the manager
    IN_DOUBT = "in doubt"  # a broker may have it: watch the outcome


class Item:
    """One message between the wheel and dispatch_log: its schedule_log payload and what
    routing and sending read of it (the full record is decoded only when needed)."""

    __slots__ = (
        "_record",
        "attempts",
        "bucket_id",
        "bucket_ms",
        "dead",
        "doubt_group",
        "doubt_since_ms",
        "due_ms",
        "key",
        "maybe_sent",
        "message_id",
        "offset",
        "payload",
        "planned",
        "reason",
        "route",
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
        self._record: MessageRecord | None = None
        head = message_log.read_head(payload, schedule_log.PREFIX_SIZE)
        if head is None:  # malformed: the full decode raises and says why
            decode_scheduled(payload)
            raise RecordFormatError("the SCHEDULED payload's head does not hold")
        self.due_ms = head.due_ms
        self.message_id = head.message_id
        self.subject = head.subject
        self.key = head.key
        self.wire_head = wire_head(head)  # None: encode it from a Message
        self.attempts = 0
        self.dead = False
        self.reason = ""
        self.sending = False  # in a send batch whose outcome is not recorded yet
        self.maybe_sent = False  # a batch holding it failed unanswered: a broker may have it
        self.doubt_group: str | None = None  # the group of that broker (Sender._route)
        self.doubt_since_ms = 0  # when that batch failed first
        self.withdrawn = False  # cancelled or moved: skipped wherever it still sits
        # The route set under which Sender._route chose its group as the first choice
        # (None: it chose another, or a held group).
        self.planned: tuple | None = None
        # The group dispatch_log routes it to (a resend after a crash goes there), once
        # the sender looked: its last ROUTED entry, else its bucket's route set's choice.
        self.route: str | None = None
        self.watchers: list[tuple[bool, Watcher]] | None = None  # (withdraw on refusal, cb)

    @property
    def ref(self) -> int:
        return self.bucket_id << OFFSET_BITS | self.offset

    @property
    def entry_kind(self) -> EntryKind:
        """The kind of its dispatch_log entry once a broker acknowledged it."""
        return EntryKind.DEAD_LETTERED if self.dead else EntryKind.DISPATCHED

    @property
    def record(self) -> MessageRecord:
        """The decoded message_log record (decoded on first use)."""
        if self._record is None:
            self._record = decode_scheduled(self.payload).message
        return self._record

    def message(self, dispatched_ms: int) -> Message:
        """The Message to deliver: to its dead-letter subject once ``dead``, with the
        reason and the original subject added to its properties."""
        r = self.record
        subject, properties = r.subject, r.properties
        if self.dead:
            subject = dead_letter_subject(r.subject)
            properties = {
                **properties,
                DEAD_LETTER_REASON: self.reason,
                ORIGINAL_SUBJECT: r.subject,
            }
        return Message(
            r.message_id,
            subject,
            r.key,
            properties,
            r.body,
            due_ms=r.due_ms,
            dispatched_ms=dispatched_ms,
        )


class Outcomes:
    """A send batch's answers, sorted (``Ledger.sort_answers``): ``acked`` (their entries
    are to be written), ``withdrawn`` (refused, and a watcher takes them back: written
    CANCELLED), ``refused`` (retried, an attempt counted) and ``disk_full`` (retried, no
    attempt counted: a full disk is not the message's fault)."""

    __slots__ = ("acked", "disk_full", "refused", "withdrawn")

    def __init__(self) -> None:
        self.acked: list[Item] = []
        self.withdrawn: list[Item] = []
        self.refused: list[Item] = []
        self.disk_full: list[Item] = []


class Ledger:
    """See the module docstring. ``max_in_flight`` bounds the items taken and not yet
    settled (``has_room``); ``rng`` jitters the retry back-off."""

    def __init__(self, policy: RetryPolicy, max_in_flight: int, rng: random.Random) -> None:
        self.policy = policy
        self.max_in_flight = max_in_flight
        self._rng = rng
        # Wheel ref -> its item (None until read) for every entry released by the wheel
        # and not yet recorded; bounded by max_in_flight plus what the wheel released.
        self._held: dict[int, Item | None] = {}
        self._withdrawn_unread: set[int] = set()  # refs withdrawn before they were read
        # (bucket start, offset) -> watchers of messages in doubt from an earlier run
        # that were not read yet (see watch_earlier).
        self._earlier: dict[tuple[int, int], list[tuple[bool, Watcher]]] = {}
        self._retries: list[tuple[int, int, list[Item], str]] = []  # (ready_ms, n, items, group)
        self._retry_seq = itertools.count()
        self._parked: list[Item] = []  # no usable group when routed
        self.in_flight = 0  # items taken and not settled
        self.withdrawn_total = 0

    @property
    def has_room(self) -> bool:
        return self.in_flight < self.max_in_flight

    # ------------------------------------------------------------------ holding

    def release(self, refs: Iterable[int]) -> None:
        """Hold the entries the wheel just released (not read yet)."""
        self._held.update(dict.fromkeys(refs))

    def take(self, items: list[Item]) -> list[Item]:
        """Hold the items read for released entries, except those withdrawn meanwhile,
        which are returned without them: the items to route."""
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
        self.in_flight += len(items)
        return items

    def holds(self, ref: int) -> bool:
        """Whether the message of wheel ``ref`` is between the wheel and dispatch_log."""
        return ref in self._held

    def settle(self, items: Sequence[Item], at_ms: int) -> None:
        """The entries of acknowledged ``items`` are written (their ``entry_kind``, at
        ``at_ms``): they are held no more, and their watchers learn their fate."""
        held = self._held
        for item in items:
            held.pop(item.ref, None)
            if item.watchers:
                kind = item.entry_kind
                for _, watcher in item.watchers:
                    watcher(kind, at_ms)
        self.in_flight -= len(items)

    # ------------------------------------------------------------------ cancel

    def withdraw(self, ref: int) -> Withdrawal:
        """Take the message of wheel ``ref`` back, if it is held and no broker may have
        it. WITHDRAWN: the caller writes its entry; it is never sent."""
        if ref not in self._held:
            return Withdrawal.NOT_HELD
        item = self._held[ref]
        if item is None:  # released by the wheel, not read yet: dropped once read
            self._withdrawn_unread.add(ref)
        elif item.sending or item.maybe_sent:
            return Withdrawal.IN_DOUBT
        else:
            item.withdrawn = True  # skipped where it waits (group queue, retries, parked)
            self.in_flight -= 1
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

    def watch_earlier(self, bucket_ms: int, offset: int, ref: int | None, watcher: Watcher) -> None:
        """Call ``watcher`` with the fate of the message at (bucket, offset) — wheel
        ``ref``, None when its bucket has no wheel id — which an earlier run may have
        sent: it is marked as maybe sent (a refusal then does not prove it is stored
        nowhere), held or from the moment it is read. For a message that has no
        dispatch_log entry and is due (the wheel releases it at once, or the loader
        loads it soon and then it is)."""
        item = self._held.get(ref) if ref is not None else None
        if item is None:  # in the wheel, not loaded, or released and not read yet
            self._earlier.setdefault((bucket_ms, offset), []).append((False, watcher))
            return
        item.maybe_sent = True
        if item.watchers is None:
            item.watchers = []
        item.watchers.append((False, watcher))

    def _adopt_earlier(self, items: list[Item]) -> None:
        earlier = self._earlier
        for item in items:
            watchers = earlier.pop((item.bucket_ms, item.offset), None)
            if watchers is not None:
                item.maybe_sent = True
                item.watchers = [*(item.watchers or ()), *watchers]

    def withdraw_refused(self, items: Sequence[Item], at_ms: int) -> None:
        """The CANCELLED entries of refused, watched ``items`` are written (see
        ``sort_answers``): they are withdrawn, and their watchers told."""
        for item in items:
            self._held.pop(item.ref, None)
            item.withdrawn = True
            for _, watcher in item.watchers or ():
                watcher(EntryKind.CANCELLED, at_ms)
        self.withdrawn_total += len(items)
        self.in_flight -= len(items)

    # ------------------------------------------------------------------ answers

    @staticmethod
    def sort_answers(batch: Sequence[Item], results: Sequence[SendResult]) -> Outcomes:
        """Sort a batch by its answers (one per item, in order). Acknowledged items (and
        refused ones a watcher withdraws) stay ``sending`` until their entries are
        written: a cancel that comes meanwhile must see them in doubt, not withdraw a
        message a broker has just acknowledged. Raises ValueError when the counts
        differ."""
        out = Outcomes()
        for item, result in zip(batch, results, strict=True):
            if result.code in ACKED:
                out.acked.append(item)
                continue
            item.reason = f"{ResultCode(result.code).name}: {result.reason}"
            if item.watchers and not item.maybe_sent and any(w for w, _ in item.watchers):
                out.withdrawn.append(item)  # refused, so stored nowhere: the cancel wins
            else:
                item.sending = False  # stored nowhere: it may be withdrawn now
                full = result.code == ResultCode.DISK_FULL
                (out.disk_full if full else out.refused).append(item)
        return out

    @staticmethod
    def unanswered(batch: Sequence[Item], group: str | None, now_ms: int) -> None:
        """A batch failed without an answer: a broker may have stored any of it — one
        of ``group``'s, which it then waits for (None: the target knows it stored
        nothing, so the batch may go anywhere)."""
        for item in batch:
            item.sending = False
            item.maybe_sent = True
            if group is not None and item.doubt_group != group:
                item.doubt_group, item.doubt_since_ms = group, now_ms

    # ------------------------------------------------------------------ retries

    def retry(
        self,
        items: list[Item],
        failed_group: str,
        reason: str,
        now_ms: int,
        *,
        count_attempt: bool = True,
    ) -> list[Item]:
        """Count an attempt for each item (unless ``count_attempt`` is False) and queue
        them for another group after the back-off; past ``max_attempts`` an item is
        marked for its dead-letter subject instead. Returns the items that were marked
        now."""
        policy = self.policy
        attempts = 1
        dead = []
        for item in items:
            item.attempts += count_attempt
            if count_attempt and not item.dead and policy.exhausted(item.attempts):
                item.dead = True
                item.reason = item.reason or reason
                dead.append(item)
            attempts = max(attempts, item.attempts)
        ready_ms = now_ms + policy.delay_ms(attempts, self._rng)
        heapq.heappush(self._retries, (ready_ms, next(self._retry_seq), items, failed_group))
        return dead

    def due_retries(self, now_ms: int) -> list[tuple[list[Item], str]]:
        """The retries whose back-off is over at ``now_ms``, in order: (items, the group
        that failed them)."""
        due = []
        retries = self._retries
        while retries and retries[0][0] <= now_ms:
            _, _, items, failed_group = heapq.heappop(retries)
            due.append((items, failed_group))
        return due

    def park(self, item: Item) -> None:
        """Keep an item that found no usable group until ``unpark``."""
        self._parked.append(item)

    def unpark(self) -> list[Item]:
        """The parked items, to route again; none are parked afterwards."""
        parked, self._parked = self._parked, []
        return parked

    @property
    def parked(self) -> int:
        return len(self._parked)

    def wait_s(self, now_ms: int) -> float:
        """Seconds from ``now_ms`` until the next retry is due, or PARKED_RETRY_S when
        items are parked (whichever is sooner); inf when there is neither."""
        wait_s = float("inf")
        if self._retries:
            wait_s = max(0.0, (self._retries[0][0] - now_ms) / 1000)
        if self._parked:
            wait_s = min(wait_s, PARKED_RETRY_S)
        return wait_s
