"""Cancel benchmark (issue 8): cancel throughput with the sync flush policy, and the
delay server's memory with many pending messages that could be cancelled.

- throughput: N messages due an hour out, then every one cancelled over one connection,
  CANCEL requests pipelined (a window of unanswered requests, as SEND_BATCH frames are
  pipelined in tools/bench_intake.py); cancels answered per second, each answer checked
  to be CANCELLED. Target >= 50,000/s.
- memory: P messages pending two days out (as the delivery benchmark's memory case),
  the server's VmRSS empty and with them replayed and indexed; then 10,000 of them
  (spread over all of them) cancelled, the rate and the RSS after. Target: RSS does not
  grow with P (the id index is on disk; a cancel reads it).

Prints one JSON object per figure on stdout, progress on stderr. ``--quick`` runs in
under a minute. The server runs on CPU 0, this client on CPU 1 (taskset).
"""

from __future__ import annotations

import os
import random
import tempfile
import time

import bench_common  # puts this checkout first on sys.path

import delayd
from delayd.bench.delivery import (
    CLIENT_CPU,
    Server,
    fill_far_pending,
    load_average,
    log,
    now_ms,
    rss_mb,
    send_all,
)
from delayd.protocol import Cancel, CancelOutcome, CancelResult

CANCELLED = CancelOutcome.CANCELLED

WINDOW = 512  # CANCEL requests in flight per connection


emit = bench_common.emitter("cancel")


def cancel_all(addr: str, ids: list[str], *, single: bool = False) -> float:
    """Cancel every id; returns the seconds it took. Raises unless every answer is
    CANCELLED. By default with ``Producer.cancel_many`` (CANCEL_BATCH frames of 1024
    ids, pipelined); ``single``: one CANCEL frame per id, a window of WINDOW pipelined
    (as SEND_BATCH frames are pipelined in tools/bench_intake.py)."""
    bad: list[object] = []
    with delayd.Producer(addr, timeout_s=600) as producer:
        started = time.perf_counter()
        if single:

            def on_answer(index: int, answer: object) -> None:
                if not isinstance(answer, CancelResult) or answer.outcome is not CANCELLED:
                    bad.append((ids[index], answer))

            deadline = time.monotonic() + 600
            link = producer._session.link(deadline)  # the bench drives the pipeline itself
            builds = [lambda rid, m=m: Cancel(m, request_id=rid) for m in ids]
            link.pipeline(builds, deadline, on_answer=on_answer, window=WINDOW)
        else:
            receipts = producer.cancel_many(ids)
            bad = [r for r in receipts if r.outcome is not CANCELLED]
        seconds = time.perf_counter() - started
    if bad:
        raise RuntimeError(f"{len(bad)} cancels not CANCELLED, first: {bad[0]}")
    return seconds


def bench_throughput(count: int, *, single: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-cancel-") as data:
        server = Server(data)
        server.start()
        try:
            base = int(now_ms()) + 3_600_000
            send_all(server.intake, range(count), lambda i: base + i % 600_000, "c")
            server.wait_replayed()
            load = load_average()
            ids = [f"c-{i}" for i in range(count)]
            log(f"throughput: cancelling {count:,} (server pid {server.pid})")
            seconds = cancel_all(server.intake, ids, single=single)
            emit("cancel_throughput", count / seconds, "cancels/s", target=">= 50000",
                 cancels=count, flush="sync", frames="CANCEL" if single else "CANCEL_BATCH",
                 load_average=load)  # fmt: skip
        finally:
            server.stop()


def bench_memory(pending: int, cancels: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-cancel-") as data:
        server = Server(data)
        server.start()
        try:
            rss_empty = rss_mb(server.pid)
            fill_far_pending(server, pending)
            rss = rss_mb(server.pid)
            emit("rss_with_pending", rss, "MB", pending=pending,
                 rss_empty_mb=round(rss_empty, 1), load_average=load_average())  # fmt: skip
            chosen = random.Random(8).sample(range(pending), min(cancels, pending))
            seconds = cancel_all(server.intake, [f"far-{i}" for i in chosen])
            emit("cancel_throughput_with_pending", len(chosen) / seconds, "cancels/s",
                 pending=pending, cancels=len(chosen), flush="sync")  # fmt: skip
            emit("rss_after_cancels", rss_mb(server.pid), "MB", pending=pending,
                 cancels=len(chosen))  # fmt: skip
        finally:
            server.stop()


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "smaller runs (< 1 minute)")
    parser.add_argument("--only", default="throughput,memory", help="throughput,memory")
    parser.add_argument("--cancels", type=int, help="messages for the throughput case")
    parser.add_argument("--pending", type=int, help="pending messages for the memory case")
    parser.add_argument("--single", action="store_true", help="one CANCEL frame per id")
    args = parser.parse_args()
    bench_common.emit_host_speed(emit)
    parts = set(args.only.split(","))
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > CLIENT_CPU:
        os.sched_setaffinity(0, {CLIENT_CPU})
    log(f"load average {load_average()}")
    if "throughput" in parts:
        bench_throughput(args.cancels or (20_000 if args.quick else 200_000), single=args.single)
    if "memory" in parts:
        bench_memory(args.pending or (100_000 if args.quick else 10_000_000), 10_000)


if __name__ == "__main__":
    main()
