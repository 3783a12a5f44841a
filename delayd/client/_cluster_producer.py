"""The async producer over every delay group of a cluster (``etcd://H:P/[CLUSTER/]*``),
made by ``open_producer`` for such an address (docs/cluster.md, "Routing by message id").

One AsyncProducer per delay group, over the group's own ``etcd://`` address (its leader
found and followed as for any group), opened on first use. A batch is split by owner
(delayd.client._routing) and the parts are sent at once; the receipts come back in the
caller's order. The owners are fixed when the call starts: a part is retried, by its
group's producer, only at that group, even if the registry changes meanwhile.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

import anyio
import anyio.abc

from delayd.client._async_session import AsyncSession
from delayd.client._cluster_view import ClusterView, read_delay_groups
from delayd.client._due import reschedule_due_ms
from delayd.client._messages import coerce_batch
from delayd.client._routing import RESEND_WINDOW_S, DelayGroups, Lookup, R
from delayd.client._task_group import run_all
from delayd.client.async_producer import AsyncProducer
from delayd.client.cancel_receipt import CancelReceipt, RescheduleReceipt, check_message_ids
from delayd.client.receipt import Receipt
from delayd.errors import ConnectionClosedError, EtcdError
from delayd.group_address import GroupAddress
from delayd.protocol import Message
from delayd.timestamps import wall_ms


class AsyncClusterProducer(AsyncProducer):
    """An AsyncProducer whose messages are spread over the cluster's active delay
    groups by id; ``send`` and ``send_batch`` as AsyncProducer's (an id a group that
    may have owned it before a change of the active set holds is answered DUPLICATE
    without a send: docs/cluster.md), ``cancel``,
    ``cancel_many`` and ``reschedule`` ask the id's owner first and every other
    registered delay group on UNKNOWN. Each group's requests are bounded by
    ``timeout_s`` (a DelaydTimeout names the group's address)."""

    def __init__(
        self,
        target: GroupAddress,
        *,
        task_group: anyio.abc.TaskGroup,
        timeout_s: float,
        busy_retries: int,
        retry_first_connect: bool = True,
        resend_window_s: float = RESEND_WINDOW_S,
        **session_options: Any,
    ) -> None:
        """``session_options``: AsyncSession's (token, client_name, tls), for every
        group. ``resend_window_s``: as open_producer's."""
        # AsyncProducer.__init__ is not called: it takes one session, and this holds one
        # per group, made with ``session_options``.
        tls = session_options.get("tls")
        if tls is not None:
            tls.ssl_context  # noqa: B018  # its files read now: a TlsError names them
        self.view = ClusterView(target, resend_window_s)
        self.addr = str(target)
        self.timeout_s = timeout_s
        self.busy_retries = busy_retries
        self._task_group = task_group
        self._retry_first_connect = retry_first_connect
        self._session_options = session_options
        self._producers: dict[str, AsyncProducer] = {}
        self._lock = anyio.Lock()
        self._closed = False

    async def delay_groups(self) -> DelayGroups:
        """The cluster's delay groups, read again when the last read is old. Raises
        UnreachableError when etcd was never read."""
        async with self._lock:
            if self.view.due(anyio.current_time()):
                try:
                    groups = await read_delay_groups(self.view.target)
                except (EtcdError, ValueError) as exc:
                    return self.view.read_failed(exc)
                return self.view.read(groups, anyio.current_time())
            assert self.view.groups is not None
            return self.view.groups

    def group(self, name: str) -> AsyncProducer:
        """The producer of the delay group ``name`` (made on first use)."""
        producer = self._producers.get(name)
        if producer is None:
            session = AsyncSession(
                self.view.group_address(name),
                task_group=self._task_group,
                **self._session_options,
            )
            session.retry_first_connect = self._retry_first_connect
            producer = AsyncProducer(
                session, timeout_s=self.timeout_s, busy_retries=self.busy_retries
            )
            self._producers[name] = producer
        return producer

    async def send_batch(
        self, messages: Iterable[Message | Mapping[str, Any] | tuple[str, bytes]]
    ) -> list[Receipt]:
        """As AsyncProducer.send_batch; UnreachableError when the cluster has no active
        delay group."""
        batch = coerce_batch(messages)
        self._check_open()
        if not batch:
            return []
        check = self.view.resend_check([m.message_id for m in batch], await self.delay_groups())

        async def ask(group: str, indexes: list[int]) -> None:
            due_ms = await self.group(group).held([batch[i].message_id for i in indexes])
            check.answered(group, indexes, due_ms)

        if check.asks:
            await self._each(check.asks, ask)
        receipts: dict[int, Receipt] = check.receipts()

        async def part(group: str, indexes: list[int]) -> None:
            got = await self.group(group).send_batch([batch[i] for i in indexes])
            receipts.update(zip(indexes, got, strict=True))

        await self._each(check.parts(), part)
        return [receipts[index] for index in range(len(batch))]

    async def held(self, message_ids: Iterable[str]) -> list[int | None]:
        """As AsyncProducer.held, across the cluster's active and draining delay groups
        (each asked once, all at once; an id's answer is its owner's, else the first
        other group's that holds it)."""
        ids = check_message_ids(message_ids)
        self._check_open()
        groups = await self.delay_groups()
        answers: dict[str, list[int | None]] = {}

        async def ask(group: str, _: list[int]) -> None:
            answers[group] = await self.group(group).held(ids)

        await self._each({group: [] for group in groups.lookup}, ask)
        return groups.held(ids, answers)

    async def cancel(self, message_id: str) -> CancelReceipt:
        """As AsyncProducer.cancel, across the cluster's delay groups."""
        (receipt,) = await self.cancel_many([message_id])
        return receipt

    async def cancel_many(self, message_ids: Iterable[str]) -> list[CancelReceipt]:
        """As AsyncProducer.cancel_many, across the cluster's delay groups."""
        ids = check_message_ids(message_ids)
        return await self._lookup(ids, lambda group, some: self.group(group).cancel_many(some))

    async def reschedule(
        self,
        message_id: str,
        *,
        at: datetime | None = None,
        delay: timedelta | None = None,
        at_ms: int | None = None,
        delay_ms: int | None = None,
    ) -> RescheduleReceipt:
        """As AsyncProducer.reschedule, across the cluster's delay groups (the new time
        is computed once, before the first group is asked)."""
        due_ms = reschedule_due_ms(wall_ms(), at, delay, at_ms, delay_ms)
        check_message_ids([message_id])

        async def ask(group: str, ids: list[str]) -> list[RescheduleReceipt]:
            return [await self.group(group).reschedule(ids[0], at_ms=due_ms)]

        (receipt,) = await self._lookup([message_id], ask)
        return receipt

    async def _lookup(
        self, ids: list[str], ask: Callable[[str, list[str]], Awaitable[list[R]]]
    ) -> list[R]:
        """``ask`` (group, ids) -> receipts, round by round as Lookup says."""
        self._check_open()
        if not ids:
            return []
        lookup: Lookup[R] = Lookup(ids, await self.delay_groups())

        async def part(group: str, indexes: list[int]) -> None:
            lookup.answered(indexes, await ask(group, [ids[i] for i in indexes]))

        while asks := lookup.next_round():
            await self._each(asks, part)
        return lookup.receipts()

    async def _each(
        self,
        parts: Mapping[str, list[int]],
        part: Callable[[str, list[int]], Awaitable[None]],
    ) -> None:
        """``part`` for every group of ``parts`` at once; every part runs to its end
        (one group's failure does not stop another's), then the first error is raised
        as itself, and the registry is read again before the next call."""
        jobs = [functools.partial(part, group, indexes) for group, indexes in parts.items()]
        try:
            await run_all(jobs, stop_on_error=False)
        except Exception:
            self.view.stale()
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionClosedError("the producer is closed")

    async def aclose(self) -> None:
        """Close every group's connection; later calls raise ConnectionClosedError."""
        self._closed = True
        for producer in self._producers.values():
            await producer.aclose()
