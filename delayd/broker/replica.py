"""The broker as a member of a replicated group: what replication needs of it.

A broker group ships its commitlog and its committed consumer offsets (the
``BrokerStreams`` of delayd.replication); each member derives its consume queues, index
and idempotency window from the commitlog, and its offsets table from the offsets log,
with the code a restart uses (docs/replication.md, "Broker streams"). The process that
runs a member (it sits above both the broker and replication:
delayd/server/broker_member.py) wires them::

    replica = BrokerReplica(broker)
    streams = BrokerStreams(replica.commitlog, broker.offsets)
    replica.signal_growth(streams.grew)       # appends and fsyncs wake the leader
    # leading:   Leader(streams, history, epoch, group=...)
    # following: replica.follow(), then
    Follower(streams, history, group=..., member=..., leader=...,
             on_truncated=replica.on_truncated, on_durable=replica.on_durable)
    # promoted:  replica.promote()
"""

from __future__ import annotations

import os
from collections.abc import Callable

from delayd.broker.broker import Broker


def broker_epoch_history_path(data_dir: str) -> str:
    """Where a broker member keeps its epoch history (delayd.replication.epochs)."""
    return os.path.join(data_dir, "broker", "replication", "epochs")


class CommitlogStream:
    """The broker's commitlog as a stream: reads and appends are the log's own; a
    truncation cuts what the broker derived from the cut records first
    (``Broker.truncate_commitlog``), so no crash leaves it ahead of the log."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.log = broker.store.commitlog

    @property
    def end_offset(self) -> int:
        return self.log.end_offset

    @property
    def durable_offset(self) -> int:
        return self.log.durable_offset

    def read_raw(self, offset: int, max_bytes: int) -> bytes:
        return self.log.read_raw(offset, max_bytes)

    def append_raw(self, offset: int, data: bytes) -> int:
        return self.log.append_raw(offset, data)

    def flush(self) -> int:
        return self.log.flush()

    def truncate(self, offset: int) -> None:
        self.broker.truncate_commitlog(offset)

    def close(self) -> None:
        """The broker closes its commitlog."""


class BrokerReplica:
    """An open broker as a group member: its commitlog stream, the growth signal of its
    appenders, and the hooks a ``Follower`` calls while it follows."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.commitlog = CommitlogStream(broker)

    def signal_growth(self, grew: Callable[[], None]) -> None:
        """Have every append and fsync of the commitlog and the offsets log call
        ``grew`` (``StreamSet.grew``)."""
        self.broker.store.on_grew = grew
        self.broker.offsets.on_grew = grew

    def follow(self) -> None:
        """Refuse sends and commits (``Broker.follow``) and derive from what
        replication delivers, until :meth:`promote`."""
        self.broker.follow()

    async def on_durable(self, flushed: dict[str, int]) -> None:
        """Follower hook: records became durable; derive from them."""
        self.broker.apply_replicated()

    async def on_truncated(self, stream: str, offset: int) -> None:
        """Follower hook: a stream was cut back. The commitlog's derived state was cut
        with it (CommitlogStream); the offsets table is rebuilt from the offsets log on
        disk, as ``OffsetStore.open`` builds it (cheap: the log is compacted)."""
        self.broker.offsets.reload()

    def promote(self) -> None:
        """The member leads now: everything received is derived, sends are accepted."""
        self.broker.promote()
