"""delayd.serving.metrics_http over real HTTP on loopback: /metrics, /healthz, and /readyz
following the process's Readiness (503 with the reason while starting, 200 once ready)."""

from __future__ import annotations

from functools import partial

import trio
from prometheus_client import CollectorRegistry, Counter

from delayd.serving.metrics_http import Readiness, serve_metrics


async def http_get(address: tuple[str, int], path: str, method: str = "GET") -> tuple[int, str]:
    """Status code and body of one HTTP/1.0 request."""
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(f"{method} {path} HTTP/1.0\r\nHost: test\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


def registry_with_a_counter() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("delayd_test_things", "Things.", registry=registry).inc(3)
    return registry


async def test_readyz_is_503_with_the_reason_until_ready():
    readiness = Readiness("recovering message_log")
    registry = registry_with_a_counter()
    async with trio.open_nursery() as nursery:
        (address, *_) = await nursery.start(
            partial(serve_metrics, registry, "127.0.0.1", 0, readiness=readiness)
        )
        assert await http_get(address, "/readyz") == (503, "starting: recovering message_log\n")
        assert await http_get(address, "/healthz") == (200, "ok\n")  # alive all along
        status, body = await http_get(address, "/metrics")
        assert status == 200 and "delayd_test_things_total 3.0" in body

        readiness.starting("recovering replay")
        assert await http_get(address, "/readyz") == (503, "starting: recovering replay\n")
        readiness.set_ready()
        assert readiness.ready
        assert await http_get(address, "/readyz") == (200, "ready\n")
        nursery.cancel_scope.cancel()


async def test_without_a_readiness_readyz_is_always_ready_and_other_paths_are_refused():
    async with trio.open_nursery() as nursery:
        (address, *_) = await nursery.start(
            serve_metrics, registry_with_a_counter(), "127.0.0.1", 0
        )
        assert await http_get(address, "/readyz?verbose=1") == (200, "ready\n")
        status, body = await http_get(address, "/nope")
        assert status == 404 and "/readyz" in body
        status, body = await http_get(address, "/readyz", method="POST")
        assert status == 400 and "/readyz" in body
        nursery.cancel_scope.cancel()


def test_a_new_readiness_is_not_ready():
    readiness = Readiness()
    assert not readiness.ready and readiness.reason == "starting"


async def test_a_watched_problem_makes_a_serving_process_not_ready_while_it_lasts():
    readiness = Readiness("recovering")
    problem: list[str] = []
    readiness.watch(lambda: problem[0] if problem else None)
    async with trio.open_nursery() as nursery:
        (address, *_) = await nursery.start(
            partial(serve_metrics, registry_with_a_counter(), "127.0.0.1", 0, readiness=readiness)
        )
        problem.append("disk full: message_log refuses writes")
        # Starting wins: the problem is reported once the process serves.
        assert await http_get(address, "/readyz") == (503, "starting: recovering\n")
        readiness.set_ready()
        assert not readiness.ready
        assert await http_get(address, "/readyz") == (
            503,
            "not ready: disk full: message_log refuses writes\n",
        )
        assert (await http_get(address, "/metrics"))[0] == 200  # metrics stay up
        problem.clear()
        assert await http_get(address, "/readyz") == (200, "ready\n")
        nursery.cancel_scope.cancel()
