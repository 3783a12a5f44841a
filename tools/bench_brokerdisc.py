"""Burst across a cluster (issue 21): N messages due in the same second, spread over 2
delay groups; how long after the due second the last one is stored in a broker (target:
1,000,000 within 10 s), either in 2 broker groups the delay servers find in etcd or, with
``--embedded``, in each delay server's own embedded broker.

Prints one JSON object per figure on stdout:
    {"bench": "brokerdisc", "metric": ..., "value": ..., "unit": ..., ...}

    python tools/bench_brokerdisc.py               # 1,000,000 messages (500,000 per delay group)
    python tools/bench_brokerdisc.py --quick       # 100,000 (about a minute)
    python tools/bench_brokerdisc.py --embedded    # into the embedded brokers, one CPU each
    python tools/bench_brokerdisc.py --embedded --repo DIR --profile OUT

Processes: an etcd (tests/etcd_support.py) and two ``delayd serve`` delay groups of one
member each (``--etcd --group dN --cluster C``). By default they deliver with
``[delivery] broker_groups_from = "etcd"`` to two ``delayd broker`` groups of one member
each (``--group bN``), none of the five pinned. With ``--embedded`` each delivers into
its embedded broker (the default ``delayd serve`` configuration: no TCP hop, no broker
process), delay group dN pinned to CPU N-1 with ``taskset``.

The messages are sent through each delay server's intake (public blocking Producer,
batches of 10,000, both delay groups at once), due within one second that starts a
margin after the sends are expected to end. "Stored" is read from the brokers' STATS
(``broker.messages_stored_total``, polled every 50 ms): the figure is the first poll
that finds them all, minus the start of the due second. CPU is that of the delay
servers (and brokers) over the same span. Once the servers have stopped, every delay
server's schedule_log and dispatch_log are read back (the audit's decoders) and each
message's first dispatch is compared with its due time: ``cluster_burst_early``, over
``cluster_burst_dispatched`` messages (those whose entry was written by the stop, 2 s
after the last store; one stored without its entry would be sent again after a restart
and dropped by its broker as a duplicate).

``--repo DIR`` runs the delay servers (and brokers) from checkout DIR, for an A/B in one
session. ``--profile OUT`` runs cProfile inside delay group d1 from the due second to
the last store and writes its statistics to OUT (``python -m pstats OUT``).
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import bench_common

from delayd.address import parse_address
from delayd.bench.delivery import CONFIG, Server, cpu_seconds, load_average, now_ms, send_all
from delayd.bench.raw_client import RawClient
from tests.etcd_support import EtcdServer

emit = bench_common.emitter("brokerdisc")
CLUSTER = "bench"
BROKER_READY = re.compile(r"delayd broker listening on (\S+):(\d+)")
MEMBER_ENV = {
    "DELAYD_CLUSTER_REPLICATION_LISTEN": "127.0.0.1:0",  # two members per host
    "DELAYD_CLUSTER_ACK": "leader",  # a group of one member acknowledges alone
    # Five processes on a shared host: a leader starved of CPU for a second must not
    # step down in the middle of the burst (each group has one member: nobody to fail
    # over to anyway).
    "DELAYD_CLUSTER_LEASE_TTL_MS": "10000",
}
# msg/s per delay group assumed when placing the due second: a quiet host sends 2-3x
# faster, a host loaded by other work (load 16 on 2 cores) about 14,000.
SEND_RATE = 12_500
MARGIN_MS = 8_000
SETTLE_S = 2.0


def log(text: str) -> None:
    print(f"# {text}", file=sys.stderr, flush=True)


class Broker:
    """One ``delayd broker`` process, a broker group of one member."""

    def __init__(self, data: Path, group: str, etcd: str, env: dict[str, str]) -> None:
        args = [sys.executable, "-m", "delayd", "broker", "--data", str(data),
                "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--log-level", "warning",
                "--etcd", etcd, "--group", group, "--cluster", CLUSTER]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, env=env)
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline().decode() if ready else ""
        match = BROKER_READY.search(line)
        if match is None:
            self.proc.kill()
            raise RuntimeError(f"delayd broker did not start: {line!r}")
        self.address = f"{match.group(1)}:{match.group(2)}"

    def stop(self) -> None:
        bench_common.stop_process(self.proc, 30)


PROFILE_SITECUSTOMIZE = """\
import os, signal
_out = os.environ.get("DELAYD_BURST_PROFILE")
if _out:
    import cProfile
    _profile = cProfile.Profile()
    def _on(signum, frame):
        _profile.enable()
    def _off(signum, frame):
        _profile.disable()
        _profile.dump_stats(_out)
    signal.signal(signal.SIGUSR1, _on)
    signal.signal(signal.SIGUSR2, _off)
"""


def stored_in(address: str) -> int:
    """``broker.messages_stored_total`` of the broker at ``address``."""
    with RawClient(*parse_address(address), "bench-brokerdisc") as client:
        return int(client.stats()["broker.messages_stored_total"])


def first_dispatches(data_dir: str) -> tuple[int, int]:
    """(messages dispatched, of them dispatched before their due time) in the delay
    server's logs under ``data_dir``: each schedule_log record's earliest DISPATCHED
    dispatch_log entry against the record's due_ms."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from delayd.audit.read.batches import ReadOptions
    from delayd.audit.read.dispatch import dispatch_batches
    from delayd.audit.read.messages import schedule_batches
    from delayd.logs import log_files

    def table(log: str, decode, columns: list[str]) -> pa.Table:
        options = ReadOptions(columns=[*columns, "problem"])
        read = pa.Table.from_batches(
            batch
            for log_file in log_files.list_files(data_dir, log)
            for batch in decode(log_file, "bench", options)
        )
        problems = read.filter(pc.is_valid(read["problem"]))
        if problems.num_rows:
            raise RuntimeError(f"{log} of {data_dir}: {problems.to_pylist()[0]}")
        return read

    key = ["bucket", "offset"]
    scheduled = table("schedule_log", schedule_batches, [*key, "due_ms"])
    entries = table("dispatch_log", dispatch_batches, [*key, "kind", "at_ms"])
    dispatched = entries.filter(pc.equal(entries["kind"], "dispatched"))
    first = dispatched.group_by(key).aggregate([("at_ms", "min")])
    joined = first.join(scheduled.select([*key, "due_ms"]), key)
    early = pc.sum(pc.less(joined["at_ms_min"], joined["due_ms"])).as_py() or 0
    return first.num_rows, early


def bench(count: int, embedded: bool, repo: Path | None, profile: Path | None) -> None:
    env = {**os.environ, **MEMBER_ENV}
    if repo is not None:
        # `python -m delayd` imports delayd from its working directory first.
        os.chdir(repo)
        env["PYTHONPATH"] = str(repo)
    with tempfile.TemporaryDirectory(prefix="bench-brokerdisc-") as data:
        root = Path(data)
        etcd = EtcdServer(root / "etcd").start()
        brokers: list[Broker] = []
        servers: list[Server] = []
        try:
            config = CONFIG
            if not embedded:
                brokers = [Broker(root / f"b{n}", f"b{n}", etcd.url, env) for n in (1, 2)]
                config += '[delivery]\nbroker_groups_from = "etcd"\n'
            for n in (1, 2):
                (root / f"d{n}").mkdir()
                flags = ("--etcd", etcd.url, "--group", f"d{n}", "--cluster", CLUSTER)
                server_env = dict(env)
                if profile is not None and n == 1:
                    site = root / "site"
                    site.mkdir()
                    (site / "sitecustomize.py").write_text(PROFILE_SITECUSTOMIZE)
                    server_env["PYTHONPATH"] = os.pathsep.join(
                        filter(None, [str(site), env.get("PYTHONPATH")])
                    )
                    server_env["DELAYD_BURST_PROFILE"] = str(profile.resolve())
                cpu = str(n - 1) if embedded else None
                server = Server(str(root / f"d{n}"), config=config, extra=flags,
                                env=server_env, cpu=cpu)  # fmt: skip
                server.start()
                servers.append(server)
            stores = [s.broker for s in servers] if embedded else [b.address for b in brokers]
            half = count // 2
            due = int(now_ms()) + half * 1000 // SEND_RATE + MARGIN_MS
            seconds: list[float] = []

            def send(server: Server, prefix: str) -> None:
                at_ms = lambda i: due + i * 1000 // half  # noqa: E731
                seconds.append(send_all(server.intake, range(half), at_ms, prefix))

            threads = [
                threading.Thread(target=send, args=(server, f"d{n}"))
                for n, server in enumerate(servers, 1)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            ahead_s = (due - now_ms()) / 1000
            log(f"sent {count:,} in {max(seconds):.2f} s; due in {ahead_s:.2f} s")
            if ahead_s < 1:
                when = (
                    f"{-ahead_s:.1f} s into the due second"
                    if ahead_s < 0
                    else f"{ahead_s:.1f} s before the due second (1 s at least)"
                )
                raise RuntimeError(
                    f"the sends ended {when}: no burst to measure; "
                    "run it again on a quieter host, or with fewer --messages"
                )
            for server in servers:
                server.wait_replayed()
            pids = [s.pid for s in servers] + [b.proc.pid for b in brokers]
            time.sleep(max(0.0, (due - now_ms()) / 1000 - 0.5))
            if profile is not None:
                os.kill(servers[0].pid, signal.SIGUSR1)
            cpu_before = sum(cpu_seconds(pid) for pid in pids)
            stored = [0, 0]
            deadline = due + 120_000
            while sum(stored) < count and now_ms() < deadline:
                time.sleep(0.05)  # polling counters of other processes
                stored = [stored_in(address) for address in stores]
            last = now_ms() - due
            cpu = sum(cpu_seconds(pid) for pid in pids) - cpu_before
            if profile is not None:
                os.kill(servers[0].pid, signal.SIGUSR2)
                wait_for_file(profile)
            # The last batches' acknowledgements reach the delay servers after the brokers
            # count them stored: let their dispatch_log entries be written before the stop.
            time.sleep(SETTLE_S)
        finally:
            for server in servers:
                server.stop()
            for broker in brokers:
                broker.stop()
            etcd.stop()
        checked = [first_dispatches(str(Path(s.data) / "d")) for s in servers]
    delivery = "embedded" if embedded else "broker_groups"
    common = {"messages": count, "delay_groups": 2, "delivery": delivery}
    common["pinned"] = "d1: CPU 0, d2: CPU 1" if embedded else "none"
    common["load_average"] = load_average()
    emit("cluster_burst_last_stored_after_due", last / 1000, "s", target="<= 10", **common)
    emit("cluster_burst_missing", count - sum(stored), "messages", target="0", **common)
    early = sum(e for _, e in checked)
    emit("cluster_burst_early", early, "messages", target="0", **common)
    emit("cluster_burst_dispatched", sum(d for d, _ in checked), "messages", **common)
    for n, value in enumerate(stored, 1):
        group = f"d{n}" if embedded else f"b{n}"
        emit("cluster_burst_stored_in_group", value, "messages", group=group, **common)
    what = "the delay servers (and brokers), from the due second to the last stored"
    emit("cluster_burst_cpu_per_message", cpu / count * 1e6, "us", what=what, **common)
    emit("cluster_burst_send_rate", count / max(seconds), "msg/s", **common)


def wait_for_file(path: Path) -> None:
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the server writes it on SIGUSR2


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "100,000 messages instead of 1,000,000")
    parser.add_argument("--messages", type=int, help="messages in the burst (both groups)")
    embedded = "deliver into each delay server's embedded broker, one CPU each"
    parser.add_argument("--embedded", action="store_true", help=embedded)
    parser.add_argument("--repo", type=Path, help="run the servers from this checkout")
    parser.add_argument(
        "--profile", type=Path, help="cProfile delay group d1's burst into this file"
    )
    args = parser.parse_args()
    if args.repo is not None and not (args.repo / "delayd" / "__main__.py").exists():
        parser.error(f"--repo {args.repo}: not a delayd checkout (no delayd/__main__.py)")
    bench_common.emit_host_speed(emit)
    count = args.messages or (100_000 if args.quick else 1_000_000)
    bench(count, args.embedded, args.repo and args.repo.resolve(), args.profile)


if __name__ == "__main__":
    main()
