"""Machines for the fault tests: each member runs on its own *host*, a Linux network
namespace with its own address, joined to the others by a bridge (one veth pair per
host), so that a partition is a real one — packets dropped by iptables, or the host's
link down — and not a mock.

::

    network.host("a")            # a namespace with an address, loopback up (~30 ms)
    a.popen([...]) / a.run([...])  # a process inside it (``ip netns exec``)
    network.partition(a, b)      # a and b drop each other's packets; others still reach both
    network.heal()               # every partition ends
    a.cut() / a.restore()        # a's cable pulled: nobody reaches a, a reaches nobody

The test process itself sits in the root namespace, which has the bridge's first
address: it reaches every host (to read a server's STATS or consume), and partitions
never involve it (``cut`` does: a cut host is gone for everyone).

Names carry the pytest process's pid (``dn<pid>...``), so parallel xdist workers and
parallel sessions never share a bridge, a namespace or an interface name; a session
starts by removing what dead pids left behind (a crashed or killed run). Interface
names stay within Linux's 15 characters: ``dn<pid>br`` and ``dn<pid>v<n>``. Each worker
takes its own 10.N.0.0/16 (from ``PYTEST_XDIST_WORKER``, skipping any N a route on this
machine already uses), and host addresses are never reused within a session, so no ARP
cache ever points at a host that is gone.

Needs root, ``ip`` (iproute2) and ``iptables`` (Debian: ``apt-get install iptables``;
``.ci/run`` installs it). Without them the tests skip with the reason — except on CI
(``CI=true``), where they fail: a fault suite that silently skips proves nothing.
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from tests.etcd_support import EtcdServer

PREFIX = "dn"
OWNED_NAME = re.compile(rf"^{PREFIX}(\d+)(?:br$|v\d+$|-)")
LINK_UP_TIMEOUT_S = 5.0


def _ip(*args: str, stdin: str | None = None) -> None:
    """``ip ARGS``; raises with ip's own message on failure."""
    done = subprocess.run(["ip", *args], input=stdin, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool, package in (("ip", "iproute2"), ("iptables", "iptables")):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH: apt-get install {package} (.ci/run does)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except RuntimeError as exc:
        return f"cannot create a network namespace: {exc}"
    return None


def require_netns() -> None:
    """Skip the test when namespaces are unavailable; fail it on CI, where they must be."""
    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"the netns fault tests must run on CI: {reason}")
    pytest.skip(reason)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace_processes(namespace: str) -> None:
    """kill -9 every process inside ``namespace`` (those started by a host's children
    too), then wait until none is left."""
    for _ in range(50):
        done = subprocess.run(
            ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False
        )
        pids = [int(p) for p in done.stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


def remove_stale() -> list[str]:
    """Remove the namespaces and interfaces of pytest processes that are gone (a run
    that crashed or was killed before its finalizers); returns their names."""
    removed = []
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    for line in listing.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = OWNED_NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_namespace_processes(name)
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", name)
            removed.append(name)
    links = subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True, check=False
    )
    for line in links.stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        match = OWNED_NAME.match(name)
        if match and not _pid_alive(int(match.group(1))):
            with contextlib.suppress(RuntimeError):
                _ip("link", "del", name)
            removed.append(name)
    return removed


def worker_number() -> int:
    """0 without xdist, n + 1 for worker ``gw<n>``."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0


def free_subnet(worker: int) -> int:
    """An N such that no route on this machine overlaps 10.N.0.0/16, trying 64 +
    ``worker`` first and then the next ones (wrapping within 64..254)."""
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True)
    routed = []
    for line in routes.stdout.splitlines():
        with contextlib.suppress(ValueError):  # "default", "unreachable ...": no prefix
            routed.append(ipaddress.ip_network(line.split()[0], strict=False))
    candidates = range(64, 255)
    first = worker % len(candidates)
    for n in [*candidates[first:], *candidates[:first]]:
        subnet = ipaddress.ip_network(f"10.{n}.0.0/16")
        if not any(subnet.overlaps(r) for r in routed):
            return n
    raise RuntimeError("no free 10.N.0.0/16 for a test network: every one is routed")


class Host:
    """One machine of the test network: a namespace holding ``eth0`` at ``address``,
    whose peer ``veth`` in the root namespace is a port of the bridge."""

    def __init__(self, network: Network, name: str, index: int, lasting: bool) -> None:
        self.network = network
        self.name = name
        self.index = index
        self.lasting = lasting
        self.namespace = f"{network.prefix}-{index}-{name}"
        self.veth = f"{network.prefix}v{index}"
        self.address = f"10.{network.subnet}.{index >> 8}.{index & 255}"
        self.processes: list[subprocess.Popen] = []
        self.is_cut = False

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.address})"

    def _create(self) -> None:
        _ip("netns", "add", self.namespace)
        _ip(
            "-batch",
            "-",
            stdin=f"link add {self.veth} type veth peer name eth0 netns {self.namespace}\n"
            f"link set {self.veth} master {self.network.bridge} up\n",
        )
        _ip(
            "-n",
            self.namespace,
            "-batch",
            "-",
            stdin=f"addr add {self.address}/16 dev eth0\nlink set eth0 up\nlink set lo up\n",
        )

    @property
    def command_prefix(self) -> list[str]:
        """What to put before a command to run it on this host."""
        return ["ip", "netns", "exec", self.namespace]

    def popen(self, args: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``args`` on this host (``subprocess.Popen`` keywords pass through). ``ip
        netns exec`` execs the command itself, so the Popen's pid is the command's:
        ``kill()`` is a kill -9 of it. The host's finalizer kills whatever is left."""
        process = subprocess.Popen([*self.command_prefix, *args], **kwargs)
        self.processes.append(process)
        return process

    def run(
        self, args: Sequence[str], *, check: bool = True, timeout_s: float = 30.0, **kwargs
    ) -> subprocess.CompletedProcess:
        """Run ``args`` on this host to its end (output captured as text)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(
            [*self.command_prefix, *args], check=check, timeout=timeout_s, **kwargs
        )

    def iptables(self, rules: str) -> None:
        """Apply ``rules`` (iptables-restore lines of the filter table) on this host."""
        self.run(["iptables-restore", "-w", "--noflush"], input=f"*filter\n{rules}COMMIT\n")

    def cut(self) -> None:
        """Pull this host's cable: its link goes down at the bridge. Its processes keep
        running and keep their sockets; every packet to or from it is lost until
        ``restore()`` (TCP retransmits, then gives up, as over a dead switch port)."""
        _ip("link", "set", self.veth, "down")
        self.is_cut = True

    def restore(self) -> None:
        """Plug the cable back in; returns once the link is up at both ends (the
        kernel brings a link whose carrier came back into use up to a second later).
        As on a real network, a neighbour (ARP) request a host sent during the cut is
        answered only when retried, so its first packets may wait up to a second."""
        _ip("link", "set", self.veth, "up", "master", self.network.bridge)
        self.is_cut = False
        deadline = time.monotonic() + LINK_UP_TIMEOUT_S
        while not self._link_up():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self}: link not up {LINK_UP_TIMEOUT_S} s after restore")
            time.sleep(0.01)

    def _link_up(self) -> bool:
        inside = subprocess.run(
            ["ip", "-n", self.namespace, "-o", "link", "show", "eth0"],
            capture_output=True,
            text=True,
        )
        port = subprocess.run(
            ["bridge", "-o", "link", "show", "dev", self.veth], capture_output=True, text=True
        )
        return "state UP" in inside.stdout and "state forwarding" in port.stdout

    def kill_processes(self) -> None:
        """kill -9 everything running on this host."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        _kill_namespace_processes(self.namespace)
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)

    def destroy(self) -> None:
        """Processes first (a namespace lives on while a process is in it), then the
        veth pair (both ends go with the root one), then the namespace."""
        self.kill_processes()
        with contextlib.suppress(RuntimeError):
            _ip("link", "del", self.veth)
        with contextlib.suppress(RuntimeError):
            _ip("netns", "del", self.namespace)


class Network:
    """A bridge and the hosts on it. The root namespace holds the bridge's address
    (10.N.0.1), so the test process reaches every host; nothing is routed further."""

    def __init__(self) -> None:
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.bridge = f"{self.prefix}br"
        self.subnet = free_subnet(worker_number())
        self.address = f"10.{self.subnet}.0.1"
        self.hosts: list[Host] = []
        self.partitions: set[tuple[Host, Host]] = set()
        self._next_index = itertools.count(2)  # .1 is the bridge's

    def start(self) -> Network:
        # Bridged frames skip the root namespace's iptables (br_netfilter would
        # otherwise send them through its FORWARD chain, which a machine's firewall
        # may set to DROP): a partition is only ever the hosts' own rules.
        _ip("link", "add", self.bridge, "type", "bridge", "nf_call_iptables", "0")
        _ip("addr", "add", f"{self.address}/16", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        return self

    def host(self, name: str, *, lasting: bool = False) -> Host:
        """A new host named ``name`` (a label: several may share it) with the next
        address, reachable from every other host. ``lasting``: it outlives the test
        (the session's etcd), else the test's finalizer destroys it."""
        host = Host(self, name, next(self._next_index), lasting)
        self.hosts.append(host)
        host._create()
        return host

    def partition(self, a: Host, b: Host) -> None:
        """a and b lose every packet between them, both ways; each still reaches the
        other hosts. Rules sit in a's namespace (INPUT from b, OUTPUT to b)."""
        if (a, b) in self.partitions or (b, a) in self.partitions:
            return
        a.iptables(f"-A INPUT -s {b.address} -j DROP\n-A OUTPUT -d {b.address} -j DROP\n")
        self.partitions.add((a, b))

    def heal(self, a: Host | None = None, b: Host | None = None) -> None:
        """End the partition between a and b, or every partition when none are named."""
        for pair in sorted(self.partitions, key=lambda p: (p[0].index, p[1].index)):
            if a is None or {a, b} == set(pair):
                first, second = pair
                first.iptables(
                    f"-D INPUT -s {second.address} -j DROP\n-D OUTPUT -d {second.address} -j DROP\n"
                )
                self.partitions.discard(pair)

    def reset(self, *, everything: bool = False) -> None:
        """What a test leaves behind for the next one: partitions healed, cut links
        restored, its hosts destroyed — all but the session's lasting ones, unless
        ``everything``."""
        gone = [h for h in self.hosts if everything or not h.lasting]
        for host in gone:
            host.destroy()
        self.partitions = {p for p in self.partitions if not set(p) & set(gone)}
        self.hosts = [h for h in self.hosts if h not in gone]
        self.heal()
        for host in self.hosts:
            if host.is_cut:
                host.restore()

    def close(self) -> None:
        self.reset(everything=True)
        with contextlib.suppress(RuntimeError):
            _ip("link", "del", self.bridge)


@dataclass
class EtcdHost:
    """The session's etcd, on a host of its own (so that ``partition(member,
    etcd.host)`` cuts a member from etcd)."""

    host: Host
    server: EtcdServer

    @property
    def url(self) -> str:
        return self.server.url
