"""Cluster audit benchmark: the audit of two delay groups of 10,000,000 records each on
a Spark standalone cluster of two workers (one core each), run with spark-submit.

Prints one JSON object per figure on stdout:
    {"bench": "cluster_audit", "metric": ..., "value": ..., "unit": ...}

    PYTHONPATH=. python tools/bench_cluster_audit.py            # docs/benchmarks.md
    PYTHONPATH=. python tools/bench_cluster_audit.py --quick    # 2 x 100,000 records

Each group's data directory is written by tools/bench_audit.py's generator (the
project's own writers; one day of one-minute buckets, every record dispatched once,
0..49 ms after its due time: the audit is clean), the two groups at once. The cluster
is pyspark's own master and workers (tests/spark_standalone.py), every process of it
killed at the end. Figures: wall time of spark-submit (driver JVM start included) and
of the application (its event log), and executor CPU per record — Spark's "Executor
CPU Time" (the JVM task threads only), and all the CPU the workers' executors and
their Python workers used (sampled from /proc), which is where a Python data source
decodes.
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import time
from pathlib import Path

import bench_common
from bench_audit import MINUTE, T0, generate, scratch

from tests.spark_standalone import event_log_conf, standalone_cluster, task_ends

JOB = str(bench_common.ROOT / "delayd" / "cli" / "spark_submit" / "audit_job.py")
GROUPS = ("g1", "g2")
NS_PER_US = 1000


def _generate(args: tuple[str, int, int, bytes]) -> int:
    return generate(*args)


def application_s(events: Path) -> float:
    """Seconds from the application's start to its end, by its event log."""
    times = {}
    for path in events.rglob("events_*"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["Event"] in ("SparkListenerApplicationStart", "SparkListenerApplicationEnd"):
                times[event["Event"]] = event["Timestamp"]
    return (times["SparkListenerApplicationEnd"] - times["SparkListenerApplicationStart"]) / 1000


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "2 x 100,000 records")
    parser.add_argument("--records", type=int, default=None, help="per group")
    parser.add_argument("--executor-memory", default="2g")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args()
    emit = bench_common.emitter("cluster_audit")
    bench_common.emit_host_speed(emit)
    records = args.records or (100_000 if args.quick else 10_000_000)
    buckets = min(120 if args.quick else 1440, records)
    with scratch("bench-cluster-audit-", args.keep) as scratch_dir:
        run(Path(scratch_dir), records, buckets, args.executor_memory, emit)


def run(root: Path, records: int, buckets: int, executor_memory: str, emit) -> None:
    """Generate the groups' logs under ``root``, start the cluster, audit, emit."""
    dirs = {group: str(root / group) for group in GROUPS}
    started = time.monotonic()
    with multiprocessing.Pool(len(GROUPS)) as pool:
        sizes = pool.map(
            _generate, [(d, records, buckets, f"{g}-".encode()) for g, d in dirs.items()]
        )
    emit("generate_s", time.monotonic() - started, "s", records=records, groups=len(GROUPS))
    emit("data_bytes", sum(sizes), "bytes")
    events = root / "events"
    conf = {
        "spark.ui.enabled": "false",
        "spark.driver.memory": "2g",
        "spark.executor.memory": executor_memory,
        **event_log_conf(events),
    }
    data = [arg for group, d in dirs.items() for arg in ("--data", f"{group}={d}")]
    as_of_ms = T0 + (buckets + 60) * MINUTE
    command = [*data, "--out", str(root / "out"), "--as-of", str(as_of_ms)]
    with standalone_cluster(root / "cluster", workers=2, cores=1, memory="3g") as cluster:
        emit("cluster_workers", cluster.alive_workers(), "workers", cores_each=1)
        started = time.monotonic()
        with cluster.executor_cpu() as cpu:
            done = cluster.submit(JOB, *command, conf=conf, timeout_s=3600)
        wall_s = time.monotonic() - started
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"spark-submit exited {done.returncode}")
    total = len(GROUPS) * records
    ends = task_ends(events)
    jvm_ns = sum(end["Task Metrics"]["Executor CPU Time"] for end in ends)
    emit("spark_submit_s", wall_s, "s", records=total, exit_status=done.returncode)
    emit("application_s", application_s(events), "s")
    emit("tasks", len(ends), "tasks")
    emit("executor_cpu_us_per_record", cpu.seconds * 1e6 / total, "us", what="JVM + Python")
    emit("executor_jvm_cpu_us_per_record", jvm_ns / NS_PER_US / total, "us")
    emit("records_per_s", total / wall_s, "records/s")


if __name__ == "__main__":
    main()
