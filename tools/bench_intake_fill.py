"""Intake as a server fills: acknowledged throughput and the server's CPU per message of
``delayd serve`` for each successive round of messages sent to one process, pending
messages accumulating.

Prints one JSON object per figure on stdout:
    {"bench": "intake_fill", "metric": ..., "value": ..., "unit": ..., ...}

    python tools/bench_intake_fill.py                  # 5 rounds of 1,000,000
    python tools/bench_intake_fill.py --quick          # 4 rounds of 250,000 (< 1 minute)
    python tools/bench_intake_fill.py --delays hour    # due within the hour, as bench_routing
    python tools/bench_intake_fill.py --py-spy DIR     # profile the first and last rounds

Workload: tools/bench_intake.py's (100-byte bodies, batches of 100, 16 in flight on one
raw connection, frames encoded before the clock starts; the server pinned to CPU 0 and
each round's client process to CPU 1), the rounds one after the other against one
server. Each round waits until replay has caught up, so its CPU is all the work its
messages caused. ``--delays far`` (default) sends messages due between one and two days
out: nothing is loaded into the wheel or delivered, so a round's cost is intake alone.
``--delays hour`` spreads them over the coming hour as bench_intake and bench_routing
do: as the minutes pass, buckets come into the load-ahead window and the wheel loads and
delivers (the embedded broker stores them), which a round pays for too.

Per round: ``fill_round_throughput`` (msg/s), ``fill_round_server_cpu_per_message``
(µs, user + system, the steadier figure on a shared machine) and the messages pending
before it; at the end ``last_round_vs_first_cpu`` and the server's ``server_rss``.
``--py-spy DIR`` records the server with py-spy (installed separately: it is a tool,
not a dependency) during the first and the last round, as collapsed stacks.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import bench_common
from bench_intake import CLIENT_CPU, cpu_times, pinned, run_client, start_delayd

ROOT = bench_common.ROOT
DAY_MS = 86_400_000
IN_FLIGHT = 16
DELAYS_FROM_MS = {"far": DAY_MS, "hour": 0}

emit = bench_common.emitter("intake_fill")


def rss_mb(pid: int) -> float:
    """Resident set size of process ``pid`` (Linux /proc), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def start_py_spy(pid: int, out: Path) -> subprocess.Popen:
    """py-spy recording process ``pid`` into ``out`` (collapsed stacks) until stopped,
    on the client's CPU so that it does not take the server's."""
    args = [_py_spy(), "record", "--pid", str(pid), "--format", "raw", "--output", str(out),
            "--rate", "200", "--nonblocking"]  # fmt: skip
    return subprocess.Popen(pinned(CLIENT_CPU, args), stdout=subprocess.DEVNULL)


def _py_spy() -> str:
    """The py-spy beside this interpreter (a venv's), else the one on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else "py-spy"


def bench_fill(rounds: int, per_round: int, delays: str, repo: Path, py_spy: Path | None) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-intake-fill-") as data:
        proc, addr = start_delayd(data, repo)
        try:
            pending = 0
            cpu_us = []
            for number in range(rounds):
                profiled = py_spy is not None and number in (0, rounds - 1)
                spy = start_py_spy(proc.pid, py_spy / f"round{number}.txt") if profiled else None
                user_before, system_before = cpu_times(proc.pid)
                result = run_client("client", addr, per_round, IN_FLIGHT,
                                    delays_from_ms=DELAYS_FROM_MS[delays])  # fmt: skip
                user, system = cpu_times(proc.pid)
                user, system = user - user_before, system - system_before
                if spy is not None:
                    spy.send_signal(signal.SIGINT)
                    spy.wait(60)
                acked = result["acked"]
                cpu_us.append((user + system) / acked * 1e6)
                emit("fill_round_throughput", acked / result["seconds"], "msg/s",
                     round=number, pending_before=pending, delays=delays)  # fmt: skip
                emit("fill_round_server_cpu_per_message", cpu_us[-1], "us", round=number,
                     user_us=round(user / acked * 1e6, 3),
                     system_us=round(system / acked * 1e6, 3), pending_before=pending,
                     rss_mb=round(rss_mb(proc.pid)), delays=delays)  # fmt: skip
                pending += acked + 20 * 100  # the client's warm-up frames too
            emit("last_round_vs_first_cpu", cpu_us[-1] / cpu_us[0], "x", delays=delays)
            emit("server_rss", rss_mb(proc.pid), "MB", pending=pending, delays=delays)
        finally:
            bench_common.stop_process(proc, 60)


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "4 rounds of 250,000 (< 1 minute)")
    parser.add_argument("--rounds", type=int, help="rounds (default 5; quick 4)")
    parser.add_argument("--per-round", type=int, help="messages a round (default 1,000,000)")
    parser.add_argument("--delays", choices=sorted(DELAYS_FROM_MS), default="far",
                        help="far: due in 1-2 days, nothing delivered (default); "
                        "hour: due within the hour")  # fmt: skip
    parser.add_argument("--repo", type=Path, default=ROOT,
                        help="run the server from this checkout (A/B comparisons)")  # fmt: skip
    parser.add_argument("--py-spy", type=Path, metavar="DIR",
                        help="record the first and last rounds with py-spy into DIR")  # fmt: skip
    args = parser.parse_args()
    rounds, per_round = (4, 250_000) if args.quick else (5, 1_000_000)
    if args.py_spy is not None:
        args.py_spy.mkdir(parents=True, exist_ok=True)
    bench_common.emit_host_speed(emit)
    bench_fill(
        args.rounds or rounds,
        args.per_round or per_round,
        args.delays,
        args.repo.resolve(),
        args.py_spy,
    )


if __name__ == "__main__":
    main()
