"""Where a delivered message's time goes in a replicated group (issue 20's lateness).

Runs a delay group of two ``delayd serve`` members as tools/bench_replication.py does
(leader on CPU 0, follower on CPU 1, ``ack = "sync"``), schedules ``--messages`` due
evenly over ``--seconds`` and consumes them from the leader's embedded broker (this
process, on CPU 1). A ``sitecustomize`` on the members' PYTHONPATH wraps a few methods
of both members (never the code under test's logic: it records the wall-clock time and
the commitlog offset each step reached, and calls through), switched on and off with
SIGUSR1 / SIGUSR2. For every batch the leader's sender appends to its embedded
broker's commitlog it then knows when, in the order they usually happen:

* ``shipped``: the leader sent the first RECORDS frame that carried its end;
* ``follower_received``: the follower appended it to its copy;
* ``leader_fsync``: the leader's first commitlog fsync that covered it;
* ``follower_fsync``: the follower's first group commit that covered it;
* ``follower_durable_sent``: the follower sent the DURABLE report that covered it;
* ``follower_durable``: the leader took that report in;
* ``visible``: the leader's broker put it into its consume queue (the high watermark
  passed it and its held PULLs were woken).

Each is reported as p50 / p99 ms after the append, with the steps before (due →
dispatched → stored, from the messages) and after (visible → the consumer had it:
the whole lateness minus the rest, per message). One JSON object per figure::

    .venv/bin/python tools/trace_replication.py [--quick] [--messages 20000 --seconds 10]
"""

from __future__ import annotations

import bisect
import json
import os
import signal
import sys
import time
from pathlib import Path

import bench_common  # puts this checkout first on sys.path
import bench_replication
from replicated_group import log, work_dir

import delayd
from delayd.bench import delivery as bd

emit = bench_common.emitter("trace_replication")
CHECKOUT = Path(__file__).resolve().parent.parent

SITECUSTOMIZE = """\
import json, os, signal, time
_out = os.environ.get("DELAYD_REPLICATION_TRACE")
if _out:
    _out = f"{_out}.{os.getpid()}"
    _events = []
    _on = [False]
    def _note(kind, offset):
        if _on[0] and offset is not None:
            _events.append((kind, time.time() * 1000, offset))
    from delayd.broker import store as _store
    from delayd.replication import in_sync as _in_sync, wire as _wire
    from storage import segmented_log as _segmented_log
    _append = _store.BrokerStore.append
    def _traced_append(self, *args, **kwargs):
        offsets = _append(self, *args, **kwargs)
        _note("append", self.commitlog.end_offset)
        return offsets
    _store.BrokerStore.append = _traced_append
    _reput = _store.BrokerStore.reput_durable
    def _traced_reput(self):
        grown = _reput(self)
        if grown:
            _note("visible", self.reput_offset)
        return grown
    _store.BrokerStore.reput_durable = _traced_reput
    _flush = _segmented_log.SegmentedLog.flush
    def _traced_flush(self):
        durable = _flush(self)
        if "commitlog" in self.directory:
            _note("leader_fsync", durable)
        return durable
    _segmented_log.SegmentedLog.flush = _traced_flush
    _encode = _wire.encode
    def _traced_encode(event):
        if isinstance(event, _wire.Records) and event.stream.endswith("commitlog"):
            _note("shipped", event.offset + len(event.data))
        if isinstance(event, _wire.Durable):
            _note("durable_sent", event.offsets.get("broker/commitlog"))
        return _encode(event)
    _wire.encode = _traced_encode
    from delayd.broker import replica as _replica
    _append_raw = _replica.CommitlogStream.append_raw
    def _traced_append_raw(self, offset, data):
        end = _append_raw(self, offset, data)
        _note("received", end)
        return end
    _replica.CommitlogStream.append_raw = _traced_append_raw
    _durable = _in_sync.InSyncTracker.follower_durable
    def _traced_durable(self, member, offsets):
        _note("follower_durable", offsets.get("broker/commitlog"))
        return _durable(self, member, offsets)
    _in_sync.InSyncTracker.follower_durable = _traced_durable
    def _start(signum, frame):
        _on[0] = True
    def _stop(signum, frame):
        _on[0] = False
        with open(_out + ".tmp", "w") as f:
            json.dump(_events, f)
        os.replace(_out + ".tmp", _out)
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
"""

# In the order they usually happen. The follower's own events are prefixed
# "follower_" (its fsync is noted as "leader_fsync" there, by the same wrapper);
# "follower_durable" is the leader's, taking the follower's report in.
STEPS = (
    "shipped",
    "follower_received",
    "leader_fsync",
    "follower_fsync",
    "follower_durable_sent",
    "follower_durable",
    "visible",
)


def percentiles(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return bd.percentile(ordered, 50), bd.percentile(ordered, 99)


def first_reaching(
    events: list[tuple[float, int]], times: list[float], offset: int, after_ms: float
) -> float | None:
    """When the first of ``events`` (in time order; ``times`` their times) at or after
    ``after_ms`` reached ``offset``."""
    for index in range(bisect.bisect_left(times, after_ms), len(events)):
        t, reached = events[index]
        if reached >= offset:
            return t
    return None


def step_latencies(events: list[tuple[str, float, int]]) -> dict[str, list[float]]:
    """Per append: ms from the append to each of STEPS."""
    by_kind: dict[str, list[tuple[float, int]]] = {}
    for kind, t, offset in events:
        by_kind.setdefault(kind, []).append((t, offset))
    times = {kind: [t for t, _ in events] for kind, events in by_kind.items()}
    out: dict[str, list[float]] = {step: [] for step in STEPS}
    for appended_ms, end in by_kind.get("append", []):
        for step in STEPS:
            steps = by_kind.get(step, [])
            reached = first_reaching(steps, times.get(step, []), end, appended_ms)
            if reached is not None:
                out[step].append(reached - appended_ms)
    return out


def run(count: int, seconds: int, work: Path) -> None:
    trace = work / "trace"
    os.environ["DELAYD_REPLICATION_TRACE"] = str(trace)
    group = bench_replication.start_pair(work, "sync")
    try:
        leader = group.members[0]
        pids = [member.proc.pid for member in group.members if member.proc is not None]
        with delayd.Consumer(leader.broker, subject=bd.SUBJECT, group="trace",
                             max_messages=1000, pull_wait_ms=1000) as consumer:  # fmt: skip
            start = bd.schedule_window(group.member_list, count, seconds * 1000)
            time.sleep(max(0.0, (start - bd.now_ms()) / 1000 - 0.5))
            for pid in pids:
                os.kill(pid, signal.SIGUSR1)
            got = bd.consume(leader.broker, consumer, count, start + seconds * 1000 + 10_000)
            for pid in pids:
                os.kill(pid, signal.SIGUSR2)
        events = []
        for role, pid in zip(("", "follower_"), pids, strict=True):
            path = Path(f"{trace}.{pid}")
            deadline = time.monotonic() + 10
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # the member writes it on SIGUSR2
            for kind, t, offset in json.loads(path.read_text()):
                kind = kind.replace("leader_", "") if role else kind
                events.append((role + kind, t, offset))
        events.sort(key=lambda event: event[1])
    finally:
        group.close()
    if len(got) < count:
        raise SystemExit(f"only {len(got)} of {count} messages were delivered")
    common = {"messages": count, "window_ms": seconds * 1000, "load_average": bd.load_average()}
    per_message = {
        "dispatched": [m.dispatched_ms - m.due_ms for _, m in got.values()],
        "stored": [m.store_ms - m.dispatched_ms for _, m in got.values()],
        "received": [received - m.due_ms for received, m in got.values()],
    }
    for name, values in per_message.items():
        p50, p99 = percentiles(values)
        what = {"dispatched": "due -> dispatched", "stored": "dispatched -> stored",
                "received": "due -> the consumer had it (the lateness)"}[name]  # fmt: skip
        emit(f"{name}_p50", p50, "ms", what=what, **common)
        emit(f"{name}_p99", p99, "ms", what=what, **common)
    for step, values in step_latencies(events).items():
        if not values:
            emit(f"{step}_missing", 1, "step", **common)
            continue
        p50, p99 = percentiles(values)
        what = f"commitlog append -> {step}"
        emit(f"append_to_{step}_p50", p50, "ms", what=what, batches=len(values), **common)
        emit(f"append_to_{step}_p99", p99, "ms", what=what, batches=len(values), **common)


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "2,000 messages over 2 s (< 1 minute)")
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--seconds", type=int, default=10)
    args = parser.parse_args()
    count, seconds = (2_000, 2) if args.quick else (args.messages, args.seconds)
    bench_common.emit_host_speed(emit)
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {int(bench_replication.FOLLOWER_CPU)})
    with work_dir("trace-replication-") as work:
        site = work / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(site), str(CHECKOUT), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        log(f"tracing {count:,} messages over {seconds} s through a group of two")
        run(count, seconds, work)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
