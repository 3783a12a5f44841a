"""Blocking cluster producer benchmark: how long one blocking ``Producer``'s
``send_batch`` over a cluster of 2 single-member delay groups takes (p50, p99), and the
messages per second it is acknowledged, one call after another.

Prints one JSON object per figure on stdout:
    {"bench": "cluster_producer", "metric": ..., "value": ..., "unit": ..., ...}

    python tools/bench_cluster_producer.py           # the figures of docs/benchmarks.md
    python tools/bench_cluster_producer.py --quick   # fewer calls (< 1 minute)

Setup: tools/bench_routing.py's cluster ``two`` — one real etcd, delay groups d1 and d2
of one single-member each (pinned to CPU 0 and CPU 1, ``ack = leader``, the intake's
group commit fsyncing as by default). The producer runs in this process over the
cluster's address ``etcd://H:P/two/*``: each call sends BATCH new ids (about half owned
by each group), so each call has a part for both groups. A warm-up call first (the
connections to both leaders opened). Batches of 100 and of 1,000 messages.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import bench_common
from bench_routing import BODY, HOUR_MS, Cluster

from delayd.client import Producer
from delayd.protocol import Message, ResultCode
from tests.etcd_support import EtcdServer

emit = bench_common.emitter("cluster_producer")


def measure(address: str, batch: int, calls: int) -> None:
    """``calls`` send_batch calls of ``batch`` new ids each, one after another."""
    with Producer(address) as producer:
        producer.send_batch([(f"warm-{batch}-{i}", BODY) for i in range(batch)])
        latencies_ms = []
        acked = 0
        started = time.perf_counter()
        for call in range(calls):
            messages = [
                Message(f"b{batch}-c{call}-{i}", "orders", body=BODY, delay_ms=HOUR_MS)
                for i in range(batch)
            ]
            before = time.perf_counter()
            receipts = producer.send_batch(messages)
            latencies_ms.append((time.perf_counter() - before) * 1000)
            acked += sum(1 for r in receipts if r.code is ResultCode.OK)
        seconds = time.perf_counter() - started
        owners = {
            len(part)
            for part in producer.delay_groups().split([m.message_id for m in messages]).values()
        }
    percentiles = statistics.quantiles(latencies_ms, n=100)
    emit("send_batch_latency_p50", statistics.median(latencies_ms), "ms", batch=batch,
         calls=calls, p99_ms=round(percentiles[98], 2), groups=2,
         last_call_parts=sorted(owners))  # fmt: skip
    emit("acked_throughput", acked / seconds, "msg/s", batch=batch, calls=calls, groups=2)


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "fewer calls (< 1 minute)")
    args = parser.parse_args()
    bench_common.emit_host_speed(emit)
    calls = 50 if args.quick else 300
    with tempfile.TemporaryDirectory(prefix="bench-cluster-producer-") as work_dir:
        work = Path(work_dir)
        etcd = EtcdServer(work / "etcd").start()
        cluster = None
        try:
            cluster = Cluster(work, etcd, "two", {"d1": "0", "d2": "1"})
            cluster.leaders()  # both groups lead before the first call
            for batch in (100, 1000):
                measure(cluster.address, batch, calls)
        finally:
            if cluster is not None:
                cluster.close()
            etcd.stop()


if __name__ == "__main__":
    main()
