"""Start-up and shutdown of the real processes: one writer per data directory (a second
``delayd serve`` or ``delayd broker`` is refused, naming the holder), the lock freed on
exit and by kill -9, and ports bound before recovery (a port in use is reported at once,
naming the listener, before the data directory is recovered)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import trio

from delayd.protocol import Message
from delayd.server.app import DelayServer, open_listeners, serve_metrics_early
from delayd.server.config import ServeConfig
from storage.dirlock import LOCK_NAME, read_holder
from tests.broker_support import BrokerProcess
from tests.intake_support import RawClient, ServeProcess, ok, read_message_log, terminate
from tests.process_support import DELAYD, ROOT, child_env
from tests.test_metrics_http import http_get

REFUSAL_TIMEOUT_S = 10.0  # a refused start exits in well under a second


def run_to_exit(*args: str) -> tuple[int, str, float]:
    """``delayd ARGS`` to its exit: (exit code, log, seconds taken)."""
    started = time.monotonic()
    done = subprocess.run(
        [*DELAYD, *args],
        cwd=ROOT,
        capture_output=True,
        env=child_env(),
        timeout=REFUSAL_TIMEOUT_S,
        check=False,
    )
    return done.returncode, done.stderr.decode(errors="replace"), time.monotonic() - started


def second_serve(data: Path) -> tuple[int, str, float]:
    return run_to_exit(
        "serve", "--data", str(data), "--listen", "127.0.0.1:0", "--broker-listen",
        "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--http-listen", "off",
    )  # fmt: skip


def second_broker(data: Path) -> tuple[int, str, float]:
    return run_to_exit(
        "broker", "--data", str(data), "--listen", "127.0.0.1:0", "--metrics-listen", "off"
    )


def send(address: tuple[str, int], prefix: str, count: int = 10) -> None:
    due = int(time.time() * 1000) + 3_600_000
    client = RawClient(address)
    try:
        batch = [Message(f"{prefix}-{i}", "orders", body=b"b", at_ms=due) for i in range(count)]
        ok(client.send_batch(batch))
    finally:
        client.close()


def assert_names_holder(log: str, pid: int, command: str) -> None:
    assert "is in use by" in log, log
    assert f"pid {pid} on host {socket.gethostname()}" in log, log
    assert command in log, log
    assert "Stop that process" in log, log  # what to do about it


def test_a_second_serve_or_broker_is_refused_and_the_first_keeps_serving(tmp_path, procs):
    data = tmp_path / "data"
    first = procs.start(ServeProcess(data))
    assert first.proc is not None and first.address is not None
    send(first.address, "before")

    for attempt in (second_serve, second_broker):
        code, log, seconds = attempt(data)
        assert code == 1, log
        assert_names_holder(log, first.proc.pid, "delayd serve")
        assert seconds < REFUSAL_TIMEOUT_S

    assert read_holder(str(data)).pid == first.proc.pid  # nobody wrote over the name
    send(first.address, "after")  # the first still serves
    terminate(first)
    ids = [record.message_id for _, record in read_message_log(data)]
    assert ids == [f"before-{i}" for i in range(10)] + [f"after-{i}" for i in range(10)]


def test_a_second_broker_on_a_broker_directory_is_refused(tmp_path, procs):
    data = tmp_path / "broker"
    first = procs.start(BrokerProcess(data))
    assert first.proc is not None
    for attempt in (second_broker, second_serve):
        code, log, _ = attempt(data)
        assert code == 1, log
        assert_names_holder(log, first.proc.pid, "delayd broker")
    with first.client() as client:  # the first still takes and serves messages
        sent = [Message(f"m-{i}", "orders", body=b"b") for i in range(5)]
        assert all(r.code.name == "OK" for r in client.send_batch(sent))
        got = client.drain("orders", "g", "c1")
        assert sorted(m.message_id for m in got) == [f"m-{i}" for i in range(5)]
    assert first.metrics_address is not None  # served from before recovery, then ready
    readyz = urllib.request.urlopen(f"http://{host_port(first.metrics_address)}/readyz")
    assert readyz.read() == b"ready\n"
    metrics = urllib.request.urlopen(f"http://{host_port(first.metrics_address)}/metrics")
    assert b"delayd_broker_" in metrics.read()  # the broker's collectors joined
    assert first.stop() == 0


def host_port(address: tuple[str, int]) -> str:
    return "{}:{}".format(*address)


def test_the_lock_is_freed_on_exit_and_by_kill_9(tmp_path, procs):
    data = tmp_path / "data"
    server = procs.start(ServeProcess(data))
    assert server.address is not None
    send(server.address, "one")
    terminate(server)
    assert (data / LOCK_NAME).read_bytes() == b""  # released, naming nobody

    server.start()
    assert server.proc is not None and server.address is not None
    send(server.address, "two")
    killed_pid = server.proc.pid
    server.kill()
    assert read_holder(str(data)).pid == killed_pid  # the stale name stays…

    server.start()  # …but the kernel freed the lock: the restart takes it
    assert server.proc is not None and server.address is not None
    assert read_holder(str(data)).pid == server.proc.pid
    send(server.address, "three")
    terminate(server)
    ids = {record.message_id for _, record in read_message_log(data)}
    assert ids == {f"{p}-{i}" for p in ("one", "two", "three") for i in range(10)}


@pytest.fixture
def taken_port():
    """A port of 127.0.0.1 another socket listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize(
    ("flag", "name"),
    [
        ("--listen", "intake"),
        ("--broker-listen", "the broker"),
        ("--metrics-listen", "metrics"),
        ("--http-listen", "the HTTP API"),
    ],
)
def test_a_port_in_use_stops_serve_before_recovery(tmp_path, taken_port, flag, name):
    """Each listener is bound before recovery: the clash ends the start at once, exit 1,
    the listener and address named, and nothing of the data directory recovered or
    made (only the lock file exists)."""
    data = tmp_path / "data"
    ports = {"--listen": "127.0.0.1:0", "--broker-listen": "127.0.0.1:0"}
    ports["--metrics-listen"] = ports["--http-listen"] = "127.0.0.1:0"
    ports[flag] = f"127.0.0.1:{taken_port}"
    args = [part for pair in ports.items() for part in pair]
    code, log, seconds = run_to_exit("serve", "--data", str(data), *args)
    assert code == 1, log
    assert f"cannot listen for {name} on 127.0.0.1:{taken_port}" in log, log
    assert "Address already in use" in log, log
    assert seconds < REFUSAL_TIMEOUT_S
    assert os.listdir(data) == [LOCK_NAME]  # no log opened, nothing recovered
    assert (data / LOCK_NAME).read_bytes() == b""  # and the lock released


def test_a_port_in_use_stops_the_broker_before_recovery(tmp_path, taken_port):
    data = tmp_path / "broker"
    for args in (
        ["--listen", f"127.0.0.1:{taken_port}", "--metrics-listen", "off"],
        ["--listen", "127.0.0.1:0", "--metrics-listen", f"127.0.0.1:{taken_port}"],
    ):
        code, log, _ = run_to_exit("broker", "--data", str(data), *args)
        assert code == 1, log
        name = "the broker" if args[1].endswith(str(taken_port)) else "metrics"
        assert f"cannot listen for {name} on 127.0.0.1:{taken_port}" in log, log
        assert os.listdir(data) == [LOCK_NAME]


async def test_health_and_readiness_answer_while_the_server_recovers(tmp_path):
    """The metrics listener is served from before recovery: /healthz 200 and /readyz
    503 "recovering" while DelayServer.open runs (held here between the two steps);
    then the server's collectors join the same endpoint and /readyz turns 200."""
    config = ServeConfig(
        listen=("127.0.0.1", 0),
        broker_listen=None,
        metrics_listen=("127.0.0.1", 0),
        http_listen=None,
    )
    listeners = await open_listeners(config)
    async with trio.open_nursery() as nursery:
        endpoint = await nursery.start(serve_metrics_early, listeners.metrics, "recovering X")
        address = endpoint.address
        assert await http_get(address, "/healthz") == (200, "ok\n")
        assert await http_get(address, "/readyz") == (503, "starting: recovering X\n")
        status, text = await http_get(address, "/metrics")
        assert status == 200 and "delayd_" not in text  # nothing to report yet

        server = await trio.to_thread.run_sync(DelayServer.open, str(tmp_path / "d"), config)
        run = partial(server.run, listeners=replace(listeners, metrics=None), metrics=endpoint)
        async with trio.open_nursery() as serving:
            bound = await serving.start(run)
            assert bound.metrics == address
            for _ in range(500):
                if (await http_get(address, "/readyz"))[0] == 200:
                    break
                await trio.sleep(0.01)
            assert await http_get(address, "/readyz") == (200, "ready\n")
            status, text = await http_get(address, "/metrics")
            assert status == 200 and "delayd_intake" in text  # the server's collectors
            server.request_stop()
        nursery.cancel_scope.cancel()
