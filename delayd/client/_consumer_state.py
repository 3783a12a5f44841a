"""ConsumerState: a consumer's bookkeeping between requests, and Subscription: the
requests it makes, sans-I/O.

The async and the blocking consumer drive the same objects; ConsumerState decides which
message the user gets next and which offsets are due for COMMIT_OFFSET, and does no I/O
itself.

Invariants:

- A message is handed to the user at most once per consumer instance: ``_fetched`` holds,
  per queue, the offset after the last message accepted from a PULL, and later PULLs
  that repeat older offsets (the broker restarts a queue's cursor at the committed
  offset when it is reassigned, or after a reconnect) are dropped.
- Offsets only move forward: a commit for queue ``q`` is due when the offset after the
  last processed message of ``q`` is beyond what the broker last confirmed.
- A lost queue is let go only once nothing of it is held: its prefetched messages are
  dropped at once, and ``heartbeat_held()`` keeps naming it while a message of it was handed to
  the user and not committed; the broker gives it to its new owner when a HEARTBEAT
  no longer names it (delayd.broker.groups), so nobody sees that message again.
- Answers are applied in the order the broker sent them (the blocking consumer makes one
  request at a time; the async one applies each answer as its link reads it). A PULL
  answer that brings messages of a queue this consumer counts as lost therefore comes
  after the queue was given back, before the answer that says so: they wait
  (``_limbo``) for the next assignment, which hands them out or drops them. Dropped
  earlier, they would be skipped by the whole group: the broker's cursor moved past
  them, and the consumer's next commit of the queue moves the offset past them too.
- With auto-commit a message counts as processed when the user asks for the next one
  (the loop body for it ran), or when the consumer is closed without an error; a
  message whose processing raised is not committed and comes again after a restart.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from delayd.protocol import CommitOffset, Heartbeat, JoinGroup, Message, Pull

# How a consumer commits: "periodic" sends COMMIT_OFFSET with the next PULL, at least
# every commit_interval_s and on close, answered from the broker's memory; "sync"
# commits each processed message durably (on the broker's disk) before the next one is
# handed out, so a crash of consumer or broker hands at most that one message out again.
COMMIT_MODES = ("periodic", "sync")

# Heartbeats while a lost queue is still held: the confirmation that lets its new owner
# read it goes out this soon after the last message of it is committed (seconds).
HANDOVER_HEARTBEAT_S = 0.1


@dataclass(frozen=True, slots=True)
class Subscription:
    """Who a consumer is to the broker — a member ``consumer_id`` of ``group`` reading
    ``subject`` — and the requests that say so, each built with its request id."""

    subject: str
    group: str
    consumer_id: str

    def join(self, held: tuple[int, ...] | None, request_id: int) -> JoinGroup:
        """JOIN_GROUP; ``held``: the queues still held (None to a broker before version
        3), which a broker that has just begun to lead gives back."""
        identity = (self.group, self.subject, self.consumer_id)
        return JoinGroup(*identity, held, request_id=request_id)

    def heartbeat(self, held: tuple[int, ...] | None, request_id: int) -> Heartbeat:
        """HEARTBEAT; ``held``: the queues still held (None to a version-1 broker)."""
        identity = (self.group, self.subject, self.consumer_id)
        return Heartbeat(*identity, held, request_id=request_id)

    def pull(self, max_messages: int, wait_ms: int, request_id: int) -> Pull:
        """PULL of up to ``max_messages``, held by the broker up to ``wait_ms``."""
        identity = (self.subject, self.group, self.consumer_id)
        return Pull(*identity, max_messages, wait_ms, request_id=request_id)

    def commit(self, queue: int, offset: int, durable: bool, request_id: int) -> CommitOffset:
        """COMMIT_OFFSET: ``offset`` is the next to read in ``queue``; ``durable`` asks
        the broker to have it on disk before answering (commit="sync")."""
        return CommitOffset(self.group, self.subject, queue, offset, durable, request_id=request_id)


class ConsumerState:
    """Assignment, prefetched messages and offsets of one consumer.

    ``commit`` is one of COMMIT_MODES (ValueError otherwise). ``commit_interval_s``
    bounds how long a processed offset may wait before a commit is due while the user
    works through a prefetched batch (seconds; periodic mode).
    """

    def __init__(
        self,
        *,
        auto_commit: bool = True,
        commit: str = "periodic",
        commit_interval_s: float = 1.0,
    ) -> None:
        if commit not in COMMIT_MODES:
            raise ValueError(f"commit must be one of {', '.join(COMMIT_MODES)}, not {commit!r}")
        self.auto_commit = auto_commit
        self.sync_commits = commit == "sync"  # durable commits, each before the next message
        self.commit_interval_s = commit_interval_s
        self.queues: tuple[int, ...] = ()
        self._buffer: deque[Message] = deque()
        self._fetched: dict[int, int] = {}  # queue -> offset after the last accepted message
        self._handed: dict[int, int] = {}  # queue -> offset after the last handed to the user
        self._revoked: set[int] = set()  # queues the broker took away: not yet given back
        # Messages of a lost queue that a PULL brought after it was given back and before
        # the answer that says so came (the invariants above).
        self._limbo: dict[int, list[Message]] = {}
        self._processed: dict[int, int] = {}  # queue -> commit offset of processed messages
        self._committed: dict[int, int] = {}  # queue -> offset the broker confirmed
        self._current: Message | None = None  # handed to the user, being processed
        self._last_flush_s: float | None = None

    # --- membership -------------------------------------------------------------------

    def set_assignment(self, queues: Iterable[int]) -> None:
        """The broker assigned ``queues``; forget prefetched messages of the others.

        Messages of a lost queue go to its new owner, which starts from the committed
        offset once this consumer let go (:meth:`heartbeat_held`); handing them out here too
        would deliver them twice.
        """
        lost = set(self.queues).difference(queues)
        self.queues = tuple(sorted(queues))
        given_back = self._revoked.intersection(self.queues)
        self._revoked = (self._revoked | lost).difference(self.queues)
        if any(m.queue in self._revoked for m in self._buffer):
            self._buffer = deque(m for m in self._buffer if m.queue not in self._revoked)
        for queue in lost:
            # If the queue comes back its cursor restarts at the committed offset: what
            # was handed out is not handed out again, what was only prefetched is.
            if queue in self._handed:
                self._fetched[queue] = self._handed[queue]
            else:
                self._fetched.pop(queue, None)
        for queue in given_back:
            self.add_pulled(self._limbo.pop(queue, ()))
        # Still another's in an answer sent after they were read: taken away again
        # before this consumer heard it had the queue, which another member reads now
        # from the committed offset.
        self._limbo.clear()

    def rejoining(self) -> None:
        """A JOIN_GROUP after a reconnect or after the broker dropped this member: the
        broker restarts every cursor at the committed offsets, and what the old
        membership's PULLs brought of lost queues may have been read by others since."""
        self._limbo.clear()

    def lost(self, queue: int | None) -> bool:
        """Whether the broker took ``queue`` away (and has not given it back)."""
        return queue in self._revoked

    def heartbeat_held(self) -> tuple[int, ...]:
        """The queues to name in the next HEARTBEAT, or in the JOIN_GROUP after a
        reconnect: the assignment, and every lost queue of which a message was handed
        to the user and is not committed yet. The lost queues it leaves out are let go
        with that request."""
        unfinished = {
            q for q in self._revoked if self._handed.get(q, 0) > self._committed.get(q, 0)
        }
        return tuple(sorted(unfinished.union(self.queues)))

    def letting_go(self) -> bool:
        """Whether a lost queue waits for commits that are due (flush them, then tell
        the broker what is held)."""
        due = {q for q, _ in self.commits_due()}
        return any(q in due for q in self._revoked)

    def dropped(self, message: Message) -> None:
        """``message`` was handed out but thrown away unseen (its queue was lost while it
        waited): it and the messages after it are no longer held."""
        queue, offset = message.queue, message.queue_offset
        if queue is None or offset is None:
            return
        if offset < self._handed.get(queue, 0):
            self._handed[queue] = offset
        if queue in self._revoked and offset < self._fetched.get(queue, offset + 1):
            self._fetched[queue] = offset  # unseen: it may come again if given back

    # --- messages ---------------------------------------------------------------------

    def add_pulled(self, messages: Iterable[Message]) -> int:
        """Accept the messages of a PULL_RESULT; returns how many were new."""
        added = 0
        for m in messages:
            queue, offset = m.queue, m.queue_offset
            if queue in self._revoked:
                self._limbo.setdefault(queue, []).append(m)
                continue
            if queue is not None and offset is not None:
                if offset < self._fetched.get(queue, 0):
                    continue  # already accepted once: a replay from an older cursor
                self._fetched[queue] = offset + 1
            self._buffer.append(m)
            added += 1
        return added

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def advance(self) -> None:
        """The user asked for the next message: with auto-commit, the current is done."""
        if self._current is not None and self.auto_commit:
            self.mark_processed(self._current)
        self._current = None

    def pop(self) -> Message | None:
        """The next prefetched message for the user, or None when none is left."""
        if not self._buffer:
            return None
        self._current = message = self._buffer.popleft()
        if message.queue is not None and message.queue_offset is not None:
            self._handed[message.queue] = message.queue_offset + 1
        return message

    def close(self, *, clean: bool) -> None:
        """The consumer is closing; ``clean`` means no exception is propagating."""
        if clean:
            self.advance()
        self._current = None

    # --- offsets ----------------------------------------------------------------------

    def mark_processed(self, message: Message) -> None:
        """``message`` and everything before it in its queue may be committed."""
        queue, offset = message.queue, message.queue_offset
        if queue is None or offset is None:
            return
        if offset + 1 > self._processed.get(queue, 0):
            self._processed[queue] = offset + 1

    def commits_due(self) -> list[tuple[int, int]]:
        """(queue, offset) pairs to send as COMMIT_OFFSET, offset being the next to read."""
        return [
            (queue, offset)
            for queue, offset in self._processed.items()
            if offset > self._committed.get(queue, -1)
        ]

    def committed(self, queue: int, offset: int) -> None:
        """The broker confirmed COMMIT_OFFSET(queue, offset)."""
        if offset > self._committed.get(queue, -1):
            self._committed[queue] = offset

    def flush_due(self, now_s: float) -> bool:
        """Whether processed offsets have waited ``commit_interval_s`` (monotonic s)."""
        if self._last_flush_s is None:
            self._last_flush_s = now_s
            return False
        return now_s - self._last_flush_s >= self.commit_interval_s and bool(self.commits_due())

    def flushed(self, now_s: float) -> None:
        """Commits were just sent (monotonic seconds)."""
        self._last_flush_s = now_s
