"""Which queue of its subject a message goes to.

With a key: ``xxh64(key) % queues``, so every message of one key lands in one queue and
is consumed in order (RocketMQ's SelectMessageQueueByHash, with a hash that does not
change between runs). Without: round-robin per subject, spreading load evenly
(RocketMQ's default selector).
"""

from __future__ import annotations

import xxhash


def key_hash(key: str) -> int:
    """The u64 hash of a key: xxh64 of its UTF-8 bytes, seed 0."""
    return xxhash.xxh64_intdigest(key.encode())


class QueueSelector:
    """Round-robin counters per subject; keyed messages need no state."""

    def __init__(self) -> None:
        # subject -> the round-robin turn of its next keyless message (Broker.append_batch
        # inlines select's keyless branch on these)
        self.turns: dict[str, int] = {}

    def select(self, subject: str, key: str | None, queues: int) -> int:
        """The queue in ``range(queues)`` for a message of ``subject`` with ``key``."""
        if key is not None:
            return key_hash(key) % queues
        turn = self.turns.get(subject, 0)
        self.turns[subject] = turn + 1
        return turn % queues
