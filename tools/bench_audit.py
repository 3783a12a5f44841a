"""Audit benchmark: `delayd audit` over 10,000,000 scheduled and 10,000,000 dispatched
records on local[2], and the records/s of the data sources alone — the public ones, and
delayd.reconciled, which is what the audit reads (both logs, paired and judged per
bucket).

Prints one JSON object per figure on stdout:
    {"bench": "audit", "metric": ..., "value": ..., "unit": ...}

    python tools/bench_audit.py            # the figures of docs/benchmarks.md
    python tools/bench_audit.py --quick    # 100,000 + 100,000 records (< 1 minute)

The data directory is written in a temporary directory by the project's own writers
(BucketFiles.append_batch with the schedule_log and dispatch_log codecs): one day of
one-minute buckets, every record dispatched once, 0..49 ms after its due time, so the
audit is clean. message_log is left out, as after retention.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from delayd.logs import layout
from delayd.logs.bucket_files import BucketFiles
from delayd.logs.dispatch_log import EntryKind, encode_entry
from delayd.logs.message_log import encode_message
from delayd.logs.schedule_log import encode_scheduled

T0 = 1_795_341_600_000  # 2026-11-22T10:00:00Z
MINUTE = 60_000
BODY = b"b" * 64
SUBJECT = b"orders.timeout"
GROUP = b"default"


def emit(metric: str, value: float, unit: str, **extra: object) -> None:
    print(
        json.dumps(
            {"bench": "audit", "metric": metric, "value": round(value, 3), "unit": unit, **extra}
        ),
        flush=True,
    )


@contextlib.contextmanager
def scratch(prefix: str, keep: bool) -> Iterator[str]:
    """A temporary directory for one run, removed at the end unless ``keep`` (then its
    path is printed on stderr)."""
    root = tempfile.mkdtemp(prefix=prefix)
    try:
        yield root
    finally:
        if keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


def generate(data_dir: str, records: int, buckets: int, id_prefix: bytes = b"") -> int:
    """``records`` SCHEDULED records over ``buckets`` one-minute buckets and one
    DISPATCHED entry each, their ids ``id_prefix`` and a 20-digit sequence (give each
    group of a cluster its own prefix: one id in two groups is two messages); returns
    the bytes written."""
    per_bucket = records // buckets
    sequence = 0
    schedule = BucketFiles(layout.schedule_log_dir(data_dir), max_open=2)
    dispatch = BucketFiles(layout.dispatch_log_dir(data_dir), max_open=2)
    try:
        for bucket in range(buckets):
            start = T0 + bucket * MINUTE
            count = per_bucket + (1 if bucket < records % buckets else 0)
            dues = [start + i * MINUTE // count for i in range(count)]
            payloads = []
            for due in dues:
                sequence += 1
                message = encode_message(
                    due,
                    sequence,
                    due - MINUTE,
                    id_prefix + b"%020d" % sequence,
                    SUBJECT,
                    None,
                    b"",
                    BODY,
                )
                payloads.append(encode_scheduled(sequence * 160, message))
            offsets = schedule.append_batch(start, payloads)
            entries = [
                encode_entry(offset, due + i % 50, GROUP)
                for i, (offset, due) in enumerate(zip(offsets, dues, strict=True))
            ]
            dispatch.append_batch(start, entries, EntryKind.DISPATCHED)
    finally:
        schedule.close()
        dispatch.close()
    return sum(
        os.path.getsize(os.path.join(directory, name))
        for directory in (layout.schedule_log_dir(data_dir), layout.dispatch_log_dir(data_dir))
        for name in os.listdir(directory)
    )


def source_throughput(
    data_dir: str, records: int, master: str, warm_up: bool, as_of_ms: int
) -> None:
    """Each data source alone, every column, into Spark's noop sink: decode, Arrow, JVM,
    nothing else. delayd.reconciled reads both logs: its records/s are schedule_log
    records (each with its dispatch_log entry) judged."""
    from delayd.audit.config import DEFAULT_GRACE_MS, DEFAULT_LATE_MS
    from delayd.audit.spark.session import local_session

    spark = local_session(master)
    readers = {log: spark.read.format(f"delayd.{log}") for log in ("schedule_log", "dispatch_log")}
    readers["reconciled"] = (
        spark.read.format("delayd.reconciled")
        .option("cutoffMs", str(as_of_ms - DEFAULT_GRACE_MS))
        .option("lateMs", str(DEFAULT_LATE_MS))
    )
    try:
        for log, reader in readers.items():
            frame = reader.load(data_dir)
            if warm_up:
                frame.write.format("noop").mode("overwrite").save()
            started = time.monotonic()
            frame.write.format("noop").mode("overwrite").save()
            seconds = time.monotonic() - started
            emit(
                f"source_{log}_records_per_s",
                records / seconds,
                "records/s",
                master=master,
                warm=warm_up,  # --quick measures one cold run: worker start-up included
            )
    finally:
        spark.stop()


def decode_throughput(data_dir: str, records: int) -> None:
    """The decoders alone, one Python process, no Spark: the ceiling of one task."""
    from delayd.audit.read.dispatch import dispatch_batches
    from delayd.audit.read.messages import schedule_batches
    from delayd.logs import log_files

    for log, decode in (("schedule_log", schedule_batches), ("dispatch_log", dispatch_batches)):
        started = time.monotonic()
        rows = 0
        for log_file in log_files.list_files(data_dir, log):
            for batch in decode(log_file, "bench"):
                rows += batch.num_rows
        seconds = time.monotonic() - started
        assert rows == records, (log, rows)
        emit(f"decode_{log}_records_per_s_one_core", rows / seconds, "records/s")


def end_to_end(data_dir: str, out: str, master: str, as_of_ms: int) -> None:
    """`delayd audit` as an operator runs it: a fresh process, JVM start included."""
    command = [sys.executable, "-m", "delayd", "audit", "--data", data_dir, "--out", out]
    command += ["--master", master, "--as-of", str(as_of_ms)]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"delayd audit exited {done.returncode}")
    emit("end_to_end_s", seconds, "s", master=master, exit_status=done.returncode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100,000 + 100,000 records")
    parser.add_argument("--records", type=int, default=None)
    parser.add_argument("--buckets", type=int, default=None, help="one-minute buckets")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()
    records = args.records or (100_000 if args.quick else 10_000_000)
    buckets = min(args.buckets or (120 if args.quick else 1440), records)
    with scratch("bench-audit-", args.keep) as root:
        data_dir, out = os.path.join(root, "data"), os.path.join(root, "out")
        started = time.monotonic()
        size = generate(data_dir, records, buckets)
        emit("generate_s", time.monotonic() - started, "s", records=records, buckets=buckets)
        emit("data_bytes", size, "bytes")
        as_of_ms = T0 + (buckets + 60) * MINUTE
        end_to_end(data_dir, out, args.master, as_of_ms)
        source_throughput(data_dir, records, args.master, not args.quick, as_of_ms)
        decode_throughput(data_dir, records)


if __name__ == "__main__":
    main()
