"""The blocking producer over every delay group of a cluster (``etcd://H:P/[CLUSTER/]*``):
what ``Producer(addr)`` makes for such an address (docs/cluster.md, "Routing by message
id"). As the async one (delayd.client._cluster_producer): one Producer per delay group,
opened on first use; the groups that may have owned a batch's ids before a change of
the active set asked first; a batch split by owner, the owners fixed for the call; a lookup by
id asks the owner first and every other registered delay group on UNKNOWN. The groups
of a call are asked at once: each group's part but the first in a thread of the
producer's pool (made on the first call that needs it, shut down by ``close``), so a
batch over N groups costs about one round trip, not N.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timedelta
from typing import Any, TypeVar

from delayd.client._cluster_view import ClusterView, read_delay_groups
from delayd.client._due import reschedule_due_ms
from delayd.client._messages import MAX_FRAME_MESSAGES, coerce_batch
from delayd.client._routing import RESEND_WINDOW_S, DelayGroups, Lookup, R
from delayd.client.blocking_producer import CLIENT_NAME, Producer
from delayd.client.cancel_receipt import CancelReceipt, RescheduleReceipt, check_message_ids
from delayd.client.receipt import Receipt
from delayd.errors import ConnectionClosedError, DelaydTimeout, EtcdError, UnreachableError
from delayd.group_address import parse_group_address
from delayd.protocol import Message
from delayd.timestamps import wall_ms
from delayd.tls import ClientTls

T = TypeVar("T")

# The most groups' parts of one call that run at once (more wait for a free thread):
# a thread each, blocked on its group's round trip.
MAX_PARALLEL_GROUPS = 16


class ClusterProducer(Producer):
    """A Producer over the cluster's delay groups; arguments as Producer's, each group's
    requests bounded by ``timeout_s`` (a DelaydTimeout names the group's address).
    ``connect`` reads the cluster's registry (and connects to no group yet)."""

    def __init__(
        self,
        addr: str,
        *,
        token: str | None = None,
        tls: ClientTls | None = None,
        timeout_s: float = 10.0,
        busy_retries: int = 5,
        max_frame_messages: int = MAX_FRAME_MESSAGES,
        max_in_flight: int = 8,
        client_name: str = CLIENT_NAME,
        retry_first_connect: bool = True,
        resend_window_s: float = RESEND_WINDOW_S,
    ) -> None:
        # Producer.__init__ is not called: it opens one session, and this holds one per
        # group, made with these options.
        self.view = ClusterView(parse_group_address(addr), resend_window_s)
        self.addr = addr
        self.timeout_s = timeout_s
        self.busy_retries = busy_retries
        self._retry_first_connect = retry_first_connect
        if tls is not None:
            tls.ssl_context  # noqa: B018  # its files read now: a TlsError names them
        self._options: dict[str, Any] = {
            "token": token,
            "tls": tls,
            "timeout_s": timeout_s,
            "busy_retries": busy_retries,
            "max_frame_messages": max_frame_messages,
            "max_in_flight": max_in_flight,
            "client_name": client_name,
            "retry_first_connect": retry_first_connect,
        }
        self._producers: dict[str, Producer] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def delay_groups(self) -> DelayGroups:
        """The cluster's delay groups, read again when the last read is old (in a trio
        run of its own, as BlockingSession's lookups). Raises UnreachableError when etcd
        was never read."""
        with self._lock:
            self._check_open()
            if not self.view.due(time.monotonic()):
                assert self.view.groups is not None
                return self.view.groups
            import trio

            try:
                groups = trio.run(read_delay_groups, self.view.target)
            except (EtcdError, ValueError) as exc:
                return self.view.read_failed(exc)
            return self.view.read(groups, time.monotonic())

    def group(self, name: str) -> Producer:
        """The producer of the delay group ``name`` (made on first use)."""
        with self._lock:
            self._check_open()
            producer = self._producers.get(name)
            if producer is None:
                producer = Producer(self.view.group_address(name), **self._options)
                self._producers[name] = producer
            return producer

    def connect(self) -> None:
        """Read the cluster's registry, retried until ``timeout_s`` unless
        ``retry_first_connect`` is False (UnreachableError, DelaydTimeout)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self.delay_groups()
                return
            except UnreachableError as exc:
                if not self._retry_first_connect:
                    raise
                if time.monotonic() >= deadline:
                    raise DelaydTimeout(f"{exc} (for {self.timeout_s} s)") from None
                time.sleep(0.2)

    def close(self) -> None:
        """Close every group's connection and the pool's threads (a part still running
        ends within its group's ``timeout_s``); later calls raise ConnectionClosedError."""
        with self._lock:
            self._closed = True
            producers = list(self._producers.values())
            pool, self._pool = self._pool, None
        for producer in producers:
            producer.close()
        if pool is not None:
            pool.shutdown(wait=True)

    def send_batch(
        self, messages: Iterable[Message | Mapping[str, Any] | tuple[str, bytes]]
    ) -> list[Receipt]:
        """As Producer.send_batch; UnreachableError when the cluster has no active delay
        group."""
        batch = coerce_batch(messages)
        if not batch:
            return []
        check = self.view.resend_check([m.message_id for m in batch], self.delay_groups())

        def ask(group: str, indexes: list[int]) -> list[int | None]:
            return self.group(group).held([batch[i].message_id for i in indexes])

        if check.asks:
            for group, due_ms in self._each(check.asks, ask).items():
                check.answered(group, check.asks[group], due_ms)
        receipts: dict[int, Receipt] = check.receipts()

        def part(group: str, indexes: list[int]) -> list[Receipt]:
            return self.group(group).send_batch([batch[i] for i in indexes])

        parts = check.parts()
        for group, got in self._each(parts, part).items():
            receipts.update(zip(parts[group], got, strict=True))
        return [receipts[index] for index in range(len(batch))]

    def held(self, message_ids: Iterable[str]) -> list[int | None]:
        """As Producer.held, across the cluster's delay groups (as the async one's)."""
        ids = check_message_ids(message_ids)
        groups = self.delay_groups()
        answers = self._each(
            {group: [] for group in groups.lookup}, lambda group, _: self.group(group).held(ids)
        )
        return groups.held(ids, answers)

    def cancel(self, message_id: str) -> CancelReceipt:
        """As Producer.cancel, across the cluster's delay groups."""
        (receipt,) = self.cancel_many([message_id])
        return receipt

    def cancel_many(self, message_ids: Iterable[str]) -> list[CancelReceipt]:
        """As Producer.cancel_many, across the cluster's delay groups."""
        ids = check_message_ids(message_ids)
        return self._lookup(ids, lambda group, some: self.group(group).cancel_many(some))

    def reschedule(
        self,
        message_id: str,
        *,
        at: datetime | None = None,
        delay: timedelta | None = None,
        at_ms: int | None = None,
        delay_ms: int | None = None,
    ) -> RescheduleReceipt:
        """As Producer.reschedule, across the cluster's delay groups (the new time is
        computed once, before the first group is asked)."""
        due_ms = reschedule_due_ms(wall_ms(), at, delay, at_ms, delay_ms)
        check_message_ids([message_id])

        def ask(group: str, ids: list[str]) -> list[RescheduleReceipt]:
            return [self.group(group).reschedule(ids[0], at_ms=due_ms)]

        (receipt,) = self._lookup([message_id], ask)
        return receipt

    def _lookup(self, ids: list[str], ask: Callable[[str, list[str]], list[R]]) -> list[R]:
        """``ask`` (group, ids) -> receipts, round by round as Lookup says."""
        if not ids:
            return []
        lookup: Lookup[R] = Lookup(ids, self.delay_groups())

        while asks := lookup.next_round():
            answers = self._each(asks, lambda group, indexes: ask(group, [ids[i] for i in indexes]))
            for group, receipts in answers.items():
                lookup.answered(asks[group], receipts)
        return lookup.receipts()

    def _each(
        self, parts: Mapping[str, list[int]], part: Callable[[str, list[int]], T]
    ) -> dict[str, T]:
        """``part`` for every group of ``parts`` at once, the first in this thread and
        the others in the pool's; its results by group, for the caller to take in this
        thread. Every part runs to its end (one group's failure does not stop
        another's), then the first error in ``parts``' order is raised as itself, and the
        registry is read again before the next call. A group's Producer is thread-safe,
        and its part is the only use of it in this call."""
        groups = list(parts)
        running = self._start(groups[1:], parts, part)
        results: dict[str, T] = {}
        errors: list[Exception] = []
        for group in groups:
            try:
                started = running.get(group)
                results[group] = part(group, parts[group]) if started is None else started.result()
            except Exception as exc:
                errors.append(exc)
        if errors:
            self.view.stale()
            raise errors[0]
        return results

    def _start(
        self,
        groups: list[str],
        parts: Mapping[str, list[int]],
        part: Callable[[str, list[int]], T],
    ) -> dict[str, Future[T]]:
        """``part`` of each of ``groups`` started in the pool (made on first use; under
        the lock, so ``close`` cannot shut it down in between)."""
        if not groups:
            return {}
        with self._lock:
            self._check_open()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    MAX_PARALLEL_GROUPS, thread_name_prefix="delayd-cluster-producer"
                )
            return {group: self._pool.submit(part, group, parts[group]) for group in groups}

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionClosedError("the producer is closed")
