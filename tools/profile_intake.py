"""Where the delay server's intake time goes, stage by stage, in one process.

    python tools/profile_intake.py [--messages N] [--in-flight K] [--repeat R] [--cprofile]

Drives the intake path of ``delayd serve`` without sockets or the event loop, on a real
data directory: SEND_BATCH frames (100 messages of 100 bytes, delays spread over an hour
as in ``tools/bench_intake.py``) decoded by a server ``Connection``, validated and
encoded by the ``Receiver``, appended to message_log and offered to the replayer; every
``--in-flight`` frames message_log is flushed (outside the timings: the server fsyncs
in a worker thread), the replayer replays what is durable (bucket appends, id index,
the on_scheduled hook of a wheel manager that leaves every record to its loader) and
the answers are encoded. Prints the main thread's CPU time per message for each stage,
the best of ``--repeat`` runs — a steadier figure than wall-clock throughput on a
shared machine — and with ``--cprofile`` the top functions by own time.

Every figure is one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import tempfile
import time
from collections import defaultdict

BODY = b"x" * 100
BATCH = 100
HOUR_MS = 3_600_000
STAGES = ("decode", "accept", "append", "replay", "answer")


def emit(**figures: object) -> None:
    print(json.dumps(figures), flush=True)


def frames(count: int, seed: int) -> list[bytes]:
    from delayd.protocol import Message, SendBatch, encode_event

    rng = random.Random(seed)
    out = []
    for f in range(count):
        messages = [
            Message(f"m-{seed}-{f}-{i}", "orders", body=BODY, delay_ms=rng.randrange(HOUR_MS))
            for i in range(BATCH)
        ]
        out.append(encode_event(SendBatch(messages, request_id=f + 2)))
    return out


class LoaderLeavesAll:
    """The wheel manager's hook when nothing is loadable yet (every record far out):
    canAdd says no, and the load-window check reads the clock — what ``delayd serve``
    does for an hour of spread delays."""

    def __init__(self) -> None:
        from delayd.wheel.cursor import LoadCursors

        self.cursors = LoadCursors()
        self.now_ms = lambda: int(time.time() * 1000)
        self.calls = 0

    def on_scheduled(self, bucket_ms: int, offsets: list[int], dues: list[int]) -> None:
        self.calls += len(offsets)
        if bucket_ms > self.cursors.loading.bucket_ms:
            _ = bucket_ms <= self.now_ms() + 120_000


def run_once(
    messages: int, in_flight: int, profile: cProfile.Profile | None, dedupe: bool = True
) -> dict:
    from delayd.logs import layout
    from delayd.logs.known_ids import KnownIds
    from delayd.logs.message_log import TYPE_MESSAGE
    from delayd.protocol import SERVER, Connection, Hello, SendBatchResult
    from delayd.replay import open_replayer
    from delayd.server.receiver import IntakeLimits, Receiver
    from storage.segmented_log import SegmentedLog

    data = tempfile.mkdtemp(prefix="profile-intake-")
    log = SegmentedLog.open(layout.message_log_dir(data))
    hook = LoaderLeavesAll()
    replayer = open_replayer(data, log, segment_scale=1, on_scheduled=hook.on_scheduled)
    known_ids = None
    if dedupe:  # as delayd serve wires it, with the filter built (an empty index)
        known_ids = KnownIds(replayer.index)
        replayer.known = known_ids

        def rebuild() -> None:  # the server's _keep_id_filter, inline (in replay's time)
            plan = known_ids.begin_rebuild()
            assert known_ids.finish_rebuild(known_ids.build_filter(plan))

        rebuild()
        known_ids.on_full = rebuild
    receiver = Receiver(
        IntakeLimits(max_pending_acks=10**9, max_replay_lag_records=10**9),
        replayer.recovery.next_sequence,
        known_ids,
    )
    server = Connection(SERVER)
    from delayd.protocol import CLIENT

    client = Connection(CLIENT)
    server.receive_data(client.send(Hello(client_name="profile", request_id=1)))
    server.next_event()
    client.receive_data(server.send(server_hello_ok()))
    client.next_event()
    wire = frames(messages // BATCH, seed=1)
    spent: dict[str, float] = defaultdict(float)
    clock = time.thread_time
    if profile is not None:
        profile.enable()
    for first in range(0, len(wire), in_flight):
        intakes = []
        for frame in wire[first : first + in_flight]:
            t0 = clock()
            server.receive_data(frame)
            batch = server.next_event()
            t1 = clock()
            intake = receiver.accept(batch.messages, int(time.time() * 1000), encoded=batch.encoded)
            t2 = clock()
            offsets = log.append_batch(intake.payloads, TYPE_MESSAGE)
            if known_ids is not None:  # IntakePath.append holds them once appended
                known_ids.hold(intake.message_ids, intake.due_ms, intake.last_sequence)
            known = (intake.due_ms, intake.message_ids, intake.receive_ms)
            replayer.offer(offsets, intake.payloads, known)
            t3 = clock()
            intakes.append((batch.request_id, intake))
            spent["decode"] += t1 - t0
            spent["accept"] += t2 - t1
            spent["append"] += t3 - t2
        log.flush()
        t0 = clock()
        while replayer.replay_available(4096):
            pass
        t1 = clock()
        for request_id, intake in intakes:
            server.send(SendBatchResult(receiver.acknowledge(intake), request_id=request_id))
        t2 = clock()
        spent["replay"] += t1 - t0
        spent["answer"] += t2 - t1
    if profile is not None:
        profile.disable()
    assert hook.calls == messages, (hook.calls, messages)
    replayer.close()
    log.close()
    return {stage: spent[stage] / messages * 1e6 for stage in STAGES}


def server_hello_ok():
    from delayd.protocol import PROTOCOL_VERSION, HelloOk

    return HelloOk(PROTOCOL_VERSION, "profile", 16 * 1024 * 1024, request_id=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--in-flight", type=int, default=16, help="frames per flush")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--quick", action="store_true", help="100,000 messages, 2 runs")
    parser.add_argument(
        "--no-dedupe", action="store_true", help="without the idempotency check (A/B)"
    )
    args = parser.parse_args()
    if args.quick:
        args.messages, args.repeat = 100_000, 2
    best: dict[str, float] = {}
    for _ in range(args.repeat):
        stages = run_once(args.messages, args.in_flight, None, not args.no_dedupe)
        for stage, value in stages.items():
            best[stage] = min(best.get(stage, value), value)
    for stage in STAGES:
        emit(bench="profile_intake", metric=f"{stage}_cpu_per_message", value=round(best[stage], 3),
             unit="us", messages=args.messages, dedupe=not args.no_dedupe)  # fmt: skip
    emit(bench="profile_intake", metric="total_cpu_per_message", value=round(sum(best.values()), 3),
         unit="us", messages=args.messages, dedupe=not args.no_dedupe)  # fmt: skip
    if args.cprofile:
        profile = cProfile.Profile()
        run_once(args.messages, args.in_flight, profile, not args.no_dedupe)
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue(), file=__import__("sys").stderr)


if __name__ == "__main__":
    main()
