"""A consumer of a whole cluster (``etcd://H:P/[CLUSTER/]*``): one one-group consumer per
broker group that holds the subject, merged into one stream (docs/cluster.md,
"Consumers across broker groups").

::

    registry ─every refresh_s─▶ a pump per group: AsyncConsumer(etcd://H:P/CLUSTER/G)
                                   └─ receive() ─▶ [channel, unbuffered] ─▶ receive()

Each pump is an ordinary one-group consumer (the leader found in etcd, NOT_LEADER
followed, JOIN, heartbeats, rebalances: each broker group shares its own queues among
the members of the consumer group, so the members share the queues of every group).
Its auto-commit is off: a message counts as processed when the user of this consumer
asks for the next one, and the commit goes to the group the message came from.

Groups are those of delayd.cluster.broker_groups: a broker group that appears is
pumped from the next read of the registry on; one that is draining is read on (until
it is empty: it takes no new messages); one that is retired or no longer registered is
closed. Only the pump's channel and its own prefetch hold messages not yet handed out;
a message not handed out when the consumer closes is not committed, and comes again to
the consumer group.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING

import anyio
import anyio.abc

from delayd.client._receiving import ReceivingIterator
from delayd.client._task_group import background_task_group
from delayd.errors import (
    ConnectionClosedError,
    DelaydError,
    DelaydTimeout,
    EtcdError,
    UnreachableError,
)
from delayd.group_address import ETCD_SCHEME, GroupAddress
from delayd.protocol import Message

if TYPE_CHECKING:
    from delayd.client.async_consumer import AsyncConsumer

log = logging.getLogger(__name__)

DEFAULT_REFRESH_S = 2.0
REJOIN_S = 1.0  # after a group's consumer could not join in time
ORIGINS_KEPT = 65_536  # messages handed out whose group commit() can still name

OpenGroup = Callable[[str], AbstractAsyncContextManager["AsyncConsumer"]]


def group_address(cluster: GroupAddress, group: str) -> str:
    """``etcd://H:P[,H:P]/[CLUSTER/]GROUP``: one group of the cluster ``cluster`` names."""
    hosts = ",".join(url.removeprefix("http://") for url in cluster.etcd)
    path = f"{cluster.cluster}/{group}" if cluster.cluster else group
    return f"{ETCD_SCHEME}{hosts}/{path}"


class ClusterConsumer(ReceivingIterator):
    """See the module docstring; made by ``open_consumer`` for an address naming every
    group. ``open_group(addr)`` opens the one-group consumer of a group (auto-commit
    off). Iterate it or call ``receive``, as an AsyncConsumer."""

    def __init__(
        self,
        cluster: GroupAddress,
        open_group: OpenGroup,
        task_group: anyio.abc.TaskGroup,
        *,
        auto_commit: bool,
        sync_commits: bool,
        timeout_s: float,
        refresh_s: float = DEFAULT_REFRESH_S,
    ) -> None:
        self.cluster = cluster
        self.addr = str(cluster)
        self._open_group = open_group
        self._task_group = task_group
        self.auto_commit = auto_commit
        self.sync_commits = sync_commits
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        # A pump hands over a message, or the error that ended it (raised by receive).
        self._send, self._receive = anyio.create_memory_object_stream[
            tuple[str, Message | DelaydError]
        ](0)
        self._pumps: dict[str, _Pump] = {}
        self.consumers: dict[str, AsyncConsumer] = {}  # by group, once joined
        self._current: tuple[str, Message] | None = None  # handed out, being processed
        self._origins: OrderedDict[int, tuple[Message, str]] = OrderedDict()
        self._closed = False

    @property
    def groups(self) -> list[str]:
        """The groups this consumer reads from now."""
        return sorted(self._pumps)

    @property
    def queues(self) -> dict[str, tuple[int, ...]]:
        """The queues each broker group assigns to this consumer, by group."""
        return {group: consumer.queues for group, consumer in sorted(self.consumers.items())}

    # --- iteration --------------------------------------------------------------------

    async def receive(self, timeout_s: float | None = None) -> Message | None:
        """The next message from any group, or None when none came within
        ``timeout_s`` (None: wait). Raises what a group's consumer raised that is not
        retried (RejectedError for a refused subscription), ConnectionClosedError once
        closed, DelaydTimeout when the commit of the message before (``commit="sync"``)
        could not be made in time."""
        if self._closed:
            raise ConnectionClosedError("the consumer is closed")
        await self._advance()
        with anyio.move_on_after(float("inf") if timeout_s is None else timeout_s):
            while True:
                group, message = await self._receive.receive()
                if isinstance(message, DelaydError):
                    raise message
                if self._still_assigned(group, message):
                    break
                if group in self.consumers:
                    self.consumers[group].dropped(message)  # no longer held: it may go
            self._current = (group, message)
            self._origins[id(message)] = (message, group)
            if len(self._origins) > ORIGINS_KEPT:
                self._origins.popitem(last=False)
            return message
        return None

    def _still_assigned(self, group: str, message: Message) -> bool:
        """Whether ``message``'s queue is still this consumer's in its group. A message
        waits in its pump until the user asks for one; if the group took its queue away
        meanwhile, its new owner reads it from the committed offset once this consumer
        let go, so it is dropped here as a consumer drops the prefetched messages of a
        lost queue (a queue given before this consumer heard of it is not lost)."""
        consumer = self.consumers.get(group)
        return consumer is not None and not consumer.lost(message.queue)

    async def _advance(self) -> None:
        """The user asked for the next message: with auto-commit, the current is done."""
        current, self._current = self._current, None
        if current is None or not self.auto_commit:
            return
        group, message = current
        consumer = self.consumers.get(group)
        if consumer is None:
            return  # its group was closed: the message comes again to the consumer group
        if self.sync_commits:
            await consumer.commit(message)
        else:
            consumer.processed(message)

    async def commit(self, message: Message) -> None:
        """Commit ``message`` (one of the last ORIGINS_KEPT handed out) and everything
        before it in its queue, at the group it came from. Raises ValueError for a
        message this consumer did not hand out, DelaydTimeout and RejectedError as
        AsyncConsumer.commit."""
        found = self._origins.get(id(message))
        if found is None or found[0] is not message:
            raise ValueError(
                f"message {message.message_id!r} was not handed out by this consumer "
                f"(or is older than its last {ORIGINS_KEPT:,}); commit what receive returned"
            )
        consumer = self.consumers.get(found[1])
        if consumer is None:
            raise ConnectionClosedError(f"broker group {found[1]} is no longer read")
        await consumer.commit(message)

    # --- the groups -------------------------------------------------------------------

    async def refresh(self) -> None:
        """Read the cluster's broker groups and start or stop pumps to match. Raises
        EtcdError when etcd cannot be read."""
        from delayd.cluster.broker_groups import read_broker_groups
        from delayd.cluster.etcd import EtcdClient
        from delayd.cluster.members import cluster_prefix

        async with EtcdClient(self.cluster.etcd) as etcd:
            groups = await read_broker_groups(etcd, cluster_prefix(self.cluster.cluster))
        names = {group.name for group in groups}
        if self._closed:
            return
        for name in sorted(names - self._pumps.keys()):
            pump = self._pumps[name] = _Pump()
            self._task_group.start_soon(self._pump, name, pump)
        for name in sorted(self._pumps.keys() - names):
            log.info("broker group %s: retired or removed, no longer read", name)
            self._pumps.pop(name).stop()

    async def _refreshes(self) -> None:
        while True:
            await anyio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except (EtcdError, ValueError) as exc:  # the groups known are read on
                log.warning("%s: cannot read the cluster's groups: %s", self.addr, exc)

    async def _pump(self, group: str, pump: _Pump) -> None:
        """Hand the messages of ``group`` to the channel until stopped; never raises
        (an error not retried goes through the channel, for receive() to raise)."""
        address = group_address(self.cluster, group)
        try:
            while not pump.stopped:
                try:
                    async with self._open_group(address) as consumer:
                        self.consumers[group] = consumer
                        try:
                            # Stopped by cancelling this scope alone: the group's
                            # consumer then closes as after a clean body, committing
                            # what was processed while its links are still read.
                            with pump.reading():
                                while True:
                                    message = await consumer.receive()
                                    if message is not None:
                                        await self._send.send((group, message))
                        finally:
                            self.consumers.pop(group, None)
                except DelaydTimeout as exc:  # could not join yet: its members are down
                    log.info("broker group %s: %s; trying again", group, exc)
                except DelaydError as exc:  # not retried (a refused subscription)
                    await self._send.send((group, exc))
                    return
                if not pump.stopped:
                    await anyio.sleep(REJOIN_S)
        finally:
            pump.done.set()

    async def _start(self, retry_first_connect: bool) -> None:
        """The first read of the registry, within ``timeout_s``; then the refreshes.
        Raises UnreachableError when etcd cannot be read and ``retry_first_connect``
        is false, DelaydTimeout when it could not be read in time."""
        problem: EtcdError | None = None
        with anyio.move_on_after(self.timeout_s) as scope:
            while True:
                try:
                    await self.refresh()
                    break
                except EtcdError as exc:
                    if not retry_first_connect:
                        raise UnreachableError(
                            f"cannot read the groups of {self.addr} from etcd: {exc}"
                        ) from None
                    problem = exc
                await anyio.sleep(min(1.0, self.refresh_s))
        if scope.cancelled_caught:
            raise DelaydTimeout(
                f"could not read the groups of {self.addr} within {self.timeout_s} s "
                f"(last problem: {problem})"
            )
        self._task_group.start_soon(self._refreshes)

    async def aclose(self, *, clean: bool = True) -> None:
        """Mark the current message processed (with ``clean``), stop every group's
        consumer and wait (up to ``timeout_s``) for them to commit and close."""
        if self._closed:
            return
        if clean:
            with anyio.move_on_after(self.timeout_s):
                await self._advance()
        self._closed = True
        for pump in self._pumps.values():
            pump.stop()
        with anyio.move_on_after(self.timeout_s):
            for pump in self._pumps.values():
                await pump.done.wait()


class _Pump:
    """One group's pump: whether it was told to stop, the scope of its reading, and
    when it is done."""

    def __init__(self) -> None:
        self.stopped = False
        self.done = anyio.Event()
        self._scope: anyio.CancelScope | None = None

    def reading(self) -> anyio.CancelScope:
        """A new scope for one consumer's reading (a scope is entered once)."""
        self._scope = anyio.CancelScope()
        if self.stopped:
            self._scope.cancel()
        return self._scope

    def stop(self) -> None:
        self.stopped = True
        if self._scope is not None:
            self._scope.cancel()


@asynccontextmanager
async def open_cluster_consumer(
    cluster: GroupAddress,
    open_group: OpenGroup,
    *,
    auto_commit: bool,
    sync_commits: bool,
    timeout_s: float,
    retry_first_connect: bool,
) -> AsyncIterator[ClusterConsumer]:
    """A ClusterConsumer that has read the registry once (see ``open_consumer``)."""
    async with background_task_group() as tg:
        consumer = ClusterConsumer(
            cluster,
            open_group,
            tg,
            auto_commit=auto_commit,
            sync_commits=sync_commits,
            timeout_s=timeout_s,
        )
        clean = False
        try:
            await consumer._start(retry_first_connect)
            yield consumer
            clean = True
        finally:
            with anyio.CancelScope(shield=True):
                await consumer.aclose(clean=clean)
