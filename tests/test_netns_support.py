"""The multi-host harness itself: hosts reach each other, a partition drops exactly the
pair it names, a cut host is gone for everyone until restored, etcd on its own host
can be partitioned away, setup is cheap, and nothing outlives a test or a dead run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.netns_support import (
    OWNED_NAME,
    PREFIX,
    Host,
    Network,
    _ip,
    free_subnet,
    remove_stale,
    require_netns,
    worker_number,
)

pytestmark = pytest.mark.netns
PORT = 7000

LISTEN = """
import socket, sys
s = socket.create_server((sys.argv[1], {port}))
print("up", flush=True)
while True:
    s.accept()[0].close()
"""
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], {port}), timeout=float(sys.argv[2]))
except OSError as exc:
    sys.exit(str(exc))
"""


def listen(host: Host) -> subprocess.Popen:
    """A TCP listener on ``host`` that accepts every connection."""
    process = host.popen(
        [sys.executable, "-c", LISTEN.format(port=PORT), host.address],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline() == "up\n"
    return process


def connects(source: Host, target: Host, timeout_s: float) -> bool:
    done = source.run(
        [sys.executable, "-c", CONNECT.format(port=PORT), target.address, str(timeout_s)],
        check=False,
    )
    return done.returncode == 0


def reaches(source: Host, target: Host) -> bool:
    """Whether a TCP connection from ``source`` to ``target`` opens. The time allowed
    covers a lost first SYN (TCP sends it again after 1 s): after a restore or a heal,
    a neighbour (ARP) request sent during the fault is answered only when it is
    retried, as on a real network."""
    return connects(source, target, 3.0)


def blocked(source: Host, target: Host) -> bool:
    """Whether a TCP connection from ``source`` to ``target`` fails to open in 0.3 s
    (on a bridge it takes a millisecond)."""
    return not connects(source, target, 0.3)


def namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in listing.stdout.splitlines() if line.strip()}


def test_hosts_reach_each_other_and_the_test_process_reaches_them(network: Network):
    a, b = network.host("a"), network.host("b")
    listen(a)
    assert a.address != b.address
    assert reaches(b, a)
    socket_from_root = subprocess.run(
        [sys.executable, "-c", CONNECT.format(port=PORT), a.address, "3"], check=False
    )
    assert socket_from_root.returncode == 0
    # each host has every port of its own: the same port twice, no clash
    listen(b)
    assert reaches(a, b)


def test_a_partition_drops_only_the_pair(network: Network):
    a, b, c = network.host("a"), network.host("b"), network.host("c")
    for host in (a, b, c):
        listen(host)
    network.partition(a, b)
    assert blocked(b, a) and blocked(a, b)
    assert reaches(c, a) and reaches(c, b) and reaches(a, c)
    network.partition(c, b)
    network.heal(a, b)
    assert reaches(b, a) and reaches(a, b)
    assert blocked(c, b)  # the other partition stays
    network.heal()
    assert reaches(c, b)


def test_a_cut_host_is_gone_for_everyone_until_restored(network: Network):
    a, b, c = network.host("a"), network.host("b"), network.host("c")
    listen(a)
    listen(b)
    a.cut()
    assert blocked(b, a) and blocked(c, a) and blocked(a, b)
    assert reaches(c, b)
    a.restore()
    assert reaches(b, a) and reaches(a, b)


def test_etcd_on_its_own_host_can_be_partitioned_away(network: Network, netns_etcd):
    member, other = network.host("member"), network.host("other")
    health = (
        "import sys, urllib.request\n"
        "urllib.request.urlopen(sys.argv[1] + '/health', timeout=0.5).read()\n"
    )

    def healthy(host: Host) -> bool:
        return host.run([sys.executable, "-c", health, netns_etcd.url], check=False).returncode == 0

    assert netns_etcd.url.startswith(f"http://{netns_etcd.host.address}:")
    assert healthy(member) and healthy(other)
    network.partition(member, netns_etcd.host)
    assert not healthy(member)
    assert healthy(other)
    with urllib.request.urlopen(netns_etcd.url + "/health", timeout=1) as answer:
        assert b"true" in answer.read()  # the test process still reaches it
    network.heal()
    assert healthy(member)


def test_setup_is_cheap(network: Network):
    started = time.monotonic()
    hosts = [network.host(f"h{i}") for i in range(5)]
    assert (time.monotonic() - started) / len(hosts) < 0.5
    started = time.monotonic()
    network.partition(hosts[0], hosts[1])
    network.heal()
    assert time.monotonic() - started < 0.5


def test_the_finalizer_kills_processes_and_removes_hosts(netns_session: Network):
    """What the ``network`` fixture's finalizer does after every test."""
    a = netns_session.host("a")
    direct = listen(a)
    # a grandchild the host did not start itself: found through the namespace
    a.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 &"])
    a.cut()
    netns_session.partition(a, netns_session.host("b"))
    netns_session.reset()
    assert direct.poll() is not None
    assert a.namespace not in namespaces()
    assert not netns_session.partitions
    assert not [h for h in netns_session.hosts if not h.lasting]
    links = subprocess.run(["ip", "-o", "link", "show", a.veth], capture_output=True)
    assert links.returncode != 0, "the veth pair is gone"


def test_what_a_dead_run_left_is_removed_at_session_start():
    require_netns()
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid is now free: a run that died
    namespace, bridge = f"{PREFIX}{dead.pid}-2-a", f"{PREFIX}{dead.pid}br"
    _ip("netns", "add", namespace)
    _ip("link", "add", bridge, "type", "bridge")
    sleeper = subprocess.Popen(["ip", "netns", "exec", namespace, "sleep", "60"])
    ours = f"{PREFIX}{os.getpid()}-1-mine"  # a live run's: kept
    _ip("netns", "add", ours)
    try:
        removed = remove_stale()
        assert namespace in removed and bridge in removed
        assert ours not in removed and ours in namespaces()
        assert namespace not in namespaces()
        assert sleeper.wait(5) == -9
    finally:
        _ip("netns", "del", ours)


def test_a_subnet_already_routed_is_skipped(netns_session: Network):
    taken = netns_session.subnet
    assert free_subnet(taken - 64) != taken
    assert free_subnet(taken - 64 + 190) != taken  # wraps within 64..254
    assert 64 <= free_subnet(10_000) <= 254


def test_names_fit_linux_limits_and_differ_per_worker(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert worker_number() == 4
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert worker_number() == 0
    longest_pid = 4194304  # the kernel's largest pid_max
    for name in (f"{PREFIX}{longest_pid}br", f"{PREFIX}{longest_pid}v9999"):
        assert len(name) <= 15 and OWNED_NAME.match(name)
    assert not OWNED_NAME.match("dnsmasq0")


def test_unavailable_fails_on_ci_and_skips_elsewhere(monkeypatch):
    import tests.netns_support as support

    monkeypatch.setattr(support, "unavailable_reason", lambda: "network namespaces need root")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"must run on CI: .*need root"):
        require_netns()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="need root"):
        require_netns()
