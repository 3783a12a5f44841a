"""A replicated delay group for the benchmarks: one real etcd and ``delayd serve``
members, each pinned to a CPU with ``taskset``, on loopback ports.

The processes are the test suite's (tests/etcd_support.py's ``EtcdServer``, with its
10 ms heartbeat and 100 ms election timeout; tests/intake_support.py's ``ServeProcess``),
so a benchmark measures exactly what the tests start. Each member listens on ports
chosen once (below the ephemeral range), so a member started again after a kill -9
keeps its member id (its intake address) and its place in the in-sync set, as a
supervised process does.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import bench_common  # noqa: F401  (puts the checkout first on sys.path)
import trio

from delayd.cluster.group_state import GroupState, lookup_group
from delayd.group_address import GroupAddress
from tests.etcd_support import EtcdServer
from tests.intake_support import ServeProcess

# What a benchmark's members accept at once: the intake client keeps thousands of
# messages in flight, and a failover's catch-up may lag by more than the defaults allow.
CONFIG = """\
[intake]
max_pending_acks = 1000000
max_replay_lag_records = 10000000
"""


# Below Linux's ephemeral range (32768-60999 by default): a member's ports must still
# be free when it restarts, and a port from that range may meanwhile be taken by any
# outgoing connection on the machine (a kernel-chosen port, such as tests/'s
# free_port() hands out).
STABLE_PORTS = range(21_000, 32_000)


def stable_port() -> int:
    """A loopback port below the ephemeral range that is free now."""
    while True:
        port = random.choice(STABLE_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def pinned(cpu: str | None) -> tuple[str, ...]:
    """The command prefix that runs a child on CPU ``cpu`` (none without taskset)."""
    return ("taskset", "-c", cpu) if cpu is not None and shutil.which("taskset") else ()


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``check()`` held, polled every 5 ms; RuntimeError naming ``what``
    after ``timeout_s``."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"not within {timeout_s} s: {what}")
        time.sleep(0.005)  # polling another process's state; nothing to wait on
    return time.monotonic() - started


class MemberExited(RuntimeError):
    """A member's process ended while the group was waited on."""

    def __init__(self, member: Member) -> None:
        super().__init__(f"member {member.member_id} exited; its log ends:\n{member.log_tail(15)}")
        self.member = member


class Member(ServeProcess):
    """One member: its ports fixed at creation, so every start has the same addresses."""

    def __init__(
        self, data_dir: Path, config: Path, cluster: tuple[str, ...], env: dict, cpu: str | None
    ) -> None:
        self.intake = f"127.0.0.1:{stable_port()}"
        self.broker = f"127.0.0.1:{stable_port()}"
        replication = f"127.0.0.1:{stable_port()}"
        super().__init__(
            data_dir,
            *cluster,
            "--config", str(config),
            "--listen", self.intake,
            "--broker-listen", self.broker,
            "--log-level", "info",
            env={**env, "DELAYD_CLUSTER_REPLICATION_LISTEN": replication},
            command_prefix=pinned(cpu),
        )  # fmt: skip
        self.member_id = self.intake.replace(":", "-")


@contextlib.contextmanager
def work_dir(prefix: str) -> Iterator[Path]:
    """A new temporary directory, removed afterwards unless the body raised: then it
    is kept (the members' logs say what went wrong) and its path printed to stderr."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield work
    except BaseException:
        print(f"kept {work} (the members' logs are *-serve.log)", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)


def log(text: str) -> None:
    """Progress, on stderr (stdout carries only the figures)."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def write_config(work: Path) -> Path:
    """The members' config file (CONFIG) in ``work``."""
    config = work / "bench.toml"
    config.write_text(CONFIG)
    return config


def lone_server(work: Path, cpu: str | None) -> Member:
    """A ``delayd serve`` of no group (flags and config as a member's), started: the
    single node a group is compared with."""
    return Member(work / "single", write_config(work), (), {}, cpu).start()


class ReplicatedGroup:
    """An etcd (pinned to ``etcd_cpu``) and a group of members under ``work``; each
    member is started by ``add``. ``close()`` kills everything."""

    def __init__(
        self,
        work: Path,
        *,
        lease_ttl_ms: int = 2000,
        ack: str = "sync",
        etcd_cpu: str | None = "1",
    ) -> None:
        self.work = work
        self.name = f"bench{uuid.uuid4().hex[:8]}"
        self.config = write_config(work)
        self.env = {"DELAYD_CLUSTER_LEASE_TTL_MS": str(lease_ttl_ms), "DELAYD_CLUSTER_ACK": ack}
        self.etcd = EtcdServer(work / "etcd", command_prefix=pinned(etcd_cpu)).start()
        self.members: list[Member] = []

    def add(self, cpu: str | None) -> Member:
        """A new member on CPU ``cpu``, started (it leads if it is the first)."""
        cluster = ("--etcd", self.etcd.url, "--group", self.name)
        data = self.work / f"m{len(self.members)}"
        member = Member(data, self.config, cluster, self.env, cpu)
        self.members.append(member)
        member.start()
        return member

    @property
    def member_list(self) -> str:
        """The group's address as a member list, ``h1:p1,h2:p2``."""
        return ",".join(member.intake for member in self.members)

    @property
    def etcd_address(self) -> str:
        """The group's address through etcd, ``etcd://host:port/GROUP``."""
        return f"etcd://{self.etcd.url.removeprefix('http://')}/{self.name}"

    def state(self) -> GroupState:
        return trio.run(lookup_group, GroupAddress(etcd=(self.etcd.url,), group=self.name))

    def leader(self) -> Member | None:
        """The member etcd names leader now (None while nobody leads)."""
        leader = self.state().leader
        by_id = {member.member_id: member for member in self.members}
        return by_id.get(leader.member_id) if leader is not None else None

    def wait_in_sync(self, timeout_s: float = 60) -> Member:
        """Wait until a member leads and every member is in the in-sync set; the leader.
        Raises MemberExited when a member's process ends meanwhile."""
        everyone = {member.member_id for member in self.members}

        def settled() -> bool:
            for member in self.members:
                if not member.alive:
                    raise MemberExited(member)
            state = self.state()
            return state.leader is not None and state.in_sync == everyone

        wait_until(settled, timeout_s, f"every member of {self.name} in sync")
        leader = self.leader()
        assert leader is not None
        return leader

    def close(self) -> None:
        for member in self.members:
            member.close()
        self.etcd.kill()
