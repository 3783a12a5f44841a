"""The async consumer, on anyio: works under trio and under asyncio.

::

    async with delayd.open_consumer("127.0.0.1:20811", subject="orders", group="billing") as c:
        async for message in c:
            handle(message)          # committed once the loop asks for the next one

Tasks, all in the consumer's own task group: a heartbeat every ``heartbeat_interval_s``
(the broker drops members after ~10 s of silence), and one PULL at a time, started when
the user wants a message and none is prefetched, or ahead of time when fewer than half
a PULL's worth (``max_messages``) is left. The PULL runs in its own task so that a
``receive`` that times out or is cancelled does not throw its answer away: the broker
has already moved its delivered cursor past those messages, so they would otherwise not
come again until the queue is reassigned. Commits due when a PULL starts go out in a
task of their own at the same time, so a consumer whose prefetch ran dry does not wait
a commit round trip before it pulls (that made it slower than the blocking consumer,
which writes them with the PULL).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from functools import partial

import anyio
import anyio.abc

from delayd.client._async_link import AsyncLink
from delayd.client._async_session import AsyncSession
from delayd.client._backoff import Backoff
from delayd.client._cluster_consumer import ClusterConsumer, open_cluster_consumer
from delayd.client._consumer_id import new_consumer_id
from delayd.client._consumer_state import (
    COMMIT_MODES,
    HANDOVER_HEARTBEAT_S,
    ConsumerState,
    Subscription,
)
from delayd.client._receiving import ReceivingIterator
from delayd.client._task_group import background_task_group
from delayd.client.async_producer import CLIENT_NAME
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
    ErrorCode,
    HeartbeatResult,
    JoinGroupResult,
    Message,
    PullResult,
    Response,
)
from delayd.tls import ClientTls


class AsyncConsumer(ReceivingIterator):
    """Pulls messages of ``subject`` as a member of ``group``; made by ``open_consumer``.

    Iterate it (``async for``) or call ``receive``. With ``auto_commit`` a message is
    committed once the user asks for the next one, and the last one on a clean close;
    otherwise call ``commit(message)``. ``commit="sync"`` makes each commit durable on
    the broker before the next message is handed out (docs/clients.md). ``timeout_s``
    bounds every request; waiting for a message has no bound of its own (the iterator
    keeps reconnecting while the broker is away), ``receive(timeout_s=...)`` sets one.
    """

    def __init__(
        self,
        session: AsyncSession,
        task_group: anyio.abc.TaskGroup,
        subscription: Subscription,
        *,
        auto_commit: bool,
        commit: str,
        timeout_s: float,
        max_messages: int,
        pull_wait_ms: int,
        heartbeat_interval_s: float,
    ) -> None:
        self._session = session
        self._task_group = task_group
        self.addr = session.addr
        self.subscription = subscription
        self.timeout_s = timeout_s
        self.max_messages = max_messages
        self.pull_wait_ms = pull_wait_ms
        self.heartbeat_interval_s = heartbeat_interval_s
        self._state = ConsumerState(auto_commit=auto_commit, commit=commit)
        self._joined: AsyncLink | None = None  # the link this consumer is a member on
        self._join_lock = anyio.Lock()
        self._joins = 0  # JOINs done so far
        self._pulling = False
        self._committing = False  # a _commit_in_background task is running
        self._prefetch_low = max_messages // 2  # pull ahead below this many buffered
        self._arrived = anyio.Event()
        self._heartbeat_now = anyio.Event()  # a JOIN's answer took declared queues away
        self._pull_error: DelaydError | None = None
        self._busy_backoff = Backoff(initial_s=0.01, max_s=1.0)
        self._closed = False

    @property
    def queues(self) -> tuple[int, ...]:
        """The queues of the subject the broker currently assigns to this consumer."""
        return self._state.queues

    # --- iteration --------------------------------------------------------------------

    async def receive(self, timeout_s: float | None = None) -> Message | None:
        """The next message, or None when none came within ``timeout_s`` (None: wait).

        Raises DelaydTimeout when the broker could not be reached within ``timeout_s``
        — retryable: the consumer keeps reconnecting and a later call resumes from the
        group's committed offsets. Raises RejectedError when the broker refuses the
        subscription (bad subject or group), ProtocolError when it breaks the protocol,
        ConnectionClosedError once the consumer is closed.
        """
        if self._closed:
            raise ConnectionClosedError("the consumer is closed")
        self._state.advance()
        deadline = math.inf if timeout_s is None else anyio.current_time() + timeout_s
        if self._state.sync_commits and self._state.commits_due():
            # The processed message's commit is on the broker's disk before the next
            # message is handed out; if it cannot be in time, raise, and the next call
            # tries again.
            with anyio.move_on_at(deadline):
                await self._flush_commits(retry=True)
            if self._state.commits_due():
                raise DelaydTimeout(
                    f"could not commit to {self.addr} within {timeout_s} s "
                    f"({self._session.describe_problem()}); the next message is handed "
                    "out once the commit is durable"
                )
        while True:
            message = self._state.pop()
            if message is not None:
                if (
                    not self._pulling
                    and self._pull_error is None
                    and self._state.buffered < self._prefetch_low
                ):
                    # Pull the next batch while the user works through this one, so
                    # that the broker's reading and the client's decoding overlap.
                    self._start_pull()
                if self._state.flush_due(anyio.current_time()):
                    await self._flush_commits()
                return message
            if self._pull_error is not None:
                error, self._pull_error = self._pull_error, None
                raise error
            with anyio.move_on_at(deadline):
                # Nothing prefetched: the offsets processed so far go to the broker now,
                # before this consumer possibly waits a long time — alongside the PULL
                # (_pull_once), not as a round trip before it.
                if not self._pulling:
                    self._start_pull()
                await self._arrived.wait()
            if anyio.current_time() >= deadline and not self._state.buffered:
                if self._session.current is None:
                    # Not "no message": the broker could not be asked. The PULL task
                    # goes on reconnecting; a later call finds what it brings.
                    raise DelaydTimeout(
                        f"could not reach {self.addr} within {timeout_s} s "
                        f"({self._session.describe_problem()})"
                    )
                return None

    def _start_pull(self) -> None:
        self._pulling = True
        self._arrived = anyio.Event()
        self._task_group.start_soon(self._pull)

    # --- commits ----------------------------------------------------------------------

    async def commit(self, message: Message) -> None:
        """Commit ``message`` and everything before it in its queue, now.

        Raises DelaydTimeout after ``timeout_s``, RejectedError when the broker refuses.
        """
        self._state.mark_processed(message)
        with anyio.move_on_after(self.timeout_s) as scope:
            await self._flush_commits(retry=True)
        if scope.cancelled_caught:
            raise DelaydTimeout(
                f"commit to {self.addr} took over {self.timeout_s} s "
                f"({self._session.describe_problem()})"
            )

    def processed(self, message: Message) -> None:
        """Count ``message`` (and everything before it in its queue) as processed
        without waiting: its commit goes out with the next PULL, as an auto-commit's
        does (a consumer of every group marks the messages of its groups so)."""
        self._state.mark_processed(message)

    def lost(self, queue: int | None) -> bool:
        """Whether the broker took ``queue`` away from this consumer (not given back)."""
        return self._state.lost(queue)

    def dropped(self, message: Message) -> None:
        """``message`` was handed out but thrown away unseen, because its queue went to
        another member while it waited (the cluster consumer's pumps): this consumer
        no longer holds it, so the queue's hand-over need not wait for its commit."""
        self._state.dropped(message)

    async def _commit_in_background(self) -> None:
        """_flush_commits as a task of its own, next to a PULL (one at a time)."""
        self._committing = True
        try:
            await self._flush_commits()
        except DelaydError as exc:  # e.g. a refused commit: receive() raises it
            if self._pull_error is None:
                self._pull_error = exc
        finally:
            self._committing = False

    async def _flush_commits(self, *, retry: bool = False) -> None:
        """Send the due COMMIT_OFFSETs; with ``retry``, until they are confirmed.

        Without ``retry`` a lost connection leaves them due for the next flush, and no
        connection is made for them: while the broker is away they wait for the PULL
        that follows the reconnect, rather than hold up the message being handed out.
        """
        if not retry and (self._joined is None or self._joined.closed):
            return
        while due := self._state.commits_due():
            link: AsyncLink | None = None
            try:
                link = await self._member_link()
                for queue, offset in due:
                    with anyio.fail_after(self.timeout_s):
                        await link.request(self._commit_request(queue, offset))
                    self._state.committed(queue, offset)
            except (ConnectionClosedError, TimeoutError) as exc:
                if link is not None:
                    self._session.lost(link, exc)  # closes it: its state is unknown
                if not retry:
                    return
            except NotLeaderError as exc:
                if link is not None:
                    self._session.redirected(link, exc)  # committed again at the leader
                if not retry:
                    return
            finally:
                self._state.flushed(anyio.current_time())

    def _commit_request(self, queue: int, offset: int) -> Callable[[int], CommitOffset]:
        return partial(self.subscription.commit, queue, offset, self._state.sync_commits)

    # --- membership and pulling -------------------------------------------------------

    async def _member_link(self) -> AsyncLink:
        """A link on which this consumer has joined the group (re-JOIN after a reconnect)."""
        async with self._join_lock:
            while True:
                link = await self._session.link()
                if link is self._joined:
                    return link
                self._state.rejoining()
                held: tuple[int, ...] | None = None
                if link.protocol_version >= JOIN_HELD_VERSION:
                    # A broker that has just begun to lead gives these back.
                    held = self._state.heartbeat_held()
                try:
                    join = partial(self.subscription.join, held)
                    result = await link.request(join, on_answer=self._assigned)
                except ConnectionClosedError as exc:
                    self._session.lost(link, exc)
                    continue
                except NotLeaderError as exc:
                    self._session.redirected(link, exc)  # join the leader instead
                    continue
                except BusyError as exc:
                    self._session.last_problem = exc
                    await anyio.sleep(self._busy_backoff.next_delay())
                    continue
                assert isinstance(result, JoinGroupResult)
                if held and not set(held) <= set(result.queues):
                    self._heartbeat_now.set()  # let go of them as soon as nothing is held
                self._joined = link
                self._joins += 1
                return link

    def _assigned(self, answer: Response) -> None:
        """A JOIN_GROUP's or HEARTBEAT's answer, applied as the link reads it: in the
        broker's order with the PULLs' (ConsumerState's invariants), not when the task
        that waits for it runs."""
        if isinstance(answer, JoinGroupResult | HeartbeatResult):
            self._state.set_assignment(answer.queues)

    def _pulled(self, answer: Response) -> None:
        """A PULL's answer, applied as the link reads it (``_assigned``)."""
        if isinstance(answer, PullResult):
            self._state.add_pulled(answer.messages)

    async def _pull(self) -> None:
        """One PULL into the prefetch buffer. Never raises: errors go to receive()."""
        try:
            await self._pull_once()
        finally:
            self._pulling = False
            self._arrived.set()

    async def _pull_once(self) -> None:
        joins_before = self._joins
        try:
            link = await self._member_link()
        except DelaydError as exc:  # JOIN refused, or not the protocol: not retried
            self._pull_error = exc
            return
        if self._state.commits_due() and not self._committing:
            self._task_group.start_soon(self._commit_in_background)
        try:
            with anyio.move_on_after(self.pull_wait_ms / 1000 + self.timeout_s) as scope:
                pull = partial(self.subscription.pull, self.max_messages, self.pull_wait_ms)
                result = await link.request(pull, on_answer=self._pulled)
                assert isinstance(result, PullResult)
                self._session.succeeded()
                self._busy_backoff.reset()
            if scope.cancelled_caught:
                link.abort("closed: no answer to PULL in time")
        except ConnectionClosedError as exc:
            self._session.lost(link, exc)
        except NotLeaderError as exc:
            # The group's leader moved: join it there; it resumes from the committed offsets.
            self._session.redirected(link, exc)
        except RejectedError as exc:
            if exc.code == ErrorCode.INVALID_REQUEST and self._joins == joins_before:
                # The broker dropped this member (no heartbeat for too long): join again.
                self._joined = None
            else:
                self._pull_error = exc
        except BusyError as exc:
            self._session.last_problem = exc
            await anyio.sleep(self._busy_backoff.next_delay())
        except DelaydError as exc:
            self._pull_error = exc

    async def _heartbeats(self) -> None:
        """Keep the membership alive while the user works; follow reassignments, and
        let go of a lost queue as soon as nothing of it is held (then sooner than every
        ``heartbeat_interval_s``: the queue's new owner waits for it)."""
        letting_go = False
        while True:
            with anyio.move_on_after(
                HANDOVER_HEARTBEAT_S if letting_go else self.heartbeat_interval_s
            ):
                await self._heartbeat_now.wait()
            self._heartbeat_now = anyio.Event()
            letting_go = False
            link = self._joined
            if link is None or link.closed:
                continue  # the next PULL reconnects and joins again
            try:
                if self._state.letting_go():
                    await self._flush_commits()  # committed, the lost queue can go
                held: tuple[int, ...] | None = self._state.heartbeat_held()
                if link.protocol_version < HELD_QUEUES_VERSION:
                    held = None  # a version-1 broker: it lets go of them with any HEARTBEAT
                with anyio.move_on_after(self.timeout_s) as scope:
                    heartbeat = partial(self.subscription.heartbeat, held)
                    result = await link.request(heartbeat, on_answer=self._assigned)
                    assert isinstance(result, HeartbeatResult)
                    letting_go = held is not None and not set(held) <= set(result.queues)
                if scope.cancelled_caught:
                    link.abort("closed: no answer to HEARTBEAT in time")
            except RejectedError as exc:
                if exc.code == ErrorCode.INVALID_REQUEST and link is self._joined:
                    self._joined = None  # dropped from the group: the next PULL re-joins
            except DelaydError:
                pass  # connection trouble: the next PULL reconnects and reports errors

    # --- lifecycle --------------------------------------------------------------------

    async def _start(self) -> None:
        with anyio.move_on_after(self.timeout_s) as scope:
            await self._member_link()
        if scope.cancelled_caught:
            raise DelaydTimeout(
                f"could not join group {self.subscription.group!r} at {self.addr} within "
                f"{self.timeout_s} s "
                f"({self._session.describe_problem()})"
            )
        self._task_group.start_soon(self._heartbeats)

    async def aclose(self, *, clean: bool = True) -> None:
        """Commit what was processed (with ``clean``, the current message too), close.

        A commit that cannot be made within ``timeout_s`` is given up: those messages
        come again to the group (at-least-once), which is why it does not raise.
        """
        if self._closed:
            return
        self._state.close(clean=clean)
        if self._joined is not None and not self._joined.closed:
            with anyio.move_on_after(self.timeout_s):
                with suppress(DelaydError):
                    await self._flush_commits()
        self._closed = True
        self._session.close()


@asynccontextmanager
async def open_consumer(
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
    pull_wait_ms: int = 2000,
    heartbeat_interval_s: float = 3.0,
    client_name: str = CLIENT_NAME,
    retry_first_connect: bool = True,
) -> AsyncIterator[AsyncConsumer | ClusterConsumer]:
    """An async consumer of ``subject`` in ``group`` at ``addr`` (``"host:port"``, a
    member list, ``etcd://H:P/GROUP``; docs/clients.md).

    With ``etcd://H:P/[CLUSTER/]*`` it reads from every broker group of the cluster,
    picking up groups that appear (a ClusterConsumer: delayd.client._cluster_consumer,
    docs/cluster.md); it joins each group as it finds it, not before the body runs.

    Joins the group before the body runs (within ``timeout_s``: DelaydTimeout, or
    RejectedError for a wrong token or a refused subscription; over TLS with ``tls``,
    TlsError for a certificate refused). On exit commits what
    was processed — including the last message when the body ended without an
    exception — and closes. ``max_messages`` is the PULL batch size, ``pull_wait_ms``
    how long the broker may hold a PULL that finds nothing. ``commit`` is "periodic"
    (default) or "sync" (each commit durable before the next message; ValueError for
    anything else). ``retry_first_connect=False``: UnreachableError at once when the
    first connection cannot be made (as open_producer's).
    """
    target = parse_group_address(addr)
    if target.whole_cluster:
        if commit not in COMMIT_MODES:
            raise ValueError(f"commit must be one of {', '.join(COMMIT_MODES)}, not {commit!r}")
        open_group = partial(
            open_consumer,
            subject=subject,
            group=group,
            token=token,
            tls=tls,
            auto_commit=False,  # the cluster consumer says what was processed
            commit=commit,
            consumer_id=consumer_id or new_consumer_id(),  # one member id in every group
            timeout_s=timeout_s,
            max_messages=max_messages,
            pull_wait_ms=pull_wait_ms,
            heartbeat_interval_s=heartbeat_interval_s,
            client_name=client_name,
        )
        async with open_cluster_consumer(
            target,
            open_group,
            auto_commit=auto_commit,
            sync_commits=commit == "sync",
            timeout_s=timeout_s,
            retry_first_connect=retry_first_connect,
        ) as consumer:
            yield consumer
        return
    async with background_task_group() as tg:
        session = AsyncSession(
            addr, token=token, client_name=client_name, task_group=tg, listener="broker", tls=tls
        )
        session.retry_first_connect = retry_first_connect
        consumer = AsyncConsumer(
            session,
            tg,
            Subscription(subject, group, consumer_id or new_consumer_id()),
            auto_commit=auto_commit,
            commit=commit,
            timeout_s=timeout_s,
            max_messages=max_messages,
            pull_wait_ms=pull_wait_ms,
            heartbeat_interval_s=heartbeat_interval_s,
        )
        clean = False
        try:
            await consumer._start()
            yield consumer
            clean = True
        finally:
            with anyio.CancelScope(shield=True):
                await consumer.aclose(clean=clean)
