"""Idempotent intake in process: what deciding "new or held?" costs per message.

Prints one JSON object per figure on stdout:
    {"bench": "dedupe", "metric": ..., "value": ..., "unit": ..., ...}

    python tools/bench_dedupe.py            # 2,000,000 ids held
    python tools/bench_dedupe.py --quick    # 200,000 ids held (< 1 minute)

It fills a real data directory through the real intake path (Receiver + message_log +
replayer + id index, no fsync: the figures are CPU), then measures, on one CPU:

- ``check_new``: KnownIds.check + hold of new ids in batches of 100, the filter warm
  (the common case), per id;
- ``check_held``: a resend of a held id, settled by the id index (a lookup and a read);
- ``check_new_cold``: a new id while the filter is cold (after a start, before the
  warm-up: every id is looked up);
- ``warm_up``: building the filter from the index files (at start-up, and when it
  fills), per entry and in all;
- ``false_maybe_rate``: new ids the warm filter could not rule out.

The end-to-end figure — acknowledged intake before and after the check — is
``tools/bench_intake.py --repo`` run interleaved (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import bench_common

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from delayd.logs import layout, message_log
from delayd.logs.known_ids import KnownIds
from delayd.protocol import Message
from delayd.replay import open_replayer
from delayd.server.receiver import IntakeLimits, Receiver
from storage.fs import OsFileSystem
from storage.segmented_log import SegmentedLog

NOW = 1_795_341_600_000
BATCH = 1000
SAMPLE = 20_000


class NoSync(OsFileSystem):
    """The real file system without fsyncs: the figures are the CPU's."""

    def fsync(self, fd: int) -> None:
        pass

    def fdatasync(self, fd: int) -> None:
        pass

    def fsync_dir(self, path: str) -> None:
        pass


def fill(data: str, held: int) -> None:
    """``held`` messages through the real receiver, message_log and replayer."""
    fs = NoSync()
    log = SegmentedLog.open(layout.message_log_dir(data), fs=fs)
    replayer = open_replayer(data, log, segment_scale=1, fs=fs)
    # No idempotency check while filling: the ids are unique, the index is what counts.
    receiver = Receiver(IntakeLimits(max_replay_lag_records=10**9), 1)
    try:
        for start in range(0, held, BATCH):
            batch = [
                Message(f"held-{i}", "orders", body=b"b" * 100, delay_ms=i % 3_600_000)
                for i in range(start, min(start + BATCH, held))
            ]
            intake = receiver.accept(batch, NOW)
            offsets = log.append_batch(intake.payloads, message_log.TYPE_MESSAGE)
            replayer.offer(offsets, intake.payloads, (intake.due_ms, intake.message_ids, NOW))
            log.flush()
            replayer.replay_available()
        replayer.checkpoint()
    finally:
        replayer.close()
        log.close()


def per_id_us(ids: list[bytes], known: KnownIds) -> tuple[float, int]:
    """CPU per id of check (and hold, as intake does) in batches of 100, and how many
    of ``ids`` were found held."""
    found = 0
    started = time.process_time()
    for first in range(0, len(ids), 100):
        batch = ids[first : first + 100]
        dues = [NOW] * len(batch)
        held = known.check(batch, dues)
        if held is None:
            known.hold(batch, dues, first + len(batch))
        else:
            found += len(held)
    return (time.process_time() - started) / len(ids) * 1e6, found


def measure(data: str, held: int, emit) -> None:
    fs = NoSync()
    log = SegmentedLog.open(layout.message_log_dir(data), fs=fs)
    replayer = open_replayer(data, log, segment_scale=1, fs=fs)
    assert replayer.index is not None
    known = KnownIds(replayer.index)
    try:
        step = max(1, held // SAMPLE)
        resends = [f"held-{i}".encode() for i in range(0, held, step)]
        cold = [f"cold-{i}".encode() for i in range(SAMPLE // 4)]
        emit("check_new_cold", per_id_us(cold, known)[0], "us", held=held)

        started, cpu = time.perf_counter(), time.process_time()
        built = known.build_filter(known.begin_rebuild())
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        assert built is not None and built.added >= held
        assert known.finish_rebuild(built)
        emit("warm_up", seconds, "s", entries=built.added, filter_kib=built.size_bytes // 1024)
        emit("warm_up_cpu_per_entry", cpu / built.added * 1e9, "ns")

        new = [f"new-{i}".encode() for i in range(SAMPLE * 5)]
        lookups = known.lookups
        emit("check_new", per_id_us(new, known)[0], "us", held=held)
        emit("false_maybe_rate", (known.lookups - lookups) / len(new) * 100, "%", held=held)
        seconds_per_id, found = per_id_us(resends, known)
        emit("check_held", seconds_per_id, "us", held=held)
        assert found == len(resends), "a held id answered new"
    finally:
        replayer.close()
        log.close()
        known.close()


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "200,000 ids held (< 1 minute)")
    parser.add_argument("--held", type=int, help="ids held before measuring")
    args = parser.parse_args()
    held = args.held or (200_000 if args.quick else 2_000_000)
    emit = bench_common.emitter("dedupe")
    bench_common.emit_host_speed(emit)
    os.sched_setaffinity(0, {0})
    with tempfile.TemporaryDirectory(prefix="bench-dedupe-") as data:
        fill(data, held)
        measure(data, held, emit)


if __name__ == "__main__":
    main()
