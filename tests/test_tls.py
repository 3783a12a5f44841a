"""TLS in process: contexts from files (errors naming the file), a broker listener over
TLS with the async and blocking clients and the sender's RemoteTarget, mutual TLS,
reload, the handshake kept off the accept loop, and /metrics over TLS.

Certificates are made per test by trustme (tests/tls_support.py); sockets are real.
"""

from __future__ import annotations

import socket
import ssl
import time
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from prometheus_client import CollectorRegistry, Counter

from delayd.broker import Broker, BrokerConfig
from delayd.broker.server import serve_broker
from delayd.client import ClientTls, Consumer, Producer, open_producer
from delayd.errors import DelaydTimeout
from delayd.protocol import (
    NEED_DATA,
    PROTOCOL_VERSION,
    SERVER,
    Connection,
    ConnectionClosed,
    Error,
    ErrorCode,
    Hello,
    HelloOk,
    Message,
    ResultCode,
)
from delayd.protocol.redirect import not_leader_reason
from delayd.sender import RemoteTarget, TargetUnavailable
from delayd.server.config import ConfigError, config_from_mapping
from delayd.server.config_print import config_to_toml
from delayd.serving.metrics_http import serve_metrics
from delayd.serving.tls import ServerTls, server_context
from delayd.tls import ServerTlsConfig, TlsError
from tests.tls_support import Pki, make_pki

CONFIG = BrokerConfig(index_slot_count=1009, index_max_entries=50, dedupe_max_ids=1000)
HELLO_TIMEOUT_MS = 1000


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


@asynccontextmanager
async def tls_broker(data_dir: Path, tls: ServerTls | None):
    """A broker in this process, its listener on a free loopback port over ``tls``
    (None: plain TCP); yields its ``host:port``."""
    config = BrokerConfig(
        index_slot_count=1009,
        index_max_entries=50,
        dedupe_max_ids=1000,
        hello_timeout_ms=HELLO_TIMEOUT_MS,
    )
    broker = await trio.to_thread.run_sync(Broker.open, str(data_dir), config)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(broker.run)
            bound = await nursery.start(partial(serve_broker, broker, "127.0.0.1", 0, tls=tls))
            yield "{}:{}".format(*bound[0])
            nursery.cancel_scope.cancel()
    finally:
        broker.close()


def due(prefix: str, count: int) -> list[Message]:
    return [
        Message(f"{prefix}-{i}", "orders", body=b"x", due_ms=1_700_000_000_000 + i)
        for i in range(count)
    ]


# ------------------------------------------------------------ contexts and files


def test_a_missing_or_wrong_file_is_named_with_what_is_wrong(pki: Pki, tmp_path: Path):
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(TlsError, match=r"certificate file .*nope\.pem: cannot be read"):
        server_context(ServerTlsConfig(missing, pki.server_key))
    with pytest.raises(TlsError, match=r"key file .*nope\.pem: cannot be read"):
        server_context(ServerTlsConfig(pki.server_cert, missing))
    # The client's key with the server's certificate: a pair that does not match.
    with pytest.raises(TlsError, match=r"server\.pem with key file .*client\.key: key values"):
        server_context(ServerTlsConfig(pki.server_cert, pki.client_key))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(TlsError, match=r"client CA file .*garbage\.pem: .*PEM certificates"):
        server_context(ServerTlsConfig(pki.server_cert, pki.server_key, str(garbage)))
    with pytest.raises(TlsError, match=r"CA file .*garbage\.pem"):
        _ = ClientTls(str(garbage)).ssl_context
    with pytest.raises(ValueError, match="both cert_file and key_file"):
        ClientTls(pki.ca_file, cert_file=pki.client_cert)


def test_a_reload_with_a_bad_file_keeps_the_context_in_use(pki: Pki, tmp_path: Path):
    tls = ServerTls(pki.server())
    before = tls.context
    Path(pki.server_key).write_text("broken\n")
    assert tls.reload() is False
    assert tls.context is before
    other = make_pki(tmp_path / "other")
    Path(pki.server_key).write_bytes(Path(other.server_key).read_bytes())
    Path(pki.server_cert).write_bytes(Path(other.server_cert).read_bytes())
    assert tls.reload() is True
    assert tls.context is not before


def test_the_tls_table_and_broker_group_keys_are_read_checked_and_printed(pki: Pki):
    document = {
        "tls": {"cert_file": pki.server_cert, "key_file": pki.server_key},
        "broker_groups": [
            {"name": "far", "addresses": ["10.0.0.1:20811"], "tls_ca_file": pki.ca_file}
        ],
    }
    config = config_from_mapping(document, source="delayd.toml")
    assert config.tls == ServerTlsConfig(pki.server_cert, pki.server_key)
    assert config.broker_groups[0].tls == ClientTls(pki.ca_file)
    printed = config_to_toml(config)
    assert f'cert_file = "{pki.server_cert}"' in printed
    assert f'tls_ca_file = "{pki.ca_file}"' in printed
    with pytest.raises(ConfigError, match=r"delayd\.toml: tls: set both tls\.cert_file"):
        config_from_mapping({"tls": {"client_ca_file": pki.ca_file}}, source="delayd.toml")
    with pytest.raises(ConfigError, match=r"broker_groups\.far: tls_cert_file .* need tls_ca_file"):
        config_from_mapping(
            {
                "broker_groups": [
                    {"name": "far", "addresses": ["h:1"], "tls_cert_file": pki.client_cert}
                ]
            }
        )
    plain = config_to_toml(config_from_mapping({}))
    assert "# [tls] not set" in plain


# ------------------------------------------------------------ the broker listener


async def test_a_client_without_the_ca_gets_a_certificate_error_at_once(pki: Pki, tmp_path: Path):
    async with tls_broker(tmp_path / "b", ServerTls(pki.server())) as addr:
        # The system's trust store does not know trustme's CA.
        started = trio.current_time()
        with pytest.raises(TlsError, match=r"certificate verify failed.*--tls-ca"):
            async with open_producer(addr, tls=ClientTls(), timeout_s=10):
                pass
        assert trio.current_time() - started < 2  # refused, not retried until the time-out

        def blocking() -> None:
            with pytest.raises(TlsError, match="certificate verify failed"):
                Producer(addr, tls=ClientTls(), timeout_s=10).connect()

        await trio.to_thread.run_sync(blocking)


async def test_a_plain_client_of_a_tls_listener_fails_and_the_listener_goes_on(
    pki: Pki, tmp_path: Path
):
    tls = ServerTls(pki.server())
    async with tls_broker(tmp_path / "b", tls) as addr:
        with pytest.raises(DelaydTimeout):
            async with open_producer(addr, timeout_s=1):
                pass
        assert tls.handshake_failures >= 1
        async with open_producer(addr, tls=pki.client(), timeout_s=5) as producer:
            receipt = await producer.send("orders", b"after")
            assert receipt.code is ResultCode.OK


async def test_a_tls_client_of_a_plain_listener_is_told_to_check_the_server(
    pki: Pki, tmp_path: Path
):
    async with tls_broker(tmp_path / "b", None) as addr:
        with pytest.raises(TlsError, match="is the server listening with TLS"):
            async with open_producer(addr, tls=pki.client(), timeout_s=5):
                pass


async def test_with_the_ca_every_client_and_the_sender_work(pki: Pki, tmp_path: Path):
    async with tls_broker(tmp_path / "b", ServerTls(pki.server())) as addr:
        async with open_producer(addr, tls=pki.client(), timeout_s=5) as producer:
            assert (await producer.send("orders", b"async", message_id="a-1")).code is ResultCode.OK

        target = RemoteTarget("far", [addr], tls=pki.client())
        results = await target.send_batch(due("sent", 3))
        assert [r.code for r in results] == [ResultCode.OK] * 3
        await target.aclose()

        def blocking() -> list[str]:
            with Producer(addr, tls=pki.client(), timeout_s=5) as producer:
                assert producer.send("orders", b"blocking", message_id="b-1").code is ResultCode.OK
            with Consumer(
                addr, subject="orders", group="g", tls=pki.client(), timeout_s=5
            ) as consumer:
                return sorted(m.message_id for m in iter(partial(consumer.receive, 1), None))

        got = await trio.to_thread.run_sync(blocking)
        assert got == ["a-1", "b-1", "sent-0", "sent-1", "sent-2"]


async def not_leader_member(
    tls: ServerTls, leader: str, handshakes: list[str], *, task_status=trio.TASK_STATUS_IGNORED
) -> None:
    """A member that does not lead, over ``tls``: HELLO_OK, then ERROR NOT_LEADER naming
    ``leader`` for every request. Counts its TLS handshakes in ``handshakes``."""

    async def handle(stream: trio.SocketStream) -> None:
        secure = await tls.accept(stream, 5)
        if secure is None:
            return
        handshakes.append("done")
        conn = Connection(SERVER)
        reason = not_leader_reason("g", "follower", 1, leader)
        async with secure:
            while data := await secure.receive_some(65536):
                conn.receive_data(data)
                while (event := conn.next_event()) is not NEED_DATA:
                    if isinstance(event, ConnectionClosed):
                        return
                    if isinstance(event, Hello):
                        answer = HelloOk(PROTOCOL_VERSION, "follower", request_id=event.request_id)
                    else:
                        answer = Error(ErrorCode.NOT_LEADER, reason, request_id=event.request_id)
                    await secure.send_all(conn.send(answer))

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    task_status.started(f"127.0.0.1:{listeners[0].socket.getsockname()[1]}")
    await trio.serve_listeners(handle, listeners)


async def test_a_not_leader_redirect_keeps_the_tls_settings(pki: Pki, tmp_path: Path):
    """Given a group's members, the clients follow NOT_LEADER from a follower to the
    leader with the same TLS settings: the leader requires the client's certificate."""
    mutual = ServerTls(pki.server(mutual=True))
    handshakes: list[str] = []
    async with tls_broker(tmp_path / "b", mutual) as leader, trio.open_nursery() as nursery:
        follower = await nursery.start(not_leader_member, mutual, leader, handshakes)
        members = f"{follower},{leader}"
        client = pki.client(with_cert=True)
        async with open_producer(members, tls=client, timeout_s=5) as producer:
            receipt = await producer.send("orders", b"async", message_id="r-1")
            assert receipt.code is ResultCode.OK
            assert producer._session.connects == 2  # the follower, then the leader

        def blocking() -> ResultCode:
            with Producer(members, tls=client, timeout_s=5) as producer:
                return producer.send("orders", b"blocking", message_id="r-2").code

        assert await trio.to_thread.run_sync(blocking) is ResultCode.OK
        assert handshakes == ["done", "done"]  # each client asked the follower first
        nursery.cancel_scope.cancel()


async def test_the_sender_reports_a_broker_certificate_it_does_not_trust(pki: Pki, tmp_path: Path):
    stranger = make_pki(tmp_path / "stranger")
    async with tls_broker(tmp_path / "b", ServerTls(pki.server())) as addr:
        target = RemoteTarget("far", [addr], tls=stranger.client())
        with pytest.raises(TargetUnavailable, match=r"broker group far: .*certificate verify"):
            await target.send_batch(due("x", 1))
        await target.aclose()


async def test_mutual_tls_refuses_a_client_without_a_certificate(pki: Pki, tmp_path: Path):
    async with tls_broker(tmp_path / "b", ServerTls(pki.server(mutual=True))) as addr:
        started = trio.current_time()
        with pytest.raises(TlsError, match=r"certificate required.*--tls-cert"):
            async with open_producer(addr, tls=pki.client(), timeout_s=10):
                pass
        assert trio.current_time() - started < 2
        stranger = make_pki(tmp_path / "stranger")
        foreign = ClientTls(pki.ca_file, stranger.client_cert, stranger.client_key)
        with pytest.raises(TlsError, match="unknown ca"):
            async with open_producer(addr, tls=foreign, timeout_s=10):
                pass

        async with open_producer(addr, tls=pki.client(with_cert=True), timeout_s=5) as producer:
            assert (await producer.send("orders", b"m")).code is ResultCode.OK

        target = RemoteTarget("far", [addr], tls=pki.client())
        with pytest.raises(TargetUnavailable, match=r"certificate required.*tls_cert_file"):
            await target.send_batch(due("x", 1))
        await target.aclose()

        def blocking() -> str:
            started = time.monotonic()
            with pytest.raises(TlsError, match="certificate required"):
                Producer(addr, tls=pki.client(), timeout_s=10).connect()
            assert time.monotonic() - started < 2
            with Producer(addr, tls=pki.client(with_cert=True), timeout_s=5) as producer:
                return producer.send("orders", b"blocking").code.name

        assert await trio.to_thread.run_sync(blocking) == "OK"


async def test_a_stalled_handshake_does_not_hold_up_accepts_and_is_closed(pki: Pki, tmp_path: Path):
    tls = ServerTls(pki.server())
    async with tls_broker(tmp_path / "b", tls) as addr:
        host, port = addr.split(":")
        stalled = socket.create_connection((host, int(port)))  # never says ClientHello
        try:
            async with open_producer(addr, tls=pki.client(), timeout_s=5) as producer:
                assert (await producer.send("orders", b"m")).code is ResultCode.OK

            def closed_by_server() -> float:
                started = time.monotonic()
                stalled.settimeout(10)
                assert stalled.recv(1) == b""  # the server closed it: the HELLO deadline
                return time.monotonic() - started

            waited = await trio.to_thread.run_sync(closed_by_server)
            assert waited < HELLO_TIMEOUT_MS / 1000 + 2
            assert tls.handshake_failures == 1
        finally:
            stalled.close()


# ------------------------------------------------------------ /metrics


async def test_metrics_over_tls(pki: Pki):
    registry = CollectorRegistry()
    Counter("delayd_test_things", "Things.", registry=registry).inc(2)
    tls = ServerTls(pki.server())
    async with trio.open_nursery() as nursery:
        serve = partial(serve_metrics, registry, "127.0.0.1", 0, tls=tls)
        (host, port), *_ = await nursery.start(serve)
        url = f"https://{host}:{port}/metrics"
        context = ssl.create_default_context(cafile=pki.ca_file)
        answer = await trio.to_thread.run_sync(partial(httpx.get, url, verify=context))
        assert answer.status_code == 200 and "delayd_test_things_total 2.0" in answer.text
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await trio.to_thread.run_sync(partial(httpx.get, url))
        nursery.cancel_scope.cancel()
