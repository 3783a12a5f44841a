"""The blocking consumer: plain sockets, for ordinary synchronous code.

::

    with delayd.Consumer("127.0.0.1:20811", subject="orders", group="billing") as consumer:
        for message in consumer:
            handle(message)          # committed once the loop asks for the next one

Heartbeats: a PULL counts as one, so a consumer that keeps pulling needs nothing else.
But synchronous handlers block — a slow database call, a 20-second report — and during
them nothing is pulled; after ~10 s the broker would drop the member, hand its queues to
someone else and, on the next PULL, this consumer would re-join and take them back: two
rebalances and redelivered messages for one slow handler. So a small daemon thread sends
a HEARTBEAT on the same connection whenever nothing was sent for
``heartbeat_interval_s``. The connection is shared under a lock; PULLs wait at most
``pull_wait_ms`` (1 s by default), so the thread never waits long for its turn, and
while the consumer pulls steadily the thread has nothing to do.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from delayd.client._blocking_client import BlockingClient
from delayd.client._blocking_link import BlockingLink
from delayd.client._consumer_id import new_consumer_id
from delayd.client._consumer_state import HANDOVER_HEARTBEAT_S, ConsumerState, Subscription
from delayd.errors import (
    BusyError,
    ConnectionClosedError,
    DelaydError,
    DelaydTimeout,
    NotLeaderError,
    RejectedError,
)
from delayd.group_address import parse_group_address
from delayd.protocol import (
    HELD_QUEUES_VERSION,
    JOIN_HELD_VERSION,
    CommitOffset,
    CommitOffsetOk,
    ErrorCode,
    HeartbeatResult,
    JoinGroupResult,
    Message,
    PullResult,
    Request,
    Response,
)
from delayd.tls import ClientTls
from delayd.version import __version__

CLIENT_NAME = f"delayd-python-blocking/{__version__}"


class Consumer(BlockingClient):
    """Pulls messages of ``subject`` as a member of ``group`` at ``addr`` (``"host:port"``,
    or a broker group: ``"h1:p1,h2:p2"``, ``"etcd://host:port/GROUP"``; docs/clients.md),
    or from every broker group of a cluster: ``"etcd://host:port/[CLUSTER/]*"`` (then
    the object is a BlockingClusterConsumer, with the same methods; docs/cluster.md).

    Connects and joins on ``with`` (or on the first receive). Iterate it, or call
    ``receive(timeout_s=...)``. With ``auto_commit`` a message is committed once the
    next one is asked for, and the last one when the ``with`` block ends without an
    exception; otherwise call ``commit(message)``. ``commit="sync"`` makes each commit
    durable on the broker before the next message is handed out (at most one message
    comes again after a crash; docs/clients.md). ``timeout_s`` bounds every request;
    iterating waits for messages for ever, reconnecting while the broker is away.
    ``tls``: connect over TLS (delayd.tls.ClientTls). ``retry_first_connect=False``: a
    first connection that cannot be made raises UnreachableError at once (as the
    Producer's). Raises ValueError for a malformed ``addr`` or an unknown ``commit``
    mode, TlsError for a TLS file that cannot be used.
    """

    listener = "broker"  # etcd:// resolves to the members' broker addresses

    def __new__(cls, addr: str, **options: Any) -> Any:
        """A BlockingClusterConsumer for an address naming every group of a cluster
        (``etcd://H:P/[CLUSTER/]*``: every broker group, docs/cluster.md), with the
        same methods; a Consumer for any other."""
        if cls is Consumer and _names_every_group(addr):
            from delayd.client._blocking_cluster_consumer import BlockingClusterConsumer

            return BlockingClusterConsumer(addr, **options)
        return super().__new__(cls)

    def __init__(
        self,
        addr: str,
        *,
        subject: str,
        group: str,
        token: str | None = None,
        tls: ClientTls | None = None,
        auto_commit: bool = True,
        commit: str = "periodic",
        consumer_id: str | None = None,
        timeout_s: float = 10.0,
        max_messages: int = 256,
        pull_wait_ms: int = 1000,
        heartbeat_interval_s: float = 3.0,
        client_name: str = CLIENT_NAME,
        retry_first_connect: bool = True,
    ) -> None:
        super().__init__(addr, token, client_name, timeout_s, retry_first_connect, tls)
        self.subscription = Subscription(subject, group, consumer_id or new_consumer_id())
        self.max_messages = max_messages
        self.pull_wait_ms = pull_wait_ms
        self.heartbeat_interval_s = heartbeat_interval_s
        self._state = ConsumerState(auto_commit=auto_commit, commit=commit)
        self._joined: BlockingLink | None = None  # the link this consumer is a member on
        # COMMIT_OFFSETs sent with a PULL whose answers were not waited for: queue ->
        # offset, on the link ``_in_flight_on`` (lost with it: due again).
        self._in_flight: dict[int, int] = {}
        self._in_flight_on: BlockingLink | None = None
        self._joins = 0  # JOINs done so far
        self._last_heartbeat = 0.0  # monotonic time of the last HEARTBEAT
        self._letting_go = False  # a lost queue is held: heartbeat every 0.1 s
        self._stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None

    @property
    def queues(self) -> tuple[int, ...]:
        """The queues of the subject the broker currently assigns to this consumer."""
        return self._state.queues

    # --- lifecycle --------------------------------------------------------------------

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self.close(clean=exc_type is None)

    def connect(self) -> None:
        """Connect and join now (DelaydTimeout after ``timeout_s``, RejectedError,
        UnreachableError)."""
        with self._lock:
            self._check_open()
            self._member_link(time.monotonic() + self.timeout_s)

    def close(self, *, clean: bool = True) -> None:
        """Commit what was processed (with ``clean``, the current message too), close.

        A commit that fails is given up (those messages come again to the group), so
        close does not raise for it.
        """
        self._stop.set()
        with self._lock:
            if self._closed:
                return
            self._state.close(clean=clean)
            if self._session.current is not None and self._joined is self._session.current:
                with contextlib.suppress(DelaydError):
                    self._flush_commits(time.monotonic() + self.timeout_s, retry=False)
            self._closed = True
            self._session.close()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=self.timeout_s)

    # --- iteration --------------------------------------------------------------------

    def __iter__(self) -> Consumer:
        return self

    def __next__(self) -> Message:
        message = self.receive()
        assert message is not None
        return message

    def receive(self, timeout_s: float | None = None) -> Message | None:
        """The next message, or None when none came within ``timeout_s`` (None: wait).

        Raises DelaydTimeout when the broker could not be reached (or joined) within
        ``timeout_s`` — retryable: the same consumer reconnects on the next call and
        resumes from the group's committed offsets. Raises RejectedError when the
        broker refuses the subscription (bad subject or group, wrong token),
        ProtocolError when it breaks the protocol, ConnectionClosedError once the
        consumer is closed.
        """
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            self._check_open()
            self._state.advance()
            if self._state.sync_commits:
                # The processed message's commit is on the broker's disk before the next
                # message is handed out; if it cannot be within timeout_s, this raises
                # and the next call tries again.
                self._flush_commits(deadline, retry=True)
            while True:
                message = self._state.pop()
                if message is not None:
                    if self._state.flush_due(time.monotonic()):
                        self._flush_commits(time.monotonic() + self.timeout_s, retry=False)
                    return message
                # Nothing prefetched: the offsets processed so far go to the broker now,
                # before this consumer possibly waits a long time — in the same write as
                # the PULL (_pull), so that committing costs no round trip of its own.
                remaining_ms = (deadline - time.monotonic()) * 1000
                if remaining_ms <= 0:
                    if self._session.current is None:
                        # Not "no message": the broker could not be asked. The next call
                        # reconnects (the back-off runs across calls).
                        raise DelaydTimeout(
                            f"could not reach {self.addr} within {timeout_s} s "
                            f"({self._session.describe_problem()})"
                        )
                    return None
                self._pull(int(min(self.pull_wait_ms, remaining_ms)), deadline)

    # --- commits ----------------------------------------------------------------------

    def commit(self, message: Message) -> None:
        """Commit ``message`` and everything before it in its queue, now.

        Raises DelaydTimeout after ``timeout_s``, RejectedError when the broker refuses.
        """
        with self._lock:
            self._check_open()
            self._state.mark_processed(message)
            self._flush_commits(time.monotonic() + self.timeout_s, retry=True)

    def _flush_commits(self, deadline: float, *, retry: bool) -> None:
        """Send the due COMMIT_OFFSETs; with ``retry``, until confirmed or ``deadline``.

        Without ``retry`` a lost connection leaves them due for the next flush, and no
        connection is made for them: while the broker is away they wait for the PULL
        that follows the reconnect, rather than hold up the message being handed out.
        """
        if not retry and (self._joined is None or self._joined is not self._session.current):
            return
        while due := self._state.commits_due():
            link: BlockingLink | None = None
            try:
                link = self._member_link(deadline)
                request_deadline = min(deadline, time.monotonic() + self.timeout_s)
                for queue, offset in due:
                    link.request(self._commit_request(queue, offset), request_deadline)
                    self._state.committed(queue, offset)
            except (ConnectionClosedError, DelaydTimeout, NotLeaderError) as exc:
                if isinstance(exc, NotLeaderError):
                    self._session.redirected(exc)  # committed again at the leader
                elif link is not None:
                    # Only a link that failed is a failed attempt. Without one the session
                    # has counted its own attempts; counting a call that the back-off did
                    # not let try would restart the back-off, and a caller polling with a
                    # shorter time-out would never connect again.
                    self._session.lost(exc)  # closes it: its state is unknown
                if not retry:
                    return
                if time.monotonic() >= deadline:
                    raise
            finally:
                self._state.flushed(time.monotonic())

    # --- membership and pulling -------------------------------------------------------

    def _member_link(self, deadline: float) -> BlockingLink:
        """A link on which this consumer has joined (re-JOIN after a reconnect).

        Raises DelaydTimeout at ``deadline``; RejectedError when the JOIN is refused.
        """
        while True:
            link = self._session.link(deadline)
            if link is self._joined:
                return link
            self._state.rejoining()
            held: tuple[int, ...] | None = None
            if link.protocol_version >= JOIN_HELD_VERSION:
                held = self._state.heartbeat_held()  # a broker just leading gives them back
            try:
                result = link.request(
                    partial(self.subscription.join, held),
                    min(deadline, time.monotonic() + self.timeout_s),
                )
            except (ConnectionClosedError, DelaydTimeout) as exc:
                self._session.lost(exc)
                if time.monotonic() >= deadline:
                    raise DelaydTimeout(f"could not join at {self.addr} in time") from None
                continue
            except NotLeaderError as exc:
                self._session.redirected(exc)  # join the leader instead
                if time.monotonic() >= deadline:
                    raise DelaydTimeout(
                        f"could not join at {self.addr} in time "
                        f"({self._session.describe_problem()})"
                    ) from None
                continue
            except BusyError as exc:
                self._session.last_problem = exc
                _sleep_until(deadline, self._busy_backoff.next_delay())
                continue
            assert isinstance(result, JoinGroupResult)
            self._state.set_assignment(result.queues)
            if held and not set(held) <= set(result.queues):
                self._letting_go = True  # the heartbeat thread lets go of them soon
            self._joined = link
            self._joins += 1
            self._start_heartbeats()
            return link

    def _pull(self, wait_ms: int, deadline: float) -> None:
        """One PULL into the prefetch buffer, preceded on the wire by the commits due;
        connection trouble is retried by the caller (the commits stay due). The pulled
        messages are handed out without waiting for those commits' answers: in a
        replicated group a commit is answered once the followers have it, and the
        next messages would wait for that round trip. A commit confirmed later counts
        then; one lost with the link is due again."""
        joins_before = self._joins
        link = self._member_link(deadline)
        due = self._commits_to_send(link)
        builds: list[Callable[[int], Request]] = [
            self._commit_request(queue, offset) for queue, offset in due
        ]
        builds.append(partial(self.subscription.pull, self.max_messages, wait_ms))
        answers: dict[int, Response | DelaydError] = {}

        def on_answer(index: int, answer: Response | DelaydError) -> None:
            if index == len(due):
                answers[index] = answer
                return
            queue, offset = due[index]
            if isinstance(answer, CommitOffsetOk):
                self._state.committed(queue, offset)
            if self._in_flight.get(queue) == offset:
                del self._in_flight[queue]  # answered: refused, it is due again

        self._in_flight.update(due)
        try:
            link.pipeline(
                builds,
                time.monotonic() + wait_ms / 1000 + self.timeout_s,
                on_answer=on_answer,
                window=len(builds),
                detach=len(due),
            )
        except (ConnectionClosedError, DelaydTimeout) as exc:
            self._session.lost(exc)
            return
        finally:
            self._state.flushed(time.monotonic())
        result = answers[len(due)]
        if isinstance(result, PullResult):
            self._session.succeeded()
            self._busy_backoff.reset()
            self._state.add_pulled(result.messages)
        elif isinstance(result, NotLeaderError):
            # The group's leader moved: join it there; it resumes from the committed offsets.
            self._session.redirected(result)
            self._joined = None
            return
        elif isinstance(result, RejectedError):
            if result.code != ErrorCode.INVALID_REQUEST or self._joins != joins_before:
                raise result
            self._joined = None  # dropped from the group: join again
        elif isinstance(result, BusyError):
            self._session.last_problem = result
            _sleep_until(deadline, self._busy_backoff.next_delay())
        elif isinstance(result, DelaydError):
            raise result
        # A refused commit is an answer about the subscription: raised like a refused pull.
        for index in range(len(due)):
            answer = answers.get(index)
            if isinstance(answer, DelaydError) and not isinstance(answer, NotLeaderError):
                raise answer

    def _commits_to_send(self, link: BlockingLink) -> list[tuple[int, int]]:
        """The commits due that are not on their way on ``link`` already."""
        if link is not self._in_flight_on:
            self._in_flight, self._in_flight_on = {}, link  # lost with the old link
        return [
            (queue, offset)
            for queue, offset in self._state.commits_due()
            if offset > self._in_flight.get(queue, -1)
        ]

    def _commit_request(self, queue: int, offset: int) -> Callable[[int], CommitOffset]:
        return partial(self.subscription.commit, queue, offset, self._state.sync_commits)

    # --- heartbeats -------------------------------------------------------------------

    def _start_heartbeats(self) -> None:
        if self._heartbeat_thread is None:
            self._heartbeat_thread = threading.Thread(
                target=self._heartbeats,
                name=f"delayd-heartbeat-{self.subscription.consumer_id}",
                daemon=True,
            )
            self._heartbeat_thread.start()

    def _heartbeats(self) -> None:
        """Thread: a HEARTBEAT every ``heartbeat_interval_s`` — a PULL keeps the
        membership alive but does not say which queues are held, so a busy consumer
        heartbeats too — and sooner while a lost queue is held (its new owner waits)."""
        interval = self.heartbeat_interval_s
        while not self._stop.wait(HANDOVER_HEARTBEAT_S if self._letting_go else interval / 3):
            with self._lock:
                if self._closed:
                    return
                link = self._joined
                since = time.monotonic() - self._last_heartbeat
                if link is None or link.closed or (since < interval and not self._letting_go):
                    continue
                self._last_heartbeat = time.monotonic()
                self._letting_go = False
                deadline = time.monotonic() + self.timeout_s
                try:
                    if self._state.letting_go():
                        self._flush_commits(deadline, retry=False)
                    held: tuple[int, ...] | None = self._state.heartbeat_held()
                    if link.protocol_version < HELD_QUEUES_VERSION:
                        held = None  # a version-1 broker: it lets go with any HEARTBEAT
                    result = link.request(partial(self.subscription.heartbeat, held), deadline)
                except RejectedError as exc:
                    if exc.code == ErrorCode.INVALID_REQUEST:
                        self._joined = None  # dropped: the next receive() joins again
                    continue
                except DelaydError as exc:
                    self._session.lost(exc)  # the next receive() reconnects
                    continue
                assert isinstance(result, HeartbeatResult)
                self._state.set_assignment(result.queues)
                self._letting_go = held is not None and not set(held) <= set(result.queues)


def _names_every_group(addr: str) -> bool:
    try:
        return parse_group_address(addr).whole_cluster
    except ValueError:
        return False  # Consumer.__init__ says what is wrong with it


def _sleep_until(deadline: float, delay_s: float) -> None:
    """Sleep ``delay_s``, but not past ``deadline`` (monotonic seconds)."""
    time.sleep(max(0.0, min(delay_s, deadline - time.monotonic())))
