"""Failover benchmark: how long a replicated delay group takes to acknowledge again
after its leader is killed (kill -9) or stopped (SIGTERM: it resigns and hands over).

Prints one JSON object per figure on stdout:
    {"bench": "failover", "metric": ..., "value": ..., "unit": ..., ...}

    python tools/bench_failover.py            # the figures of docs/benchmarks.md
    python tools/bench_failover.py --quick    # the same cases, smaller (< 1 minute)

A group of ``--members`` real ``delayd serve`` processes (default 3: after a kill the
new leader still has an in-sync follower) on a real etcd (tests/etcd_support.py's: 10 ms
heartbeat, 100 ms election timeout), ``ack = "sync"``, ``--lease-ttl-ms`` 2000. Members
alternate between CPU 0 and CPU 1 (the first leader on CPU 0); etcd and this process
run on CPU 1. A producer (the public blocking ``delayd.Producer``, addressed by the
member list) sends one message at a time throughout, so every kill lands while it
produces.

Each round waits until every member is in the in-sync set, then kills the leader (or
sends it SIGTERM) and starts it again on the same ports and data, as a supervisor
would, once etcd names another leader (``--restart-at-once``: as soon as it exited).
Two clocks start at the kill (after ``waitpid``: the process is gone) or at the
SIGTERM:

- ``first_ack``: a probe sends a one-message SEND_BATCH to each surviving member in
  turn, every 2 ms, over raw connections; the first answered OK is the new leader's
  first acknowledgement (nothing else could have answered it).
- ``producer_ack``: the producer's first acknowledged send that began after the kill:
  what an application sees, its reconnection back-off included. After a SIGTERM the
  old leader may still answer it before it resigns.

A member that exits before a round can start (a returning old leader that could not
cut its tail) is wiped and started again, and counted (``*_members_exited``, target 0).

``new_leader_key`` is when etcd first names another leader (polled every 5 ms): the
part of ``first_ack`` that is the lease and the election; the rest,
``new_leader_key_to_first_ack``, is the promotion (replay caught up, the canceller's
take-over, the in-sync followers counted).
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import bench_common
from replicated_group import Member, MemberExited, ReplicatedGroup, log, wait_until, work_dir

import delayd
from delayd.address import parse_address
from delayd.bench.raw_client import RawClient
from delayd.protocol import (
    Message,
    ResultCode,
    SendBatch,
    SendBatchResult,
    encode_event,
)

PROBE_GAP_S = 0.002
GIVE_UP_S = 30.0

emit = bench_common.emitter("failover")


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class Probe:
    """Raw connections to some members; ``first_ok`` sends one message to each in turn
    until one acknowledges it."""

    def __init__(self, members: list[Member], tag: str) -> None:
        self.members = members
        self.tag = tag
        self.clients: dict[str, RawClient] = {}
        self.sent = 0

    def first_ok(self, deadline: float) -> tuple[float, Member]:
        """(monotonic time of the first OK, the member that sent it). RuntimeError
        after ``deadline``."""
        while time.monotonic() < deadline:
            for member in self.members:
                if self._acknowledged(member):
                    return time.monotonic(), member
            time.sleep(PROBE_GAP_S)
        raise RuntimeError(f"no member acknowledged within {GIVE_UP_S} s")

    def _acknowledged(self, member: Member) -> bool:
        try:
            client = self.clients.get(member.intake)
            if client is None:
                client = RawClient(*parse_address(member.intake), "bench-failover-probe")
                self.clients[member.intake] = client
            self.sent += 1
            message = Message(f"probe-{self.tag}-{self.sent}", "failover", body=b"p",
                              delay_ms=3_600_000)  # fmt: skip
            request = SendBatch([message], request_id=client.next_request_id())
            client.sock.sendall(encode_event(request))
            answer = client.receive()
        except OSError:
            self.close_client(member)
            return False
        return isinstance(answer, SendBatchResult) and answer.results[0].code is ResultCode.OK

    def close_client(self, member: Member) -> None:
        client = self.clients.pop(member.intake, None)
        if client is not None:
            client.sock.close()

    def close(self) -> None:
        for member in self.members:
            self.close_client(member)


class SteadyProducer:
    """A thread sending one message at a time to the group by ``address``; notes the
    (began, acknowledged) monotonic times of every acknowledged send."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.acks: list[tuple[float, float]] = []
        self.failures = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> SteadyProducer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(GIVE_UP_S + 5)

    def _run(self) -> None:
        with delayd.Producer(self.address, timeout_s=GIVE_UP_S) as producer:
            sent = 0
            while not self.stopping.is_set():
                sent += 1
                began = time.monotonic()
                try:
                    producer.send("failover", b"s" * 100, message_id=f"steady-{sent}",
                                  delay_ms=3_600_000)  # fmt: skip
                except delayd.DelaydError:
                    self.failures += 1
                    continue
                self.acks.append((began, time.monotonic()))
                time.sleep(0.001)  # a steady trickle, not a flood: the figure is the gap

    def first_ack_after(self, moment: float, deadline: float) -> float:
        """When the first send begun after ``moment`` was acknowledged."""
        while time.monotonic() < deadline:
            later = [acked for began, acked in list(self.acks) if began > moment]
            if later:
                return min(later)
            time.sleep(0.005)
        raise RuntimeError(f"the producer had no ack within {GIVE_UP_S} s")


def watch_leader_change(
    group: ReplicatedGroup, old: Member, out: list[float], moved_on: threading.Event
) -> threading.Thread:
    """A thread that appends to ``out`` the monotonic time etcd first names a leader
    other than ``old``, and sets ``moved_on``."""

    def watch() -> None:
        deadline = time.monotonic() + GIVE_UP_S
        while time.monotonic() < deadline:
            leader = group.state().leader
            if leader is not None and leader.member_id != old.member_id:
                out.append(time.monotonic())
                moved_on.set()
                return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def settle(group: ReplicatedGroup) -> tuple[Member, int]:
    """Wait until every member is in sync; (the leader, how many members exited
    meanwhile). A member that exits (a returning old leader that could not cut its
    tail: docs/benchmarks.md, 2026-11-26) has its data directory wiped and is started
    again, to copy everything from the leader: the benchmark goes on measuring
    failovers, and reports how often that happened."""
    exited = 0
    while True:
        try:
            return group.wait_in_sync(), exited
        except MemberExited as exc:
            exited += 1
            log(f"{exc}\n-> wiping {exc.member.data_dir} and starting it again")
            shutil.rmtree(exc.member.data_dir)
            exc.member.start()


def restart(member: Member, moved_on: threading.Event | None) -> threading.Thread:
    """The supervisor: a thread that starts ``member`` again (same ports and data, so
    the same member id) once its process has ended and, unless ``moved_on`` is None,
    once that event is set (etcd names another leader). Restarted sooner, while its
    previous life's lease still holds the leader key, a member follows itself
    (docs/benchmarks.md, 2026-11-26 "replicated groups"); ``--restart-at-once`` does
    that."""

    def run() -> None:
        assert member.proc is not None
        member.proc.wait(GIVE_UP_S)
        if moved_on is not None:
            moved_on.wait(GIVE_UP_S)
        member.start()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def one_round(
    group: ReplicatedGroup, producer: SteadyProducer, how: str, index: int, at_once: bool
) -> dict[str, float]:
    """Stop the leader ``how`` (kill or term) and start it again; the seconds from the
    stop to the new leader key, its first ack and the producer's first ack, and how
    many members exited before the round could start."""
    leader, exited = settle(group)
    survivors = [m for m in group.members if m is not leader]
    probe = Probe(survivors, f"{how}{index}")
    changed: list[float] = []
    assert leader.proc is not None
    try:
        if how == "kill":
            leader.proc.kill()
            leader.proc.wait()
            stopped = time.monotonic()
        else:
            stopped = time.monotonic()
            leader.proc.send_signal(signal.SIGTERM)
        moved_on = threading.Event()
        watcher = watch_leader_change(group, leader, changed, moved_on)
        supervisor = restart(leader, None if at_once else moved_on)
        acked, new_leader = probe.first_ok(stopped + GIVE_UP_S)
        producer_acked = producer.first_ack_after(stopped, stopped + GIVE_UP_S)
        watcher.join(GIVE_UP_S)
        supervisor.join(GIVE_UP_S)
    finally:
        probe.close()
    log(f"{how} {index}: {leader.member_id} stopped; {new_leader.member_id} acknowledged "
        f"after {acked - stopped:.3f} s")  # fmt: skip
    new_key = changed[0] if changed else acked
    return {
        "new_leader_key": new_key - stopped,
        "promotion": acked - new_key,
        "first_ack": acked - stopped,
        "producer_ack": producer_acked - stopped,
        "new_leader": new_leader.member_id,
        "exited": exited,
    }


def run_case(
    group: ReplicatedGroup, producer: SteadyProducer, how: str, rounds: int, options: dict
) -> None:
    """``rounds`` rounds of stopping the leader ``how``; their figures."""
    at_once = options["restart_at_once"]
    results = [one_round(group, producer, how, i, at_once) for i in range(rounds)]
    extra = {"rounds": rounds, "members": len(group.members), **options}
    # The targets are for the new leader's first ack (first_ack).
    targets = {"kill": ("<= 3", "<= 5"), "term": ("<= 0.5", "<= 0.5")}[how]
    for figure in ("new_leader_key", "promotion", "first_ack", "producer_ack"):
        values = [r[figure] for r in results]
        p50, top = ({"target": t} if figure == "first_ack" else {} for t in targets)
        name = (
            f"{how}_new_leader_key_to_first_ack" if figure == "promotion" else f"{how}_to_{figure}"
        )
        emit(f"{name}_p50", percentile(values, 0.5), "s", **p50, **extra)
        emit(f"{name}_max", max(values), "s", **top, **extra)
    leaders = {r["new_leader"] for r in results}
    emit(f"{how}_distinct_new_leaders", len(leaders), "members", **extra)
    # Counted before each round: the last round's restart is counted by the next case
    # (or by members_exited_at_end).
    emit(f"{how}_members_exited", sum(r["exited"] for r in results), "members", target="0", **extra)


def bench(members: int, kills: int, terms: int, lease_ttl_ms: int, at_once: bool) -> None:
    with work_dir("bench-failover-") as work:
        group = ReplicatedGroup(work, lease_ttl_ms=lease_ttl_ms)
        try:
            first = group.add("0")
            wait_until(lambda: group.leader() is first, 30, "the first member leads")
            for i in range(1, members):
                group.add("1" if i % 2 else "0")
            group.wait_in_sync()
            with SteadyProducer(group.member_list) as producer:
                options = {"lease_ttl_ms": lease_ttl_ms, "restart_at_once": at_once}
                if kills:
                    run_case(group, producer, "kill", kills, options)
                if terms:
                    run_case(group, producer, "term", terms, options)
            _, exited = settle(group)
            emit("members_exited_at_end", exited, "members", target="0")
            emit("producer_failed_sends", producer.failures, "sends", target="0",
                 acknowledged=len(producer.acks))  # fmt: skip
        finally:
            group.close()


def main() -> None:
    parser = bench_common.bench_parser(__doc__, "3 kills and 3 SIGTERMs (< 1 minute)")
    parser.add_argument("--members", type=int, default=3, help="members of the group")
    parser.add_argument("--kills", type=int, help="kill -9 rounds (default 20, --quick 3)")
    parser.add_argument("--terms", type=int, help="SIGTERM rounds (default 10, --quick 3)")
    parser.add_argument("--lease-ttl-ms", type=int, default=2000, help="the members' lease")
    parser.add_argument(
        "--restart-at-once",
        action="store_true",
        help="restart a stopped leader as soon as it exited, not once etcd names another",
    )
    args = parser.parse_args()
    if args.members < 2:
        parser.error("--members must be at least 2: a failover needs a follower")
    bench_common.emit_host_speed(emit)
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1:
        os.sched_setaffinity(0, {1})  # beside etcd and the followers, off the leader's CPU
    kills, terms = (3, 3) if args.quick else (20, 10)
    kills = kills if args.kills is None else args.kills
    terms = terms if args.terms is None else args.terms
    bench(args.members, kills, terms, args.lease_ttl_ms, args.restart_at_once)


if __name__ == "__main__":
    main()
