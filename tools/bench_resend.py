"""What the resend check costs a producer over a cluster (docs/cluster.md, "A resend of
the same id after the active set changed"): the client's CPU per id, and the HELD_IDS
round trip a batch pays for its moved ids while a change is recent.

Prints one JSON object per figure on stdout:
    {"bench": "resend", "metric": ..., "value": ..., "unit": ..., ...}

    python tools/bench_resend.py            # the figures of docs/benchmarks.md
    python tools/bench_resend.py --quick    # smaller (a few seconds)

Figures:
- ``check_cpu_per_id``, no change in the window (every call pays this: one pass over
  the registry entries, no id looked at), and after a group was added to two (every id
  ranked over the three groups; a third of them asked at their old owner);
- ``held_ids_round_trip`` and ``send_batch_round_trip``: one HELD_IDS of BATCH ids
  (held ones, then ids never sent) against one SEND_BATCH of BATCH new messages, each
  the median of ROUNDS sequential calls over one connection to a single ``delayd serve``
  (sync flush), from the blocking Producer.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import bench_common

from delayd.client._routing import DelayGroups, ResendCheck
from delayd.cluster.registry import GroupKind, GroupStatus, Registration
from tests.intake_support import ServeProcess

BATCH = 100
emit = bench_common.emitter("resend")


def registry(**changed_ms: int) -> DelayGroups:
    return DelayGroups.from_registry(
        {
            g: Registration(g, GroupKind.DELAY, GroupStatus.ACTIVE, ms, ms)
            for g, ms in changed_ms.items()
        }
    )


def emit_check_cost(count: int) -> None:
    ids = [f"order-{i}" for i in range(count)]
    cases = {
        "no change in the window": registry(d1=0, d2=0),
        "a group added to two": registry(d1=0, d2=0, d3=1_000),
    }
    for case, groups in cases.items():
        started = time.process_time()
        check = ResendCheck(ids, groups, since_ms=500)
        check.parts()
        seconds = time.process_time() - started
        asked = sum(map(len, check.asks.values()))
        emit("check_cpu_per_id", seconds / count * 1e6, "us", case=case, ids=count, asked=asked)


def median_ms(call: Callable[[int], object], rounds: int) -> float:
    took = []
    for number in range(rounds):
        started = time.perf_counter()
        call(number)
        took.append(time.perf_counter() - started)
    return statistics.median(took) * 1000


def emit_round_trips(rounds: int) -> None:
    import delayd

    with tempfile.TemporaryDirectory(prefix="bench-resend-") as work:
        server = ServeProcess(Path(work) / "d1", "--log-level", "warning").start()
        try:
            assert server.address is not None
            with delayd.Producer("{}:{}".format(*server.address)) as producer:

                def ids(number: int, prefix: str = "m") -> list[str]:
                    return [f"{prefix}{number}-{i}" for i in range(BATCH)]

                def send(number: int) -> None:
                    body, delay_ms = b"b" * 100, 3_600_000
                    producer.send_batch(
                        [{"subject": "s", "body": body, "message_id": i, "delay_ms": delay_ms}
                         for i in ids(number)]
                    )  # fmt: skip

                send_ms = median_ms(send, rounds)
                held_ms = median_ms(lambda number: producer.held(ids(number)), rounds)
                new_ms = median_ms(lambda number: producer.held(ids(number, "new")), rounds)
        finally:
            server.close()
    emit("send_batch_round_trip", send_ms, "ms", ids=BATCH, rounds=rounds)
    emit("held_ids_round_trip", held_ms, "ms", ids=BATCH, rounds=rounds, held=True)
    emit("held_ids_round_trip", new_ms, "ms", ids=BATCH, rounds=rounds, held=False)


def main() -> None:
    args = bench_common.bench_parser(__doc__, "smaller runs (a few seconds)").parse_args()
    bench_common.emit_host_speed(emit)
    emit_check_cost(100_000 if args.quick else 1_000_000)
    emit_round_trips(50 if args.quick else 500)


if __name__ == "__main__":
    main()
