"""``delayd send``: its argument parsers, and the command against a real server."""

from __future__ import annotations

import argparse
import json
import subprocess

import pytest

from delayd.client.send_command import format_utc, parse_duration_ms, parse_property, parse_utc_ms
from tests.intake_support import ServeProcess, check_exactly_once, terminate
from tests.process_support import DELAYD, ROOT, child_env


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("250ms", 250),
        ("90s", 90_000),
        ("15m", 900_000),
        ("2h", 7_200_000),
        ("7d", 604_800_000),
        ("1.5h", 5_400_000),
        ("0s", 0),
        ("0.5ms", None),
        ("90", None),
        ("3y", None),
        ("-5s", None),
        ("s", None),
        ("1e3s", None),
    ],
)
def test_durations(text, ms):
    if ms is None:
        with pytest.raises(argparse.ArgumentTypeError):
            parse_duration_ms(text)
    else:
        assert parse_duration_ms(text) == ms


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("2026-11-22T10:00:00Z", 1_795_341_600_000),
        ("2026-11-22T10:00:00.250Z", 1_795_341_600_250),
        ("2026-11-22T11:00:00+01:00", 1_795_341_600_000),
        ("2026-11-22T10:00:00", None),  # no zone
        ("22/11/2026", None),
        ("tomorrow", None),
    ],
)
def test_utc_times(text, ms):
    if ms is None:
        with pytest.raises(argparse.ArgumentTypeError):
            parse_utc_ms(text)
    else:
        assert parse_utc_ms(text) == ms
        assert parse_utc_ms(format_utc(ms)) == ms


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
