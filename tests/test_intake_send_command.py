"""``delayd send``: its argument parsers, and the command against a real server."""

from __future__ import annotations

import argparse
import json
import subprocess

import pytest

from delayd.cli.send import parse_property
from tests.intake_support import ServeProcess, check_exactly_once, terminate
from tests.process_support import DELAYD, ROOT, child_env


def test_properties():
    assert parse_property("a=b=c") == ("a", "b=c")
    assert parse_property("a=") == ("a", "")
    for bad in ("=b", "ab"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_property(bad)


def send(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DELAYD, "send", *args],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.slow
def test_send_prints_the_receipt_and_errors_name_the_flag(tmp_path, procs):
    server = procs.start(ServeProcess(tmp_path / "data"))
    addr = "{}:{}".format(*server.address)
    done = send(
        "--server", addr, "--subject", "orders", "--at", "2026-11-22T10:00:00Z",
        "--id", "order-17", "--key", "k17", "--prop", "a=1", "--prop", "b=2", "hello",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    receipt = json.loads(done.stdout)
    assert receipt["message_id"] == "order-17" and receipt["code"] == "OK"
    assert receipt["due_ms"] >= 1_795_341_600_000  # at_ms, or now if that is later
    assert receipt["due"].endswith("Z") and receipt["sequence"] == 1
    done = send("--server", addr, "--subject", "orders", "--delay", "90s", "second")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["sequence"] == 2
    for args, flag in [
        (("--delay", "90"), "--delay"),
        (("--at", "2026-11-22T10:00:00"), "--at"),
        (("--delay", "1s", "--prop", "novalue"), "--prop"),
    ]:
        done = send("--server", addr, "--subject", "orders", *args, "x")
        assert done.returncode == 2 and f"argument {flag}" in done.stderr, done.stderr
    done = send("--server", "nohost", "--subject", "orders", "--delay", "1s", "x")
    assert done.returncode == 2 and "argument --server" in done.stderr
    done = send("--server", addr, "--subject", "orders", "--delay", "800d", "x")
    assert done.returncode == 1 and "DELAY_TOO_LONG" in done.stderr
    terminate(server)
    scheduled = check_exactly_once(tmp_path / "data", 1)
    message = scheduled["order-17"].message
    assert (message.key, message.properties, message.body) == (
        "k17",
        {"a": "1", "b": "2"},
        b"hello",
    )
