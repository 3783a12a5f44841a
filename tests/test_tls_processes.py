"""TLS on real processes: ``delayd serve`` with every listener over TLS (intake, broker,
metrics, the HTTP API), reloaded on SIGHUP; the sender delivering to a ``delayd
broker`` that listens with TLS; and the openssl commands of docs/operations.md making
a mutual-TLS setup that curl and the clients use."""

from __future__ import annotations

import re
import shutil
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import trio

from delayd.client import ClientTls, Consumer, Producer
from delayd.cluster.group_state import lookup_group
from delayd.errors import DelaydError
from delayd.group_address import GroupAddress
from delayd.protocol import ResultCode
from tests.broker_support import BrokerProcess
from tests.delivery_support import poll
from tests.intake_support import DELAYD, ServeProcess
from tests.tls_support import Pki, make_pki

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
OPERATIONS = ROOT / "docs" / "operations.md"
needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


def tls_flags(cert: str, key: str, client_ca: str | None = None) -> list[str]:
    flags = ["--tls-cert", cert, "--tls-key", key]
    return flags + (["--tls-client-ca", client_ca] if client_ca else [])


def addr(address: tuple[str, int] | None) -> str:
    assert address is not None
    return "{}:{}".format(*address)


def wait_for_log(server: ServeProcess | BrokerProcess, text: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in server.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{server.log_tail()}"
        time.sleep(0.05)


def https_get(address: tuple[str, int] | None, path: str, ca_file: str) -> httpx.Response:
    context = ssl.create_default_context(cafile=ca_file)
    return httpx.get(f"https://{addr(address)}{path}", verify=context, timeout=10)


def sends(address: tuple[str, int] | None, tls: ClientTls, body: bytes = b"m") -> ResultCode:
    with Producer(addr(address), tls=tls, timeout_s=5) as producer:
        return producer.send("orders", body).code


def copy_pair(source: Pki, cert: Path, key: Path) -> None:
    """Rotate: the server's certificate and key of ``source`` over the files served."""
    cert.write_bytes(Path(source.server_cert).read_bytes())
    key.write_bytes(Path(source.server_key).read_bytes())


def test_every_listener_of_serve_speaks_tls_and_sighup_rotates_the_certificate(tmp_path):
    old, new = make_pki(tmp_path / "old"), make_pki(tmp_path / "new")
    cert, key = tmp_path / "served.pem", tmp_path / "served.key"
    copy_pair(old, cert, key)
    server = ServeProcess(
        tmp_path / "data",
        *tls_flags(str(cert), str(key)),
        http_listen="127.0.0.1:0",
    )
    server.start()
    try:
        assert "metrics on https://" in server.stdout and "http on https://" in server.stdout
        # Intake and the embedded broker: a message in, delivered, consumed over TLS.
        with Producer(addr(server.address), tls=old.client(), timeout_s=5) as producer:
            assert producer.send("orders", b"hello", message_id="m-1").code is ResultCode.OK
        with Consumer(
            addr(server.broker_address), subject="orders", group="g", tls=old.client()
        ) as consumer:
            message = consumer.receive(timeout_s=10)
            assert message is not None and message.message_id == "m-1"
        # /metrics and the HTTP API: https with the CA, refused without it.
        assert https_get(server.metrics_address, "/healthz", old.ca_file).text == "ok\n"
        answer = https_get(server.http_address, "/openapi.json", old.ca_file)
        assert answer.status_code == 200 and answer.json()["openapi"]
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            https_get(server.http_address, "/openapi.json", new.ca_file)

        with Producer(addr(server.address), tls=old.client(), timeout_s=5) as kept:
            # SIGHUP after the files changed: new connections get the new certificate,
            # on every listener; the one open keeps its session.
            copy_pair(new, cert, key)
            server.proc.send_signal(1)
            wait_for_log(server, "TLS reloaded")
            assert kept.send("orders", b"still").code is ResultCode.OK
        assert sends(server.address, new.client()) is ResultCode.OK
        assert sends(server.broker_address, new.client()) is ResultCode.OK
        assert https_get(server.metrics_address, "/healthz", new.ca_file).status_code == 200
        assert https_get(server.http_address, "/openapi.json", new.ca_file).status_code == 200
        with pytest.raises(DelaydError, match="certificate verify failed"):
            sends(server.address, old.client())
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            https_get(server.http_address, "/openapi.json", old.ca_file)

        # A bad file on reload: logged, the certificate in use kept, still serving.
        key.write_text("not a key\n")
        server.proc.send_signal(1)
        wait_for_log(server, "TLS reload failed")
        assert "served.key" in server.log_tail()
        assert sends(server.address, new.client()) is ResultCode.OK
        assert https_get(server.http_address, "/openapi.json", new.ca_file).status_code == 200
        assert server.stop() == 0
    finally:
        server.close()


def test_serve_refuses_to_start_with_a_tls_file_it_cannot_use(tmp_path):
    pki = make_pki(tmp_path / "pki")
    server = ServeProcess(tmp_path / "data", *tls_flags(pki.server_cert, pki.client_key))
    code, log = server.run_to_exit()
    assert code == 2
    assert "bad configuration" in log and "client.key" in log and "key values mismatch" in log
    server = ServeProcess(tmp_path / "data", "--tls-cert", pki.server_cert)
    code, log = server.run_to_exit()
    assert code == 2 and "--tls-key" in log


def assert_delivered_over_tls(server: ServeProcess, broker: BrokerProcess, pki: Pki) -> None:
    """Three messages sent to ``server`` (plain TCP) are consumed from ``broker`` over
    TLS: the sender delivered them to it over TLS."""
    with Producer(addr(server.address), timeout_s=5) as producer:
        receipts = [producer.send("orders", b"%d" % i, delay_ms=0) for i in range(3)]
    with Consumer(
        addr(broker.address), subject="orders", group="g", tls=pki.client(), timeout_s=5
    ) as consumer:
        got = [consumer.receive(timeout_s=15) for _ in receipts]
    assert sorted(m.message_id for m in got if m is not None) == sorted(
        r.message_id for r in receipts
    )


def test_the_sender_delivers_to_a_broker_group_over_tls(tmp_path):
    pki, new = make_pki(tmp_path / "pki"), make_pki(tmp_path / "new")
    cert, key = tmp_path / "served.pem", tmp_path / "served.key"
    copy_pair(pki, cert, key)
    broker = BrokerProcess(tmp_path / "broker", *tls_flags(str(cert), str(key)))
    broker.start()
    server = None
    try:
        config = tmp_path / "serve.toml"
        config.write_text(
            "[[broker_groups]]\n"
            'name = "far"\n'
            f'addresses = ["{addr(broker.address)}"]\n'
            f'tls_ca_file = "{pki.ca_file}"\n'
        )
        server = ServeProcess(tmp_path / "data", "--config", str(config)).start()
        assert_delivered_over_tls(server, broker, pki)
        # delayd broker: /metrics over TLS, and SIGHUP rotates its certificate too.
        metrics = https_get(broker.metrics_address, "/metrics", pki.ca_file)
        assert metrics.status_code == 200 and "delayd_broker" in metrics.text
        copy_pair(new, cert, key)
        broker.proc.send_signal(1)
        wait_for_log(broker, "TLS reloaded")
        assert sends(broker.address, new.client()) is ResultCode.OK
    finally:
        if server is not None:
            server.close()
        broker.close()


def openssl_commands() -> str:
    """The first bash block of the "TLS" section of docs/operations.md."""
    text = OPERATIONS.read_text()
    section = text[text.index("\n## TLS") :]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


@needs_curl
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_the_documented_openssl_commands_make_a_working_mutual_tls_setup(tmp_path):
    pki = tmp_path / "pki"
    pki.mkdir()
    subprocess.run(["bash", "-euo", "pipefail", "-c", openssl_commands()], cwd=pki, check=True)
    files = {name: str(pki / name) for name in ("ca.pem", "server.pem", "server.key")}
    server = ServeProcess(
        tmp_path / "data",
        *tls_flags(files["server.pem"], files["server.key"], files["ca.pem"]),
        http_listen="127.0.0.1:0",
    )
    server.start()
    try:
        url = f"https://localhost:{server.http_address[1]}/openapi.json"
        curl = ["curl", "-s", "-o", "/dev/null", "--cacert", files["ca.pem"]]
        curl += ["-w", "%{http_code} HTTP/%{http_version}"]
        # No client certificate: the handshake is refused, there is no HTTP status.
        refused = subprocess.run([*curl, url], capture_output=True, text=True, check=False)
        assert refused.returncode != 0 and refused.stdout.startswith("000")
        client = ["--cert", str(pki / "client.pem"), "--key", str(pki / "client.key")]
        ok = subprocess.run([*curl, *client, url], capture_output=True, text=True, check=True)
        assert ok.stdout == "200 HTTP/2"  # ALPN offers h2 on the HTTP API
        metrics = f"https://localhost:{server.metrics_address[1]}/healthz"
        ok = subprocess.run([*curl, *client, metrics], capture_output=True, text=True, check=True)
        assert ok.stdout.startswith("200 HTTP/1")  # no ALPN on /metrics: HTTP/1.x
        mutual = ClientTls(str(pki / "ca.pem"), str(pki / "client.pem"), str(pki / "client.key"))
        assert sends(server.address, mutual) is ResultCode.OK
        # The CLI, from the environment (what the docs show as flags).
        env = {
            **server.env,
            "DELAYD_TLS_CA": files["ca.pem"],
            "DELAYD_TLS_CERT": str(pki / "client.pem"),
            "DELAYD_TLS_KEY": str(pki / "client.key"),
        }
        send = [*DELAYD, "send", "--server", f"localhost:{server.address[1]}"]
        send += ["--subject", "orders", "--delay", "10s", "hello"]
        sent = subprocess.run(send, capture_output=True, text=True, env=env, check=False)
        assert sent.returncode == 0 and '"message_id"' in sent.stdout, sent.stderr
        del env["DELAYD_TLS_CERT"], env["DELAYD_TLS_KEY"]
        refused = subprocess.run(send, capture_output=True, text=True, env=env, check=False)
        assert refused.returncode == 1 and "certificate required" in refused.stderr
    finally:
        server.close()


def test_the_sender_delivers_over_tls_to_broker_groups_found_in_etcd(
    tmp_path, etcd_server, monkeypatch
):
    """[delivery] broker_tls_ca_file: the broker groups of the cluster, found in etcd,
    are reached over TLS (this broker serves TLS only)."""
    pki = make_pki(tmp_path / "pki")
    monkeypatch.setenv("DELAYD_CLUSTER_ACK", "leader")  # lone members: no follower to wait
    monkeypatch.setenv("DELAYD_CLUSTER_REPLICATION_LISTEN", "127.0.0.1:0")
    cluster = f"tls-{tmp_path.name[-12:]}".replace("_", "-")
    joined = ("--etcd", etcd_server.url, "--cluster", cluster)
    broker = BrokerProcess(
        tmp_path / "broker", *joined, "--group", "b1", *tls_flags(pki.server_cert, pki.server_key)
    )
    broker.start()
    server = None
    try:
        config = tmp_path / "serve.toml"
        config.write_text(
            '[delivery]\nbroker_groups_from = "etcd"\nbroker_groups_refresh_ms = 200\n'
            f'broker_tls_ca_file = "{pki.ca_file}"\n'
        )
        server = ServeProcess(
            tmp_path / "data", "--config", str(config), *joined, "--group", "d1"
        ).start()

        def leads(group: str) -> bool:
            where = GroupAddress(etcd=(etcd_server.url,), group=group, cluster=cluster)
            return trio.run(lookup_group, where).leader is not None

        # Up is not elected (a loaded machine shows a member as candidate for a while):
        # the producer and the consumer below wait 5 s at most for a leader.
        poll(lambda: leads("b1") and leads("d1"), 20, "b1 and d1 elect their leaders")
        assert_delivered_over_tls(server, broker, pki)
    finally:
        if server is not None:
            server.close()
        broker.close()
