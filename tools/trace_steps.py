"""Where a delivery's CPU goes, counted in event-loop steps (issue 5's lateness).

Runs ``delayd serve`` as ``delayd bench`` does (pinned to CPU 0, the consumer here on
CPU 1), schedules ``rate`` messages a second due over a window, and while they are
delivered records every step of the server's trio loop with a trio Instrument: which
task ran, and the process CPU time (``CLOCK_PROCESS_CPUTIME_ID``, all threads) when
each step began. The instrument is loaded into the server by a ``sitecustomize`` on
its PYTHONPATH and switched on and off with SIGUSR1 / SIGUSR2, so the server's code is
the code under test, unchanged.

On this project's VM a step of the loop costs 100-400 µs of CPU at a few hundred
deliveries a second, far above the same step run hot (~12 µs): the cost per message
follows the number of steps per message more than the work done in them
(docs/benchmarks.md, "2026-11-25 evening"). Figures, one JSON object each:
``cpu_per_message`` (the whole process, from ``/proc/PID/schedstat``),
``steps_per_message``, ``loop_iterations_per_message``, and per task
``task_steps_per_message`` / ``task_step_cpu_median``.

    .venv/bin/python tools/trace_steps.py [--quick] [--rates 200,1000] [--seconds 5]
"""

from __future__ import annotations

import itertools
import os
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import bench_common  # puts this checkout first on sys.path

import delayd
from delayd.bench import delivery as bd

emit = bench_common.emitter("trace_steps")
CHECKOUT = Path(__file__).resolve().parent.parent  # its delayd serves

SITECUSTOMIZE = """\
import os, signal, time
_out = os.environ.get("DELAYD_STEP_TRACE")
if _out:
    _events = []
    class _Steps:
        def before_task_step(self, task):
            _events.append(("task", task.name, time.process_time_ns()))
        def before_io_wait(self, timeout):
            _events.append(("wait", repr(timeout), time.process_time_ns()))
    _steps = _Steps()
    def _on(signum, frame):
        import trio
        trio.lowlevel.add_instrument(_steps)
    def _off(signum, frame):
        import trio
        trio.lowlevel.remove_instrument(_steps)
        _events.append(("end", "", time.process_time_ns()))
        with open(_out, "w") as f:
            f.writelines(f"{k}\\t{name}\\t{ns}\\n" for k, name, ns in _events)
    signal.signal(signal.SIGUSR1, _on)
    signal.signal(signal.SIGUSR2, _off)
"""


def schedstat_seconds(pid: int) -> float:
    """CPU time of every live thread of ``pid`` (ns-precise, unlike /proc/PID/stat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except FileNotFoundError:
            continue  # a thread that ended meanwhile
    return total / 1e9


def task_label(name: str) -> str:
    """``Class.method`` of a task's qualified name (``Class.method.<locals>.inner``
    for a nested function)."""
    parts = name.split(".")
    return ".".join(parts[-4:] if "<locals>" in parts else parts[-2:])


def read_trace(path: Path) -> list[tuple[str, str, int]]:
    out = []
    for line in path.read_text().splitlines():
        kind, name, ns = line.split("\t")
        out.append((kind, name, int(ns)))
    return out


def trace_rate(rate: int, seconds: int, workdir: Path) -> None:
    trace = workdir / f"steps-{rate}.tsv"
    count = rate * seconds
    os.environ["DELAYD_STEP_TRACE"] = str(trace)
    with tempfile.TemporaryDirectory(prefix="trace-steps-", dir=workdir) as data:
        server = bd.Server(data)
        server.start()
        try:
            with delayd.Consumer(server.broker, subject=bd.SUBJECT, group="steps",
                                 max_messages=1000, pull_wait_ms=1000) as consumer:  # fmt: skip
                start = int(bd.now_ms()) + 3000
                step_ms = seconds * 1000 / count
                bd.send_all(server.intake, range(count), lambda i: start + int(i * step_ms), "s")
                time.sleep(max(0.0, (start - bd.now_ms()) / 1000))
                cpu_before = schedstat_seconds(server.pid)
                os.kill(server.pid, signal.SIGUSR1)
                got = bd.consume(server.broker, consumer, count, start + seconds * 1000 + 5000)
                os.kill(server.pid, signal.SIGUSR2)
                cpu = schedstat_seconds(server.pid) - cpu_before
                deadline = time.monotonic() + 10
                while not trace.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)  # the server writes it on SIGUSR2
        finally:
            server.stop()
    if len(got) < count:
        raise SystemExit(f"only {len(got)} of {count} messages were delivered")
    events = read_trace(trace)
    step_cpu: dict[str, list[float]] = defaultdict(list)
    iterations = 0
    for (kind, name, ns), (_, _, next_ns) in itertools.pairwise(events):
        if kind == "task":
            step_cpu[task_label(name)].append((next_ns - ns) / 1000)
        elif kind == "wait":
            iterations += 1
    steps = sum(len(v) for v in step_cpu.values())
    common = {"rate_per_s": rate, "seconds": seconds, "messages": count}
    emit("cpu_per_message", cpu / count * 1e6, "us", what="whole server process", **common)
    emit("steps_per_message", steps / count, "steps", **common)
    emit("loop_iterations_per_message", iterations / count, "iterations", **common)
    for task, cpus in sorted(step_cpu.items(), key=lambda kv: -sum(kv[1])):
        if len(cpus) < count / 20:
            continue  # periodic tasks (metrics, checkpoints): not per message
        emit("task_steps_per_message", len(cpus) / count, "steps", task=task, **common)
        emit("task_step_cpu_median", statistics.median(cpus), "us", task=task, **common)


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "200/s for 3 s (< 1 minute)")
    parser.add_argument("--rates", default="200,1000", help="deliveries per second to trace")
    parser.add_argument("--seconds", type=int, default=5, help="window per rate")
    args = parser.parse_args()
    rates = [200] if args.quick else [int(r) for r in args.rates.split(",")]
    seconds = 3 if args.quick else args.seconds
    bench_common.emit_host_speed(emit)
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > bd.CLIENT_CPU:
        os.sched_setaffinity(0, {bd.CLIENT_CPU})
    with tempfile.TemporaryDirectory(prefix="trace-steps-") as work:
        site = Path(work) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(site), str(CHECKOUT), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        for rate in rates:
            trace_rate(rate, seconds, Path(work))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
