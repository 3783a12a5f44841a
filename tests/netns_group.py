"""Servers on network-namespace hosts (tests/netns_support.py) for the fault tests:
``serve_on`` (one ``delayd serve``), and a replicated delay group (``DelayGroup``): each
member ``delayd serve --etcd ... --group ...`` on a host of its own, etcd on its own
(the session's ``netns_etcd``), and a standalone ``delayd broker`` on another, which
the group delivers into (a ``[[broker_groups]]`` target that is never killed), so that
what consumers see does not depend on any member's embedded broker.

Every host has all its ports, so a member listens on fixed ones (intake 7000, its
embedded broker 7001, replication 7002) and a restarted member comes back at the same
address: the same member id, as a real machine restarting.
"""

from __future__ import annotations

import select
import shutil
import subprocess
import uuid
from pathlib import Path

from delayd.cluster.group_state import GroupState
from delayd.logs import layout
from tests.intake_support import ServeProcess, write_config
from tests.netns_support import EtcdHost, Host, Network
from tests.process_support import DELAYD, ROOT, child_env
from tests.test_cluster_roles import state, wait_until

PORT, BROKER_PORT, REPLICATION_PORT = 7000, 7001, 7002
LEASE_TTL_MS = 1000  # the shortest etcd grants: a killed leader is replaced in ~1-1.5 s
BROKER_START_S = 20.0


def serve_on(host: Host, data_dir: Path, config: str = "") -> ServeProcess:
    """``delayd serve`` on ``host`` (not started) at its fixed ports, with timings for
    fault tests (frequent checkpoints and dispatch_log flushes, a short wheel
    look-ahead) and ``config`` added; its config file beside ``data_dir``."""
    path = write_config(
        data_dir.parent / f"{data_dir.name}.toml",
        "[replay]\ncheckpoint_interval_ms = 100\n"
        "[wheel]\nload_ahead_ms = 300\n"
        "[delivery]\nmax_batch = 32\ndispatch_flush_interval_ms = 100\n" + config,
    )
    return ServeProcess(
        data_dir,
        "--config",
        path,
        "--listen",
        f"{host.address}:{PORT}",
        "--broker-listen",
        f"{host.address}:{BROKER_PORT}",
        metrics_listen="off",
        command_prefix=tuple(host.command_prefix),
    )


class StandaloneBroker:
    """``delayd broker`` alone (no group) on ``host``: the target every member delivers
    into, and where consumers read. Never killed by the tests."""

    def __init__(self, host: Host, data_dir: Path) -> None:
        self.host = host
        self.address = f"{host.address}:{BROKER_PORT}"
        self.log_path = data_dir.parent / f"{data_dir.name}-broker.log"
        with open(self.log_path, "ab") as log:
            self.process = host.popen(
                [*DELAYD, "broker", "--data", str(data_dir), "--listen", self.address,
                 "--metrics-listen", "off"],
                cwd=ROOT,
                env=child_env(),
                stdout=subprocess.PIPE,
                stderr=log,
            )  # fmt: skip
        self._wait_ready()

    def _wait_ready(self) -> None:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], BROKER_START_S)
        line = self.process.stdout.readline().decode(errors="replace") if ready else ""
        if "listening on" not in line:
            log = self.log_path.read_text(errors="replace")[-3000:]
            raise AssertionError(f"the standalone broker did not start: {line!r}\n{log}")


class DelayGroup:
    """Members of one delay group, each on its own host, delivering into ``broker``.
    ``members[name]`` is a ``ServeProcess`` (not started until ``start``)."""

    def __init__(
        self,
        network: Network,
        etcd: EtcdHost,
        tmp_path: Path,
        broker: StandaloneBroker,
        names: tuple[str, ...] = ("a", "b"),
    ) -> None:
        self.etcd = etcd
        self.name = f"g{uuid.uuid4().hex[:10]}"
        self.epoch_seen: int | None = None  # with the leader ``wait_leader`` saw
        self.hosts = {name: network.host(name) for name in names}
        self.members = {
            name: self._member(host, tmp_path, broker) for name, host in self.hosts.items()
        }

    def _member(self, host: Host, tmp_path: Path, broker: StandaloneBroker) -> ServeProcess:
        return serve_on(
            host,
            tmp_path / host.name,
            f'[[broker_groups]]\nname = "ext"\naddresses = ["{broker.address}"]\n'
            f'[cluster]\netcd = "{self.etcd.url}"\ngroup = "{self.name}"\n'
            f'lease_ttl_ms = {LEASE_TTL_MS}\nack = "sync"\n'
            f'replication_listen = "{host.address}:{REPLICATION_PORT}"\n',
        )

    @property
    def addresses(self) -> str:
        """The member list a client is given: ``a:7000,b:7000``."""
        return ",".join(f"{h.address}:{PORT}" for h in self.hosts.values())

    def member_id(self, name: str) -> str:
        return f"{self.hosts[name].address}-{PORT}"

    def name_of(self, member_id: str | None) -> str | None:
        return next((n for n in self.hosts if self.member_id(n) == member_id), None)

    def state(self) -> GroupState:
        return state(self.etcd.url, self.name)

    def leader(self) -> str | None:
        """The name of the member holding the leader key, None when nobody does."""
        leader = self.state().leader
        return self.name_of(leader.member_id) if leader else None

    def epoch(self) -> int | None:
        return self.state().epoch

    def start(self, name: str) -> ServeProcess:
        return self.members[name].start()

    def start_all(self) -> None:
        """The first member leads, then the others follow and join the in-sync set."""
        first, *others = self.members
        self.start(first)
        wait_until(lambda: self.leader() == first, 30, f"{first} leads")
        for name in others:
            self.start(name)
        self.wait_in_sync(*self.members)

    def wait_in_sync(self, *names: str, timeout_s: float = 20.0) -> None:
        """Until the in-sync set in etcd holds exactly ``names``."""
        wanted = {self.member_id(n) for n in names}
        wait_until(lambda: self.state().in_sync == wanted, timeout_s, f"in sync: {names}")

    def wait_leader(self, *, other_than: str | None = None, timeout_s: float = 30.0) -> str:
        """Until a member other than ``other_than`` leads; its name (as seen then: on
        a starved machine a leader may step down again a moment later)."""
        seen: list[str] = []

        def led() -> bool:
            state = self.state()
            leader = self.name_of(state.leader.member_id) if state.leader else None
            if leader is None or leader == other_than:
                return False
            seen.append(leader)
            self.epoch_seen = state.epoch
            return True

        wait_until(led, timeout_s, f"a leader other than {other_than}")
        return seen[-1]

    def wipe(self, name: str) -> None:
        """Remove the member's data directory (its disk replaced): it has to copy
        everything again."""
        shutil.rmtree(self.members[name].data_dir)

    def wait_identical_copies(self, timeout_s: float = 15.0) -> None:
        """Until every member holds the leader's message_log and dispatch_log byte for
        byte (each file the leader has, as ``differences`` compares them; its retention
        may have deleted what followers keep). Call once the load stopped; fails naming
        the files that differ."""
        leader = self.wait_leader()
        differing: list[str] = []

        def identical() -> bool:
            differing[:] = [
                f"{name}: {path}"
                for name in self.members
                if name != leader
                for path in differences(self.members[leader].data_dir, self.members[name].data_dir)
            ]
            return not differing

        try:
            wait_until(identical, timeout_s, "identical copies")
        except AssertionError:
            raise AssertionError(f"copies differ from the leader {leader}'s: {differing}") from None

    def log(self, name: str) -> str:
        return self.members[name].log_path.read_text(errors="replace")

    def close(self) -> None:
        for member in self.members.values():
            member.close()


def read_if_there(path: Path) -> bytes | None:
    """``path``'s bytes, or None if there is no such file (now)."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def differences(leader_dir: Path, follower_dir: Path) -> list[str]:
    """The replicated files of ``leader_dir`` whose copy in ``follower_dir`` is not
    the same bytes: a message_log segment must be equal; a dispatch_log bucket's copy
    must be the leader's bytes up to its own length (a COMPLETE mark the wheel writes
    once a bucket is done is shipped at the sender's next flush, which an idle leader
    has not made yet: docs/replication.md, "Still to do")."""
    found = []
    for directory, whole in ((layout.message_log_dir, True), (layout.dispatch_log_dir, False)):
        source = Path(directory(str(leader_dir)))
        copy = Path(directory(str(follower_dir)))
        for path in sorted(source.iterdir()) if source.exists() else ():
            if not path.name.isdigit():
                continue
            # The members run while we look: a file listed may be gone when read (a
            # follower cut back or resyncing, retention). Gone from the leader: nothing
            # to compare; the follower's copy is read as its bytes now, or none.
            original = read_if_there(path)
            if original is None:
                continue
            held = read_if_there(copy / path.name) or b""
            if held != original if whole else not original.startswith(held):
                found.append(str(path.relative_to(leader_dir)))
    return found
