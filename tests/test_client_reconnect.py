"""Every client survives a server outage by itself, however it is driven (issue 18).

The server is killed with kill -9 and started again on the same port and data
directory, after an outage longer than the clients' time-outs and their back-off cap
(2 s). While it is down, calls with a short time-out fail within that time-out with
DelaydTimeout; after the restart the SAME client object works again: a producer's sends
are acknowledged, a consumer receives the messages produced after the restart and goes
on from its group's committed offsets. Calls with a long time-out started while the
server is down complete once it is back. A short call made just after the restart may
still fail while the back-off since the client's last failed attempt runs (at most
2 s), as a gRPC channel in TRANSIENT_FAILURE fails calls until its back-off timer fires.

Before the fix the back-off was slept from the start of each call, so once it grew past
the caller's time-out no call ever tried to connect again (the blocking consumer and the
producers with a short time-out stayed down for good).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

import delayd
from delayd.errors import DelaydTimeout
from tests.client_support import BrokerProcess
from tests.intake_support import ServeProcess
from tests.process_support import free_port

pytestmark = pytest.mark.slow

OUTAGE_S = 3.0  # longer than the back-off cap (2 s) and than the short time-outs
SHORT_S = 1.0
SLACK_S = 0.5  # a failing call may overrun its time-out by this much, no more
# A call made while the server is down waits for its restart: a whole `delayd serve`
# start (recovery, replay) on a machine busy with other tests can take well over 15 s.
PATIENT_S = 60.0
BACKOFF_CAP_S = 2.0  # Backoff.max_s
# After a restart: the back-off since the last failed attempt, then a connect and the
# call, which take seconds on a loaded machine. A client that never connects again
# (the bugs these tests catch) fails however long this is.
RECONNECT_S = BACKOFF_CAP_S + 10


def in_thread(work: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=work)
    thread.start()
    return thread


def send_all(addr: str, subject: str, bodies: list[bytes]) -> list[str]:
    """Send with a fresh producer; the acknowledged ids."""
    with delayd.Producer(addr, timeout_s=10) as producer:
        receipts = producer.send_batch([(subject, body) for body in bodies])
    assert all(r.ok for r in receipts)
    return [r.message_id for r in receipts]


def fails_in_time(call: Callable[[], object]) -> None:
    """``call`` raises DelaydTimeout (the server is down) within its time-out."""
    started = time.monotonic()
    with pytest.raises(DelaydTimeout, match=r"could not reach|took over"):
        call()
    assert time.monotonic() - started < SHORT_S + SLACK_S


def eventually(call: Callable[[], object]) -> object:
    """``call``'s result once the back-off since the client's last failed attempt has run
    (at most the 2 s cap) and it connected: calls made before then fail in time, with
    DelaydTimeout."""
    ends = time.monotonic() + RECONNECT_S
    while True:
        try:
            return call()
        except DelaydTimeout:
            if time.monotonic() > ends:
                raise


def poll_through_outage(call: Callable[[], object]) -> int:
    """Call ``call`` (expected to fail in time) until the outage is over; how many."""
    calls = 0
    ends = time.monotonic() + OUTAGE_S
    while time.monotonic() < ends:
        fails_in_time(call)
        calls += 1
    return calls


# --- consumers ------------------------------------------------------------------------------


def test_blocking_consumer_receives_again_after_an_outage(tmp_path: Path) -> None:
    """The report of issue 18: receive(timeout_s=1.0) polled through a 3 s outage, and
    after the restart the same Consumer, polled the same way, receives what is produced
    then; then a long receive started during a second outage completes after it."""
    with BrokerProcess(tmp_path) as broker:
        before = send_all(broker.addr, "rc", [b"b%d" % i for i in range(6)])
        after: list[str] = []

        def restart_and_produce(n: int, delay_s: float = 0.0) -> threading.Thread:
            def work() -> None:
                time.sleep(delay_s)
                broker.start()
                after.extend(send_all(broker.addr, "rc", [b"a%d" % i for i in range(n)]))

            return in_thread(work)

        with delayd.Consumer(broker.addr, subject="rc", group="g", timeout_s=2) as consumer:
            got = [consumer.receive(timeout_s=5) for _ in before]
            assert sorted(m.message_id for m in got if m) == sorted(before)
            broker.kill()
            assert poll_through_outage(lambda: consumer.receive(timeout_s=SHORT_S)) >= 2
            restart_and_produce(5).join()
            received: list[str] = []
            ends = time.monotonic() + RECONNECT_S
            while len(received) < 5 and time.monotonic() < ends:
                try:
                    message = consumer.receive(timeout_s=SHORT_S)
                except DelaydTimeout:
                    continue  # the back-off since the last failed attempt is running
                if message is not None:
                    received.append(message.message_id)
            assert sorted(received) == sorted(after), "the same consumer receives again"
            assert consumer.receive(timeout_s=0.5) is None, "nothing before the kill came again"

            broker.kill()
            restart = restart_and_produce(1, delay_s=1.0)
            first = consumer.receive(timeout_s=PATIENT_S)  # started while the broker is down
            restart.join()
            assert first is not None and first.message_id == after[-1]
        # What this consumer processed after the last restart was committed. Commits
        # made before a kill -9 were acknowledged from the broker's memory and may be
        # lost with it (at-least-once; commit="sync" is the durable mode).
        with delayd.Consumer(broker.addr, subject="rc", group="g") as again:
            while (message := again.receive(timeout_s=0.5)) is not None:
                assert message.message_id in before + after[:-1]


def test_blocking_consumer_with_a_commit_pending_reconnects_after_an_outage(tmp_path):
    """commit="sync": the message handed out before the kill is committed on the next
    receive, so every short receive during the outage first tries that commit. A try
    that the back-off does not allow yet is no failed attempt (before the fix it
    restarted the back-off, so once that passed the caller's time-out no receive ever
    connected again)."""
    with BrokerProcess(tmp_path) as broker:
        before = send_all(broker.addr, "rc", [b"b0"])
        opts = {"subject": "rc", "group": "g", "timeout_s": 2, "commit": "sync"}
        with delayd.Consumer(broker.addr, **opts) as consumer:
            assert consumer.receive(timeout_s=5).message_id == before[0]
            broker.kill()
            assert poll_through_outage(lambda: consumer.receive(timeout_s=0.2)) >= 2
            broker.start()
            after = send_all(broker.addr, "rc", [b"a0"])
            ends = time.monotonic() + RECONNECT_S
            received = None
            while received is None and time.monotonic() < ends:
                try:
                    received = consumer.receive(timeout_s=0.2)
                except DelaydTimeout:
                    continue  # the back-off since the last failed attempt is running
            assert received is not None, "the consumer never connected again"
            # b0's commit landed before anything else was handed out (sync), so the
            # next message is the one produced after the restart.
            assert received.message_id == after[0]


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_async_consumer_receives_again_after_an_outage(tmp_path: Path, backend: str) -> None:
    async def scenario(broker: BrokerProcess) -> None:
        before = send_all(broker.addr, "rc", [b"b%d" % i for i in range(6)])
        after: list[str] = []
        opts = {"subject": "rc", "group": "g", "timeout_s": 2}
        async with delayd.open_consumer(broker.addr, **opts) as consumer:
            got = [await consumer.receive(timeout_s=5) for _ in range(3)]
            broker.kill()
            # Prefetched messages are still handed out while the broker is down (their
            # commits wait for the reconnect), then receive fails in time.
            got += [await consumer.receive(timeout_s=SHORT_S) for _ in range(3)]
            assert sorted(m.message_id for m in got if m) == sorted(before)
            calls = 0
            ends = time.monotonic() + OUTAGE_S
            while time.monotonic() < ends:
                started = time.monotonic()
                with pytest.raises(DelaydTimeout, match="could not reach"):
                    await consumer.receive(timeout_s=SHORT_S)
                assert time.monotonic() - started < SHORT_S + SLACK_S
                calls += 1
            assert calls >= 2

            def restart_and_produce() -> None:
                broker.start()
                after.extend(send_all(broker.addr, "rc", [b"a%d" % i for i in range(5)]))

            restart = in_thread(restart_and_produce)
            first = await consumer.receive(timeout_s=PATIENT_S)  # started while still down
            await anyio.to_thread.run_sync(restart.join)
            rest = [await consumer.receive(timeout_s=5) for _ in range(4)]
            assert first is not None and None not in rest
            assert sorted([first.message_id] + [m.message_id for m in rest]) == sorted(after)
            assert await consumer.receive(timeout_s=0.5) is None
        async with delayd.open_consumer(broker.addr, **opts) as again:
            while (message := await again.receive(timeout_s=0.5)) is not None:
                assert message.message_id in before  # as in the blocking test

    with BrokerProcess(tmp_path) as broker:
        anyio.run(scenario, broker, backend=backend)


# --- producers ------------------------------------------------------------------------------


class Target:
    """A broker or a delay server (with its embedded broker) on fixed ports."""

    def __init__(self, kind: str, tmp_path: Path) -> None:
        self.kind = kind
        if kind == "broker":
            self.broker = BrokerProcess(tmp_path / "data")
            self.addr = self.consume_addr = self.broker.addr
        else:
            port, broker_port = free_port(), free_port()
            self.addr = f"127.0.0.1:{port}"
            self.consume_addr = f"127.0.0.1:{broker_port}"
            self.serve = ServeProcess(
                tmp_path / "data",
                *("--listen", self.addr, "--broker-listen", self.consume_addr),
            )

    def start(self) -> None:
        (self.broker if self.kind == "broker" else self.serve).start()

    def kill(self) -> None:
        (self.broker if self.kind == "broker" else self.serve).kill()

    def close(self) -> None:
        if self.kind == "broker":
            self.broker.__exit__()
        else:
            self.serve.close()

    def check_delivered_once(self, ids: list[str]) -> None:
        """Each acknowledged id reaches the broker's subject exactly once."""
        got = []
        with delayd.Consumer(self.consume_addr, subject="rc", group="check") as consumer:
            while len(got) < len(ids) and (message := consumer.receive(timeout_s=10)):
                got.append(message.message_id)
            assert consumer.receive(timeout_s=0.5) is None
        assert sorted(got) == sorted(ids)


@pytest.fixture(params=["broker", "delay-server"])
def target(request: pytest.FixtureRequest, tmp_path: Path):
    target = Target(request.param, tmp_path)
    target.start()
    yield target
    target.close()


def check_receipts(target: Target, receipts: list) -> list[str]:
    assert all(r.ok for r in receipts)
    if target.kind == "delay-server":
        assert all(r.due_ms is not None for r in receipts)
    return [r.message_id for r in receipts]


def test_blocking_producer_sends_again_after_an_outage(target: Target) -> None:
    acked: list[str] = []
    with (
        delayd.Producer(target.addr, timeout_s=SHORT_S) as short,
        delayd.Producer(target.addr, timeout_s=PATIENT_S) as patient,
    ):
        acked += check_receipts(target, [short.send("rc", b"before"), patient.send("rc", b"b")])
        target.kill()
        assert poll_through_outage(lambda: short.send("rc", b"lost")) >= 2
        restart = in_thread(target.start)
        # Sent while the server is still down; acknowledged once it is back.
        acked += check_receipts(target, [patient.send("rc", b"while down")])
        restart.join()
        after = eventually(lambda: short.send_batch([("rc", b"after1"), ("rc", b"after2")]))
        acked += check_receipts(target, after)
    target.check_delivered_once(acked)


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_async_producer_sends_again_after_an_outage(target: Target, backend: str) -> None:
    async def scenario() -> list[str]:
        acked: list[str] = []
        async with (
            delayd.open_producer(target.addr, timeout_s=SHORT_S) as short,
            delayd.open_producer(target.addr, timeout_s=PATIENT_S) as patient,
        ):
            acked += check_receipts(
                target, [await short.send("rc", b"before"), await patient.send("rc", b"b")]
            )
            target.kill()
            calls = 0
            ends = time.monotonic() + OUTAGE_S
            while time.monotonic() < ends:
                started = time.monotonic()
                with pytest.raises(DelaydTimeout, match="took over"):
                    await short.send("rc", b"lost")
                assert time.monotonic() - started < SHORT_S + SLACK_S
                calls += 1
            assert calls >= 2
            restart = in_thread(target.start)
            acked += check_receipts(target, [await patient.send("rc", b"while down")])
            await anyio.to_thread.run_sync(restart.join)
            ends = time.monotonic() + RECONNECT_S
            while True:  # as eventually(): the back-off since the last failure runs first
                try:
                    after = await short.send_batch([("rc", b"after1"), ("rc", b"after2")])
                    break
                except DelaydTimeout:
                    if time.monotonic() > ends:
                        raise
            acked += check_receipts(target, after)
        return acked

    target.check_delivered_once(anyio.run(scenario, backend=backend))
