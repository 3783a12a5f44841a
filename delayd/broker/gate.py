"""ReplicationGate: what a broker of a replicated group asks before it acknowledges a
store or a commit, and before it lets consumers see a record.

A broker group's leader (or the embedded broker of a delay group's leader) ships its
commitlog and its committed-offsets log to the followers (docs/replication.md, "Broker
streams"). Under ``ack = "sync"`` a store ack and an offset commit mean "the group has
it": the broker waits for the gate before it answers. Consumers see only what the group
acknowledged (Kafka's high watermark): the broker's reput, which makes records visible
to PULL and QUERY, never goes past ``commitlog_acked()``, and the process that wires
the gate calls ``Broker.high_watermark_moved`` when it moves, which wakes held PULLs.

The broker does not know replication (the layers: delayd.replication sits beside it);
the process that runs a member, above both, implements this for the member's streams.
"""

from __future__ import annotations

from typing import Protocol


class ReplicationGate(Protocol):
    def commitlog_acked(self) -> int:
        """The commitlog offset the group acknowledged: every record ending at or below
        it is the group's (the high watermark)."""
        ...

    async def wait_commitlog(self, offset: int) -> bool:
        """Return True once the group acknowledged the commitlog up to ``offset``;
        False as soon as this member no longer leads (the records may be cut: the
        answer is NOT_LEADER, never OK)."""
        ...

    async def wait_offsets(self, generation: int, offset: int) -> bool:
        """As ``wait_commitlog``, for the committed-offsets log's ``generation`` up to
        ``offset``; a generation compacted away meanwhile is covered by the snapshot
        that begins the newer one, which is then what is waited for."""
        ...
