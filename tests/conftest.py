"""Fixtures every test module may ask for by name (pytest finds them here)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import trio.testing

from tests.audit_support import SPARK_TEST_CONF
from tests.delivery_support import Processes
from tests.etcd_support import EtcdProxy, EtcdServer
from tests.netns_support import EtcdHost, Network, remove_stale, require_netns


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules in the order the two workers of ``make test`` should take them: the
    longest first, so that the many short ones fill in at the end and both workers
    finish together. The ``netns`` fault modules first, then the other ``slow`` ones,
    then the rest; within each, the modules with more tests first. (xdist's own order,
    turned off in the Makefile, takes modules by their number of tests alone, which put
    the single-test fault modules of a minute each last.)"""
    tests_in: dict[str, int] = {}
    rank: dict[str, int] = {}
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        tests_in[module] = tests_in.get(module, 0) + 1
        kind = (
            0 if item.get_closest_marker("netns") else 1 if item.get_closest_marker("slow") else 2
        )
        rank[module] = min(rank.get(module, kind), kind)

    def order(item: pytest.Item) -> tuple[int, int]:
        module = item.nodeid.split("::", 1)[0]
        return rank[module], -tests_in[module]

    items.sort(key=order)  # stable: a module's tests stay together and in their order


@pytest.fixture
def clock(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> trio.testing.MockClock:
    """Virtual time that jumps only after 50 ms of real idleness (pytest-trio runs a
    test on any Clock it is given), and never while a worker thread runs. The store
    hops to worker threads — fsync, bucket loads, dispatch_log flushes, a cancel's
    reads — and a clock that jumped during such a hop, when every task looks blocked,
    would deliver a message due minutes later before the cancel waiting on that hop is
    decided (a loaded machine makes a hop outlast any threshold).

    A test marked ``instant_autojump`` waits on nothing real but worker threads (no
    sockets, no other process, no disk-space or retention timers reading the wall
    clock): its time jumps as soon as every task blocks. Each jump of the default
    costs 50 ms of wall time, and a test with a sender retrying every 10 ms for a
    virtual minute makes thousands."""
    threshold_s = 0 if request.node.get_closest_marker("instant_autojump") else 0.05
    monkeypatch.setattr(trio.to_thread, "run_sync", _holding_virtual_time(trio.to_thread.run_sync))
    return trio.testing.MockClock(autojump_threshold=threshold_s)


# How long a worker thread holds virtual time at most: longer than a disk operation on a
# loaded machine; a thread that waits for the test itself (a gate) lets it go on after.
HOLD_VIRTUAL_TIME_S = 2.0


def _holding_virtual_time(run_sync):
    """``trio.to_thread.run_sync`` that keeps a task runnable (yielding, never blocked)
    while a worker thread runs that began less than HOLD_VIRTUAL_TIME_S ago: the
    autojump waits for every task to block. The hold is each thread's own: threads
    that overlap back to back (a busy pipeline's fsyncs and loads) hold virtual time
    for as long as they keep coming, not for HOLD_VIRTUAL_TIME_S in all."""
    starts: list[float] = []  # when each running worker thread began
    holding = [False]

    async def keep_runnable() -> None:
        try:
            while starts and time.monotonic() - max(starts) < HOLD_VIRTUAL_TIME_S:
                await trio.sleep(0)
        finally:
            holding[0] = False

    async def run_sync_holding(fn, *args, **options):
        start = time.monotonic()
        starts.append(start)
        if not holding[0]:
            holding[0] = True
            trio.lowlevel.spawn_system_task(keep_runnable)
        try:
            return await run_sync(fn, *args, **options)
        finally:
            starts.remove(start)

    return run_sync_holding


@pytest.fixture
def procs(tmp_path):
    """``delayd serve`` / ``delayd broker`` children under ``tmp_path``; every one still
    running is killed when the test ends, pass or fail."""
    processes = Processes(tmp_path)
    try:
        yield processes
    finally:
        processes.close()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """The session's etcd (one per xdist worker)."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd") / "data").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_prefix(etcd_server: EtcdServer) -> str:
    """A key prefix no other test uses, so tests sharing the etcd never see each other."""
    return f"/test/{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def etcd_proxy(etcd_server: EtcdServer, nursery: trio.Nursery) -> EtcdProxy:
    """A proxy in front of the session's etcd that can cut or reset the link, serving
    in the test's trio run until the test ends."""
    proxy = EtcdProxy(etcd_server.url)
    await nursery.start(proxy.serve)
    return proxy


@pytest.fixture(scope="session")
def spark_session():
    """One local SparkSession for the audit tests of a run (a JVM start costs seconds);
    `delayd audit` run in-process finds it and leaves it running."""
    from delayd.audit.spark.session import local_session  # pyspark: only the audit tests load it

    spark = local_session("local[2]", SPARK_TEST_CONF)
    try:
        yield spark
    finally:
        spark.stop()


@pytest.fixture(scope="session")
def netns_session() -> Iterator[Network]:
    """The worker's network, for the whole session (fails on CI without root)."""
    require_netns()
    remove_stale()
    network = Network().start()
    try:
        yield network
    finally:
        network.close()


@pytest.fixture
def network(netns_session: Network) -> Iterator[Network]:
    """The network for one test: the hosts it makes are destroyed after it (their
    processes killed first), its partitions healed and cut links restored, so the
    session's own hosts (etcd) come back whole for the next test."""
    yield netns_session
    netns_session.reset()


@pytest.fixture(scope="session")
def netns_etcd(
    netns_session: Network, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EtcdHost]:
    """One etcd per session (per xdist worker), on its own host of the network."""
    host = netns_session.host("etcd", lasting=True)
    data = tmp_path_factory.mktemp("netns-etcd") / "data"
    server = EtcdServer(data, listen_host=host.address, command_prefix=host.command_prefix)
    server.start()
    try:
        yield EtcdHost(host, server)
    finally:
        server.stop()
