"""A full disk is an answer, not a crash: ``delayd serve`` on a real 8 MiB tmpfs.

Intake fills the disk and gets DISK_FULL answers naming the directory and its free
bytes; the process stays up, /metrics and /readyz answer (not ready: disk full);
deleting a filler file lets intake resume without a restart, and every message that was
answered OK is in message_log and schedule_log exactly once. Needs root for the mount
(CI runs as root): a failed mount fails the test, it is never skipped.
"""

from __future__ import annotations

import errno
import os
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from delayd.logs.dispatch_log import EntryKind
from delayd.protocol import Cancel, Error, ErrorCode, Message, ResultCode
from tests.broker_support import BrokerProcess
from tests.delivery_support import (
    SUBJECT,
    broker_stats,
    check_dispatch_log,
    serve_stats,
    stored_count,
)
from tests.intake_support import (
    RawClient,
    ServeProcess,
    check_exactly_once,
    terminate,
    write_config,
)

BODY = b"x" * 2048
BATCH = 40
HOUR_MS = 3_600_000


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, f"cannot mount a tmpfs (the test needs root): {done.stderr}"
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def http_get(address: tuple[str, int], path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address[0]}:{address[1]}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_for(predicate, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def batch(prefix: str, n: int) -> list[Message]:
    return [Message(f"{prefix}-{i}", "orders", body=BODY, delay_ms=HOUR_MS) for i in range(n)]


def metric(text: str, line_start: str) -> float:
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {line_start} in the metrics")


def test_a_full_disk_refuses_intake_keeps_serving_and_resumes_when_space_returns(
    small_disk, tmp_path, procs
):
    data = small_disk / "data"
    log_path = tmp_path / "serve.log"  # off the small disk
    # No reserve: intake writes until the tmpfs says ENOSPC.
    config = write_config(tmp_path / "serve.toml", "[intake]\nmin_free_bytes = 1\n")
    server = procs.start(ServeProcess(data, "--config", config, log_path=log_path))
    assert server.metrics_address is not None
    metrics = server.metrics_address
    wait_for(lambda: http_get(metrics, "/readyz")[0] == 200)
    # Leave the server about 1.5 MiB: a filler file takes the rest.
    filler = small_disk / "filler"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler.write_bytes(b"\0" * (free - 1536 * 1024))

    client = RawClient(server.address)
    stored: set[str] = set()
    refusals = []
    for round_ in range(200):
        results = client.send_batch(batch(f"fill{round_}", BATCH))
        for i, result in enumerate(results):
            if result.code is ResultCode.OK:
                stored.add(f"fill{round_}-{i}")
            else:
                assert result.code is ResultCode.DISK_FULL, (result.code, result.reason)
                refusals.append(result)
        if refusals:
            break
    assert refusals, "the disk never filled"
    assert stored, "nothing fitted before the disk filled"
    reason = refusals[0].reason
    assert "disk full" in reason and str(data / "delay" / "message_log") in reason
    assert "bytes free" in reason
    assert ResultCode.DISK_FULL.is_retryable

    # Still serving: the same connection answers, /metrics and /readyz answer.
    again = client.send_batch(batch("again", BATCH))
    assert {r.code for r in again} == {ResultCode.DISK_FULL}
    assert server.proc is not None and server.proc.poll() is None
    status, body = http_get(metrics, "/readyz")
    assert status == 503 and body.startswith("not ready: disk full: "), body
    status, text = http_get(metrics, "/metrics")
    assert status == 200
    assert metric(text, 'delayd_store_refusing_writes{log="message_log"') == 1
    # The free space is asked every second.
    wait_for(lambda: metric(http_get(metrics, "/metrics")[1], "delayd_store_free_bytes") < 1 << 20)
    status, text = http_get(metrics, "/metrics")
    assert metric(text, 'delayd_intake_refused_messages_total{reason="disk_full"}') >= 2 * BATCH

    # Not a byte left (a second filler takes what the refusals left): a cancel is
    # refused too, ERROR DISK_FULL on the same connection.
    topup = small_disk / "topup"
    fill_up(topup)
    answer = client.request(lambda rid: Cancel("fill0-0", request_id=rid))
    assert isinstance(answer, Error) and answer.code is ErrorCode.DISK_FULL, answer
    assert answer.code.is_retryable and "disk full" in answer.reason
    assert server.proc.poll() is None

    topup.unlink()
    filler.unlink()  # space returns: no restart
    wait_for(lambda: http_get(metrics, "/readyz")[0] == 200)
    for round_ in range(3):
        results = client.send_batch(batch(f"after{round_}", BATCH))
        assert {r.code for r in results} == {ResultCode.OK}
        stored.update(f"after{round_}-{i}" for i in range(BATCH))
    status, text = http_get(metrics, "/metrics")
    assert metric(text, 'delayd_store_refusing_writes{log="message_log"') == 0
    client.close()
    terminate(server)
    # Nothing acknowledged was lost, nothing refused was stored, nothing is torn.
    scheduled = check_exactly_once(data, 1)
    assert set(scheduled) == stored
    assert "message_log refuses writes: disk full" in log_path.read_text()


def test_intake_stops_at_its_reserve_and_delivery_goes_on(small_disk, tmp_path, procs):
    """With a reserve, intake is refused before the disk is full, and what it accepted
    is still replayed and delivered into the embedded broker on the same disk."""
    data = small_disk / "data"
    reserve = 5 << 20  # of the 8 MiB
    config = write_config(tmp_path / "serve.toml", f"[intake]\nmin_free_bytes = {reserve}\n")
    server = procs.start(ServeProcess(data, "--config", config, log_path=tmp_path / "serve.log"))
    assert server.broker_address is not None and server.metrics_address is not None
    client = RawClient(server.address)
    stored = 0
    refused = None
    for round_ in range(200):
        now = [Message(f"n{round_}-{i}", SUBJECT, body=BODY) for i in range(BATCH)]
        results = client.send_batch(now)  # due at once
        stored += sum(r.code is ResultCode.OK for r in results)
        refused = next((r for r in results if r.code is ResultCode.DISK_FULL), None)
        if refused is not None:
            break
    assert refused is not None and stored > 0
    assert f"less than the reserve of {reserve}" in refused.reason
    # Everything accepted reaches the broker although intake refuses.
    wait_for(lambda: stored_count(broker_stats(server.broker_address)) == stored)
    status, body = http_get(server.metrics_address, "/readyz")
    assert status == 503 and "disk full: message_log" in body
    client.close()
    terminate(server)


def test_a_full_disk_refuses_the_brokers_producers_and_it_resumes(small_disk, tmp_path, procs):
    """``delayd broker`` on the tmpfs: its commitlog refuses SEND_BATCH with DISK_FULL
    per message, consumers and /metrics stay up, and it resumes once space returns."""
    broker = procs.start(BrokerProcess(small_disk / "data", log_path=tmp_path / "broker.log"))
    assert broker.metrics_address is not None
    metrics = broker.metrics_address
    filler = small_disk / "filler"
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    filler.write_bytes(b"\0" * (free - 1024 * 1024))
    with broker.client() as client:
        stored: list[str] = []
        refused = None
        for round_ in range(200):
            ids = [f"b{round_}-{i}" for i in range(BATCH)]
            results = client.send_batch([Message(i, "orders", body=BODY) for i in ids])
            stored += [i for i, r in zip(ids, results, strict=True) if r.code.is_success]
            refused = next((r for r in results if not r.code.is_success), None)
            if refused is not None:
                break
        assert refused is not None and refused.code is ResultCode.DISK_FULL
        assert "disk full" in refused.reason and "commitlog" in refused.reason
        status, body = http_get(metrics, "/readyz")
        assert status == 503 and "disk full: broker_commitlog" in body
        assert (
            metric(
                http_get(metrics, "/metrics")[1],
                'delayd_store_refusing_writes{log="broker_commitlog"',
            )
            == 1
        )
        # Consumers are served what is stored.
        client.join("g", "orders", "c")
        got: list[Message] = []
        while pulled := client.pull("orders", "g", "c", 1000):
            got += pulled
        assert sorted(m.message_id for m in got) == sorted(stored)

        filler.unlink()
        wait_for(lambda: http_get(metrics, "/readyz")[0] == 200)
        again = client.send_batch([Message("after", "orders", body=BODY)])
        assert again[0].code is ResultCode.OK
    assert broker.stop() == 0
    assert "broker_commitlog refuses writes: disk full" in (tmp_path / "broker.log").read_text()


def fill_up(path: Path) -> None:
    """Write ``path`` until the file system has not a byte left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_messages_falling_due_on_a_full_disk_are_delivered_once_space_returns(
    small_disk, tmp_path, procs
):
    """Delivery into the embedded broker finds its commitlog's disk full: the sender
    retries (never dead-letters), and once space returns every acknowledged message is
    delivered, each recorded once in dispatch_log."""
    data = small_disk / "data"
    config = write_config(tmp_path / "serve.toml", "[intake]\nmin_free_bytes = 1\n")
    server = procs.start(ServeProcess(data, "--config", config, log_path=tmp_path / "serve.log"))
    assert server.broker_address is not None and server.metrics_address is not None
    metrics = server.metrics_address
    client = RawClient(server.address)
    soon = [Message(f"d{i}", SUBJECT, body=BODY, delay_ms=1500) for i in range(100)]
    assert {r.code for r in client.send_batch(soon)} == {ResultCode.OK}
    client.close()
    wait_for(lambda: serve_stats(server.address)["replay.lag_records"] == 0)
    filler = small_disk / "filler"
    fill_up(filler)  # before they fall due
    wait_for(
        lambda: (
            metric(
                http_get(metrics, "/metrics")[1],
                'delayd_store_refusing_writes{log="broker_commitlog"',
            )
            == 1
        )
    )
    assert "disk full" in http_get(metrics, "/readyz")[1]
    assert stored_count(broker_stats(server.broker_address)) == 0
    filler.unlink()
    wait_for(lambda: stored_count(broker_stats(server.broker_address)) == 100)
    terminate(server)
    delivered = check_dispatch_log(data)
    assert set(delivered) == {f"d{i}" for i in range(100)}
    assert {entry.kind for _, entry in delivered.values()} == {EntryKind.DISPATCHED}


def test_replay_into_a_full_disk_pauses_and_catches_up_when_space_returns(
    small_disk, tmp_path, procs
):
    """A batch message_log has room for and schedule_log has not: the replayer pauses
    (the server stays up, /readyz names schedule_log) and copies it once when space
    returns."""
    data = small_disk / "data"
    config = write_config(tmp_path / "serve.toml", "[intake]\nmin_free_bytes = 1\n")
    server = procs.start(ServeProcess(data, "--config", config, log_path=tmp_path / "serve.log"))
    assert server.metrics_address is not None
    metrics = server.metrics_address
    client = RawClient(server.address)
    assert {r.code for r in client.send_batch(batch("warm", BATCH))} == {ResultCode.OK}
    wait_for(lambda: serve_stats(server.address)["replay.lag_records"] == 0)
    size = BATCH * (len(BODY) + 100)  # what the batch takes in either log
    filler = small_disk / "filler"
    fill_up(filler)
    os.truncate(filler, os.path.getsize(filler) - size - 16 * 1024)  # room for one copy
    results = client.send_batch(batch("late", BATCH))
    assert {r.code for r in results} == {ResultCode.OK}  # in message_log, acknowledged
    wait_for(
        lambda: (
            metric(
                http_get(metrics, "/metrics")[1],
                'delayd_store_refusing_writes{log="schedule_log"',
            )
            == 1
        )
    )
    assert serve_stats(server.address)["replay.lag_records"] == BATCH
    assert "disk full: schedule_log" in http_get(metrics, "/readyz")[1]
    filler.unlink()
    wait_for(lambda: serve_stats(server.address)["replay.lag_records"] == 0)
    wait_for(lambda: http_get(metrics, "/readyz")[0] == 200)
    client.close()
    terminate(server)
    scheduled = check_exactly_once(data, 1)  # each record copied once, none torn
    assert len(scheduled) == 2 * BATCH
