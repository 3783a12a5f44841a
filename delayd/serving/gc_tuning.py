"""Garbage-collector settings for the long-running servers (``delayd broker``, ``delayd serve``).

The produce and intake paths make a few short-lived container objects per message
(Messages, tuples, SendResults) that almost all die with the batch that made them. With
CPython's default generation-0 threshold (700 net allocations of container objects) a
100-message batch starts collections in mid-batch, and each one scans the live batch
and promotes it, so later generations fill up and get scanned too. With GEN0_THRESHOLD
a batch's garbage is freed by reference counting before the count gets there; cyclic
garbage (rare here) waits a little longer. Measured: docs/benchmarks.md, "Broker".

``gc.freeze()`` after start-up moves what start-up built (modules, configuration, the
recovered state) to the permanent generation, so no later full collection walks it.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 10_000  # net container allocations between generation-0 collections


def tune_gc_for_serving() -> None:
    """Raise the generation-0 threshold and freeze what exists now. Call once, when
    start-up (recovery) is done and the server is about to take requests."""
    _, gen1, gen2 = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
