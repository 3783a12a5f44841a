"""The producers take due times as Python values — ``at=datetime`` with a tzinfo,
``delay=timedelta`` — beside ``at_ms``/``delay_ms``; a bad value is refused before any
I/O with a TypeError or ValueError naming the argument; the examples of docs/clients.md
run as written against a delay server; ``dir(delayd)`` lists the public names."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import UTC, date, datetime, timedelta, timezone

import pytest
import trio

import delayd
from delayd.client._due import reschedule_due_ms, send_times
from delayd.client._messages import build_message, coerce_batch
from tests.intake_support import ServeProcess
from tests.process_support import ROOT, child_env

CET = timezone(timedelta(hours=1))
NOW_MS = 1_795_341_600_000  # 2026-11-22T10:00:00Z


def test_python_values_become_milliseconds():
    at = datetime(2026, 11, 22, 11, 0, tzinfo=CET)  # 10:00 UTC
    assert send_times(at=at) == (NOW_MS, None)
    assert send_times(delay=timedelta(minutes=15)) == (None, 900_000)
    assert send_times(at_ms=5) == (5, None) and send_times(delay_ms=0) == (None, 0)
    assert send_times() == (None, None)
    # A fraction of a millisecond is rounded up: never due before the time given.
    assert send_times(delay=timedelta(microseconds=1)) == (None, 1)
    assert send_times(at=at + timedelta(microseconds=999)) == (NOW_MS + 1, None)
    assert send_times(at=at + timedelta(microseconds=1000)) == (NOW_MS + 1, None)
    assert reschedule_due_ms(NOW_MS, delay=timedelta(seconds=2)) == NOW_MS + 2000
    assert reschedule_due_ms(NOW_MS, at=datetime(2030, 1, 1, tzinfo=UTC)) == 1_893_456_000_000
    assert reschedule_due_ms(NOW_MS, delay_ms=7) == NOW_MS + 7


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"delay": 90}, TypeError, r"^delay must be a timedelta, got int \(for .* delay_ms=\)"),
        ({"delay": 1.5}, TypeError, r"^delay must be a timedelta, got float$"),
        ({"delay_ms": timedelta(seconds=1)}, TypeError, r"^delay_ms must be an int .*use delay="),
        ({"delay_ms": 2.0}, TypeError, r"^delay_ms must be an int \(milliseconds\), got float$"),
        ({"delay_ms": True}, TypeError, r"^delay_ms must be an int"),
        ({"at_ms": datetime.now(UTC)}, TypeError, r"^at_ms must be an int .*use at="),
        ({"at": NOW_MS}, TypeError, r"^at must be a datetime with a tzinfo, got int .*at_ms="),
        ({"at": date(2027, 1, 1)}, TypeError, r"^at must be a datetime .*got date$"),
        ({"at": "2027-01-01T00:00:00Z"}, TypeError, r"^at must be a datetime .*got str$"),
        ({"at": datetime(2027, 1, 1)}, ValueError, r"^at is a naive datetime \(2027-01-01T00"),
        ({"delay": timedelta(seconds=-1)}, ValueError, r"^delay is .*a negative delay"),
        ({"delay_ms": -5}, ValueError, r"^delay_ms is -5: a negative delay"),
        ({"at_ms": -1}, ValueError, r"^at_ms is -1: a time before 1970"),
        ({"at": datetime(1969, 12, 31, tzinfo=UTC)}, ValueError, r"^at is .*before 1970"),
        ({"at_ms": 1 << 63}, ValueError, r"^at_ms is .*beyond what a message can carry"),
        (
            {"at": datetime.now(UTC), "delay": timedelta(1)},
            ValueError,
            r"^give at most one of at, delay, at_ms and delay_ms, not both at and delay$",
        ),
        ({"at_ms": 1, "delay_ms": 1}, ValueError, r"not both at_ms and delay_ms$"),
    ],
)
def test_bad_times_are_refused_naming_the_argument(arguments, error, message):
    with pytest.raises(error, match=message):
        send_times(**arguments)
    with pytest.raises(error, match=message.replace("at most", "exactly")):
        reschedule_due_ms(NOW_MS, **arguments)
    with pytest.raises(error, match=message):
        build_message("orders", b"x", **arguments)


def test_reschedule_needs_a_time():
    with pytest.raises(ValueError, match=r"^give exactly one of at, delay, at_ms and delay_ms$"):
        reschedule_due_ms(NOW_MS)


def test_send_batch_items_take_python_values_too():
    at = datetime(2026, 11, 22, 10, 0, tzinfo=UTC)
    first, second = coerce_batch(
        [
            {"subject": "s", "body": b"1", "delay": timedelta(seconds=3)},
            {"subject": "s", "body": b"2", "at": at},
        ]
    )
    assert (first.delay_ms, first.at_ms, second.at_ms, second.delay_ms) == (
        3000,
        None,
        NOW_MS,
        None,
    )
    with pytest.raises(ValueError, match=r"^send_batch item 0: delay must be a timedelta"):
        coerce_batch([{"subject": "s", "body": b"1", "delay": 3}])


def test_dir_shows_the_public_names_and_import_stays_light():
    public = [name for name in dir(delayd) if not name.startswith("_")]
    assert public == sorted(name for name in delayd.__all__ if not name.startswith("_"))
    for name in ("Producer", "AsyncProducer", "open_producer", "Consumer", "open_consumer"):
        assert name in public
    for name in ("Receipt", "CancelReceipt", "RescheduleReceipt", "Message", "ResultCode"):
        assert name in public
    for name in ("DelaydError", "RejectedError", "BusyError", "DelaydTimeout"):
        assert issubclass(getattr(delayd, name), Exception)
    assert "__version__" in dir(delayd) and "__version__" in delayd.__all__
    assert "TYPE_CHECKING" not in dir(delayd) and "Any" not in dir(delayd)
    for name in delayd.__all__:
        assert getattr(delayd, name) is not None
    # The clients (and anyio) load on first use only.
    fresh = subprocess.run(
        [sys.executable, "-c", "import sys, delayd; print('anyio' in sys.modules)"],
        capture_output=True,
        text=True,
        env=child_env(),
        check=True,
    )
    assert fresh.stdout.strip() == "False"


def producers_refuse_bad_times(address: str) -> None:
    """Both producers, connected: the errors of the helper, not a protocol error from
    the encoder (a timedelta as delay_ms used to end in LocalProtocolError)."""
    with delayd.Producer(address) as producer:
        receipt = producer.send("orders", b"x", delay=timedelta(hours=1))
        with pytest.raises(TypeError, match=r"^delay_ms must be an int"):
            producer.send("orders", b"x", delay_ms=timedelta(seconds=5))  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"^at is a naive datetime"):
            producer.reschedule(receipt.message_id, at=datetime(2027, 1, 1))
        moved = producer.reschedule(receipt.message_id, delay=timedelta(hours=2))
        assert moved.outcome.name == "RESCHEDULED"

    async def use_async() -> None:
        async with delayd.open_producer(address) as producer:
            with pytest.raises(TypeError, match=r"^delay must be a timedelta, got float"):
                await producer.send("orders", b"x", delay=1.5)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match=r"^give exactly one of"):
                await producer.reschedule(receipt.message_id)
            sent = await producer.send("orders", b"y", at=datetime.now(UTC) + timedelta(1))
            assert sent.ok

    trio.run(use_async)


def docs_examples() -> list[str]:
    """The python blocks after the marker in docs/clients.md that says this test runs them."""
    text = (ROOT / "docs" / "clients.md").read_text()
    marker = text.index("<!-- tests/test_client_times.py runs the two examples below")
    blocks = re.findall(r"```python\n(.*?)```", text[marker:], re.S)[:2]
    assert len(blocks) == 2
    return blocks


@pytest.mark.slow
def test_the_docs_examples_run_against_a_delay_server(tmp_path, procs):
    server = procs.start(ServeProcess(tmp_path / "data"))
    address = "{}:{}".format(*server.address)
    outputs = []
    for block in docs_examples():
        assert '"127.0.0.1:20801"' in block
        done = subprocess.run(
            [sys.executable, "-c", block.replace("127.0.0.1:20801", address)],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout.splitlines())
    producers_refuse_bad_times(address)
    # The first prints the two refusals its comments show.
    assert outputs[0] == [
        "delay must be a timedelta, got int (for milliseconds use delay_ms=)",
        "at is a naive datetime (2027-01-01T09:00:00): give it a tzinfo, e.g. "
        "datetime(..., tzinfo=timezone.utc), or use at_ms=",
    ]
