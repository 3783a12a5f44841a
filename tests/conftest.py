"""Fixtures every test module may ask for by name (pytest finds them here)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import trio.testing

from tests.audit_support import SPARK_TEST_CONF
from tests.delivery_support import Processes
from tests.etcd_support import EtcdProxy, EtcdServer


@pytest.fixture
def clock() -> trio.testing.MockClock:
    """Virtual time that jumps only after 50 ms of real idleness (pytest-trio runs a
    test on any Clock it is given). The store hops to worker threads — fsync, bucket
    loads, dispatch_log flushes — and a clock that jumped during such a hop, when every
    task looks blocked, would make the wheel look late when it is not."""
    return trio.testing.MockClock(autojump_threshold=0.05)


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
