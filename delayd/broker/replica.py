"""The broker as a member of a replicated group: its streams, and its follower's hooks.

A broker group ships its commitlog and its committed consumer offsets
(``BrokerStreams``); each member derives its consume queues, index and idempotency
window from the commitlog, and its offsets table from the offsets log, with the code a
restart uses (docs/replication.md, "Broker streams"). ``broker_streams(broker)`` gives
the streams of an open broker, wired so that its appends and fsyncs wake the leader;
``BrokerReplica`` gives a ``Follower`` the hooks that keep a following broker's derived
state in step with what it receives::

    streams = broker_streams(broker)
    history = EpochHistory.open(broker_epoch_history_path(data_dir))
    replica = BrokerReplica(broker)          # broker.follow() until replica.promote()
    follower = Follower(streams, history, group=..., member=..., leader=...,
                        on_truncated=replica.on_truncated, on_durable=replica.on_durable)
"""

from __future__ import annotations

import os

from delayd.broker.broker import Broker
from delayd.replication.streams import COMMITLOG, BrokerStreams


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


def broker_streams(broker: Broker) -> BrokerStreams:
    """The streams of ``broker`` (open), its appenders wired to their growth signal."""
    streams = BrokerStreams(CommitlogStream(broker), broker.offsets)
    broker.store.on_grew = streams.grew
    broker.offsets.on_grew = streams.grew
    return streams


class BrokerReplica:
    """A following broker: refuses sends and commits (``Broker.follow``) and derives
    from what replication delivers, until :meth:`promote`."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        broker.follow()

    async def on_durable(self, flushed: dict[str, int]) -> None:
        """Follower hook: records became durable; derive from them."""
        self.broker.apply_replicated()

    async def on_truncated(self, stream: str, offset: int) -> None:
        """Follower hook: ``stream`` was cut back to ``offset``. The commitlog's derived
        state was cut with it (CommitlogStream); the offsets table is rebuilt from the
        offsets log on disk, as ``OffsetStore.open`` builds it."""
        if stream != COMMITLOG:
            self.broker.offsets.reload()

    def promote(self) -> None:
        """The member leads now: everything received is derived, sends are accepted."""
        self.broker.promote()
