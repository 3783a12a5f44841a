"""The blocking consumer of a whole cluster (``etcd://H:P/[CLUSTER/]*``): the async one
(delayd.client._cluster_consumer) run on trio in a thread of its own, called through an
anyio blocking portal.

Reading many broker groups at once, and picking up new ones while the user's code runs,
needs tasks; threads of blocking consumers, one per group, would redo in threads what
the async consumer does in tasks. ``delayd.Consumer`` returns one of these for an
address naming every group.
"""

from __future__ import annotations

import contextlib
from typing import Any, Self

from anyio.from_thread import BlockingPortal, start_blocking_portal

from delayd.client._cluster_consumer import ClusterConsumer
from delayd.client._consumer_state import COMMIT_MODES
from delayd.errors import ConnectionClosedError
from delayd.protocol import Message


class BlockingClusterConsumer:
    """``delayd.Consumer`` for ``etcd://H:P/[CLUSTER/]*``, with the same methods:
    ``connect`` (or ``with``), ``receive``, iteration, ``commit``, ``close``.
    ``options`` are open_consumer's."""

    def __init__(self, addr: str, **options: Any) -> None:
        from delayd.client.async_consumer import open_consumer

        commit = options.get("commit", "periodic")
        if commit not in COMMIT_MODES:
            raise ValueError(f"commit must be one of {', '.join(COMMIT_MODES)}, not {commit!r}")
        self.addr = addr
        self.timeout_s = options.get("timeout_s", 10.0)
        self._opening = lambda: open_consumer(addr, **options)
        self._portal_cm: contextlib.AbstractContextManager[BlockingPortal] | None = None
        self._portal: BlockingPortal | None = None
        self._consumer_cm: contextlib.AbstractContextManager[ClusterConsumer] | None = None
        self._consumer: ClusterConsumer | None = None
        self._closed = False

    @property
    def groups(self) -> list[str]:
        """The broker groups read now."""
        return self._consumer.groups if self._consumer is not None else []

    @property
    def queues(self) -> dict[str, tuple[int, ...]]:
        """The queues each broker group assigns to this consumer, by group."""
        return self._consumer.queues if self._consumer is not None else {}

    def connect(self) -> None:
        """Read the cluster's groups and start reading them (UnreachableError,
        DelaydTimeout as open_consumer)."""
        if self._closed:
            raise ConnectionClosedError("the consumer is closed")
        if self._consumer is not None:
            return
        self._portal_cm = start_blocking_portal("trio")
        self._portal = self._portal_cm.__enter__()
        try:
            self._consumer_cm = self._portal.wrap_async_context_manager(self._opening())
            self._consumer = self._consumer_cm.__enter__()
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            self._portal = self._portal_cm = None
            raise

    def receive(self, timeout_s: float | None = None) -> Message | None:
        """As ClusterConsumer.receive."""
        self.connect()
        assert self._portal is not None and self._consumer is not None
        return self._portal.call(self._consumer.receive, timeout_s)

    def commit(self, message: Message) -> None:
        """As ClusterConsumer.commit."""
        self.connect()
        assert self._portal is not None and self._consumer is not None
        self._portal.call(self._consumer.commit, message)

    def close(self, *, clean: bool = True) -> None:
        """Commit what was processed (with ``clean``, the current message too), close."""
        if self._closed:
            return
        self._closed = True
        if self._consumer_cm is None or self._portal_cm is None:
            return
        try:
            error = None if clean else RuntimeError("closed after an error")
            self._consumer_cm.__exit__(type(error) if error else None, error, None)
        except RuntimeError:
            pass  # the error handed in to say "not clean", raised again
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> Self:
        self.connect()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self.close(clean=exc_type is None)

    def __iter__(self) -> BlockingClusterConsumer:
        return self

    def __next__(self) -> Message:
        message = self.receive()
        assert message is not None
        return message
