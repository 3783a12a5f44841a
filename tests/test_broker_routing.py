"""Queue selection: by key hash when a key is set, else round-robin per subject."""

from __future__ import annotations

import xxhash

from delayd.broker.routing import QueueSelector, key_hash


def test_keyed_messages_go_to_the_xxh64_queue_always():
    selector = QueueSelector()
    for key in ("order-1", "order-2", "客户-9", ""):
        expected = xxhash.xxh64_intdigest(key.encode()) % 4
        assert key_hash(key) == xxhash.xxh64_intdigest(key.encode())
        assert {selector.select("orders", key, 4) for _ in range(10)} == {expected}


def test_unkeyed_messages_round_robin_per_subject():
    selector = QueueSelector()
    assert [selector.select("a", None, 3) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [selector.select("b", None, 2) for _ in range(3)] == [0, 1, 0]
    selector.select("a", "k", 3)  # keyed messages do not advance the turn
    assert selector.select("a", None, 3) == 1


def test_keys_spread_over_queues():
    selector = QueueSelector()
    counts = [0] * 8
    for i in range(8000):
        counts[selector.select("s", f"key-{i}", 8)] += 1
    assert min(counts) > 800
