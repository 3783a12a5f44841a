"""The clients against real ``delayd broker`` processes on loopback ports.

Each async scenario runs under trio and under asyncio (``anyio.run`` with either
backend). Subjects differ per test so one broker serves most of them; the reconnect and
token tests start their own.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

import delayd
from delayd.errors import RejectedError
from delayd.protocol import ErrorCode, Message
from tests.client_support import BrokerProcess
from tests.delivery_support import consume
from tests.process_support import DELAYD, ROOT, child_env

BACKENDS = ["trio", "asyncio"]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    with BrokerProcess(tmp_path_factory.mktemp("broker")) as process:
        yield process


def unique(name: str) -> str:
    """A subject or group name no other test uses."""
    return f"{name}-{time.monotonic_ns()}"


def outgoing(subject: str, n: int) -> list[dict]:
    return [
        {
            "subject": subject,
            "body": f"body-{i}".encode(),
            "key": f"k{i % 3}",
            "properties": {"n": str(i)},
        }
        for i in range(n)
    ]


async def consume_async(addr: str, subject: str, group: str, n: int, **kw) -> list[Message]:
    """Exactly ``n`` messages (fails after 10 s without one), then checks for no more."""
    got: list[Message] = []
    async with delayd.open_consumer(addr, subject=subject, group=group, **kw) as consumer:
        while len(got) < n:
            message = await consumer.receive(timeout_s=10)
            assert message is not None, f"only {len(got)} of {n} messages came"
            got.append(message)
    return got


def check_round_trip(sent: list[dict], receipts: list, got: list[Message]) -> None:
    assert all(r.ok for r in receipts)
    ids = [r.message_id for r in receipts]
    assert len(set(ids)) == len(ids)
    assert sorted(m.message_id for m in got) == sorted(ids), "each message exactly once"
    by_id = {m.message_id: m for m in got}
    for receipt, spec in zip(receipts, sent, strict=True):
        m = by_id[receipt.message_id]
        assert (m.subject, m.body, m.key, m.properties) == (
            spec["subject"],
            spec["body"],
            spec["key"],
            spec["properties"],
        )
        assert (m.queue, m.queue_offset) == (receipt.queue, receipt.queue_offset)
        assert m.store_ms is not None
        assert m.due_ms is None and m.dispatched_ms is None  # not delayed
    # Per queue, offsets arrive in order.
    for queue in {m.queue for m in got}:
        offsets = [m.queue_offset for m in got if m.queue == queue]
        assert offsets == sorted(offsets)


# --- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_round_trip(broker: BrokerProcess, backend: str) -> None:
    subject = unique("rt")

    async def scenario() -> None:
        sent = outgoing(subject, 40)
        async with delayd.open_producer(broker.addr) as producer:
            first = await producer.send(**sent[0])
            receipts = [first, *await producer.send_batch(sent[1:])]
        got = await consume_async(broker.addr, subject, "g", len(sent))
        check_round_trip(sent, receipts, got)

    anyio.run(scenario, backend=backend)


def test_blocking_round_trip(broker: BrokerProcess) -> None:
    subject = unique("rt-blocking")
    sent = outgoing(subject, 40)
    with delayd.Producer(broker.addr) as producer:
        receipts = [producer.send(**sent[0]), *producer.send_batch(sent[1:])]
    got: list[Message] = []
    with delayd.Consumer(broker.addr, subject=subject, group="g") as consumer:
        for message in consumer:
            got.append(message)
            if len(got) == len(sent):
                break
        assert consumer.receive(timeout_s=0.2) is None
    check_round_trip(sent, receipts, got)


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_poll_wakes_on_arrival(broker: BrokerProcess, backend: str) -> None:
    """A consumer waiting for a message gets it within a few ms of its send, also when
    its PULL was sent ahead (prefetch) while it still worked through earlier ones."""
    subject = unique("wake")

    async def scenario() -> None:
        async with (
            delayd.open_consumer(broker.addr, subject=subject, group="g") as consumer,
            delayd.open_producer(broker.addr) as producer,
        ):
            latencies, earlier = [], []
            for _ in range(5):
                started = time.perf_counter()
                await producer.send_batch([(subject, b"earlier")] * 3)
                for _ in range(3):
                    assert (await consumer.receive(5.0)).body == b"earlier"
                earlier.append(time.perf_counter() - started)
                got: list = []
                async with anyio.create_task_group() as tg:

                    async def receive(into: list = got) -> None:
                        into.append(await consumer.receive(5.0))

                    tg.start_soon(receive)
                    await anyio.sleep(0.05)  # the consumer is now waiting in a PULL
                    started = time.perf_counter()
                    await producer.send(subject, b"x")
                latencies.append(time.perf_counter() - started)
                assert got[0].body == b"x"
            assert sorted(latencies)[2] < 0.1, latencies
            # A PULL's answer that arrives while commits are being sent is not left
            # waiting behind the next PULL's long poll.
            assert max(earlier) < 1.0, earlier

    anyio.run(scenario, backend=backend)


# --- commits ------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_auto_commit_resumes_after_restart_without_redelivery(
    broker: BrokerProcess, backend: str
) -> None:
    subject, group = unique("resume"), unique("g")

    async def scenario() -> None:
        async with delayd.open_producer(broker.addr) as producer:
            receipts = await producer.send_batch([(subject, b"%d" % i) for i in range(30)])
        ids = {r.message_id for r in receipts}
        first: list[str] = []
        async with delayd.open_consumer(broker.addr, subject=subject, group=group) as consumer:
            async for message in consumer:
                first.append(message.message_id)
                if len(first) == 10:
                    break  # a clean exit: all 10 are committed
        # The body fails on the 3rd message: the first two are committed, not the 3rd.
        second: list[str] = []
        with pytest.raises(RuntimeError, match="handler failed"):
            async with delayd.open_consumer(broker.addr, subject=subject, group=group) as c:
                async for message in c:
                    second.append(message.message_id)
                    if len(second) == 3:
                        raise RuntimeError("handler failed")
        rest = [m.message_id for m in await consume_async(broker.addr, subject, group, 18)]
        assert second[2] in rest, "the failed message comes again"
        assert len(set(first) | set(second) | set(rest)) == 30 == len(ids)
        assert not set(first) & set(second), "nothing committed was delivered again"
        assert not set(first) & set(rest) and not set(second[:2]) & set(rest)
        async with delayd.open_consumer(broker.addr, subject=subject, group=group) as consumer:
            # The closed consumers left the group with their connections: all queues are
            # this one's well before a silent member would be dropped (heartbeat_timeout_ms,
            # 10 s). Their leaving may reach the broker after this join on a loaded machine;
            # this one hears of it at its next heartbeat (every 3 s).
            with anyio.fail_after(8):
                while consumer.queues != (0, 1, 2, 3):
                    assert await consumer.receive(timeout_s=0.1) is None
            assert await consumer.receive(timeout_s=0.3) is None

    anyio.run(scenario, backend=backend)


def test_blocking_auto_and_manual_commit(broker: BrokerProcess) -> None:
    subject, group = unique("commit-blocking"), unique("g")
    with delayd.Producer(broker.addr) as producer:
        producer.send_batch([(subject, b"%d" % i) for i in range(6)])
    with delayd.Consumer(broker.addr, subject=subject, group=group, auto_commit=False) as c:
        unconfirmed = [c.receive(timeout_s=5) for _ in range(3)]
    with delayd.Consumer(broker.addr, subject=subject, group=group, auto_commit=False) as c:
        again = [c.receive(timeout_s=5) for _ in range(6)]
        assert {m.message_id for m in unconfirmed} <= {m.message_id for m in again}
        for message in again:
            c.commit(message)
    with delayd.Consumer(broker.addr, subject=subject, group=group) as c:
        # The closed consumers left with their connections: all queues are this one's
        # well before a silent member would be dropped (10 s). Their leaving may reach
        # the broker after this join on a loaded machine (as in the async test above);
        # this one hears of it at its next heartbeat (every 3 s).
        deadline = time.monotonic() + 8
        while c.queues != (0, 1, 2, 3):
            assert time.monotonic() < deadline, f"queues {c.queues} after 8 s"
            assert c.receive(timeout_s=0.1) is None
        assert c.receive(timeout_s=0.3) is None


def test_refused_subscription_is_a_clear_error(broker: BrokerProcess) -> None:
    async def scenario() -> None:
        with pytest.raises(RejectedError, match="subject") as info:
            async with delayd.open_consumer(broker.addr, subject="no/slashes", group="g"):
                pass
        assert info.value.code == ErrorCode.INVALID_REQUEST

    for backend in BACKENDS:
        anyio.run(scenario, backend=backend)
    with pytest.raises(RejectedError, match="subject"):
        delayd.Consumer(broker.addr, subject="no/slashes", group="g").receive(timeout_s=1)


# --- groups and heartbeats ------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_heartbeats_keep_a_busy_member_and_follow_reassignment(
    tmp_path: Path, backend: str
) -> None:
    """With a 2 s member time-out, a consumer that pulls nothing for 3 s stays a member
    (the background heartbeat), and learns of the queues a leaving member gives up."""

    async def scenario(broker: BrokerProcess) -> None:
        opts = {"subject": "hb", "group": "g", "heartbeat_interval_s": 0.2}
        async with delayd.open_consumer(broker.addr, **opts) as a:
            assert a.queues == (0, 1, 2, 3)
            await anyio.sleep(3.0)  # the user's handler is slow; no PULL in this time
            async with delayd.open_consumer(broker.addr, **opts) as b:
                assert len(b.queues) == 2, "a is still a member: the queues are split"
                # a gives up its two at a heartbeat (every 0.2 s; later when loaded).
                with anyio.fail_after(3):
                    while sorted(a.queues + b.queues) != [0, 1, 2, 3]:
                        await anyio.sleep(0.05)
            with anyio.fail_after(3):
                while a.queues != (0, 1, 2, 3):  # b left: a heartbeat brings them back
                    await anyio.sleep(0.05)

    with BrokerProcess(tmp_path, heartbeat_timeout_ms=2000) as broker:
        anyio.run(scenario, broker, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_joining_consumer_gets_a_queue_only_after_the_old_one_committed(
    broker: BrokerProcess, backend: str
) -> None:
    """a holds an uncommitted message of every queue when b joins: b reads none of the
    queues it is given until a committed them, so no message reaches both."""
    subject = unique("handover")

    async def scenario() -> None:
        async with delayd.open_producer(broker.addr) as producer:
            await producer.send_batch([{"subject": subject, "body": b"x"} for _ in range(200)])
        opts = {"subject": subject, "group": "g", "heartbeat_interval_s": 0.2}
        got_a: list[Message] = []
        got_b: list[Message] = []
        # Small PULLs: a PULL reads one queue after another, so a holds messages of
        # every queue long before it read them all.
        a_opts = {"auto_commit": False, "max_messages": 4}
        async with delayd.open_consumer(broker.addr, **a_opts, **opts) as a:
            while {m.queue for m in got_a} != {0, 1, 2, 3}:
                message = await a.receive(timeout_s=5)
                assert message is not None
                got_a.append(message)
            async with delayd.open_consumer(broker.addr, **opts) as b:
                assert len(b.queues) == 2
                while (message := await b.receive(timeout_s=1.0)) is not None:
                    got_b.append(message)
                assert got_b == [], "b read a queue a still held"
                for message in got_a:
                    await a.commit(message)
                for consumer, got in ((a, got_a), (b, got_b)):
                    while (message := await consumer.receive(timeout_s=1.5)) is not None:
                        got.append(message)
                        if consumer is a:
                            await a.commit(message)
        ids_a = {m.message_id for m in got_a}
        ids_b = {m.message_id for m in got_b}
        assert not ids_a & ids_b
        assert len(ids_a | ids_b) == 200 and len(got_b) > 50

    anyio.run(scenario, backend=backend)


def test_blocking_heartbeat_thread_keeps_a_busy_member(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path, heartbeat_timeout_ms=2000) as broker:
        opts = {"subject": "hb", "group": "g", "heartbeat_interval_s": 0.2}
        with delayd.Consumer(broker.addr, **opts) as a:
            assert a.queues == (0, 1, 2, 3)
            time.sleep(3.0)  # a slow synchronous handler (longer than the 2 s timeout)
            with delayd.Consumer(broker.addr, **opts) as b:
                assert len(b.queues) == 2, "a is still a member: the queues are split"


# --- reconnect ----------------------------------------------------------------------------


def restart_later(broker: BrokerProcess, delay_s: float) -> threading.Thread:
    """Start ``broker`` again (same port) after ``delay_s``, in a thread."""

    def run() -> None:
        time.sleep(delay_s)
        broker.start()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_reconnect_after_kill_9(tmp_path: Path, backend: str) -> None:
    """kill -9 mid-stream, restart on the same port: the producer's next sends succeed
    after back-off, the consumer carries on, and nothing acknowledged is lost."""

    async def scenario(broker: BrokerProcess) -> None:
        acked: list[str] = []
        seen: list[str] = []
        async with (
            delayd.open_producer(broker.addr, timeout_s=15) as producer,
            delayd.open_consumer(broker.addr, subject="rc", group="g", timeout_s=15) as consumer,
        ):
            for round_ in range(6):
                if round_ == 3:
                    broker.kill()
                    restart = restart_later(broker, 0.5)
                receipts = await producer.send_batch([("rc", b"%d" % i) for i in range(50)])
                assert all(r.ok for r in receipts)
                acked += [r.message_id for r in receipts]
                while len(set(seen)) < len(acked):
                    message = await consumer.receive(timeout_s=15)
                    assert message is not None
                    seen.append(message.message_id)
            restart.join()
        assert set(seen) == set(acked)
        # Reading the whole subject again as a new group: every acknowledged message,
        # once (the broker's dedupe absorbed any resend whose ack was lost).
        everything = await consume_async(broker.addr, "rc", "audit", len(acked))
        assert sorted(m.message_id for m in everything) == sorted(acked)

    with BrokerProcess(tmp_path) as broker:
        anyio.run(scenario, broker, backend=backend)


def test_blocking_reconnect_after_kill_9(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path) as broker:
        acked: list[str] = []
        with delayd.Producer(broker.addr, timeout_s=15) as producer:
            for round_ in range(6):
                if round_ == 3:
                    broker.kill()
                    restart = restart_later(broker, 0.5)
                receipts = producer.send_batch([("rc", b"%d" % i) for i in range(50)])
                assert all(r.ok for r in receipts)
                acked += [r.message_id for r in receipts]
            restart.join()
        # Until the restarted broker's queues are read to their ends (its reput may lag
        # on a loaded machine: a second without a message does not mean none is left).
        received = consume(("127.0.0.1", broker.port), len(acked), subject="rc", group="g")
        assert sorted(r.message.message_id for r in received) == sorted(acked)


# --- tokens -------------------------------------------------------------------------------


def test_wrong_token_is_refused_clearly(tmp_path: Path) -> None:
    async def scenario(addr: str) -> None:
        with pytest.raises(RejectedError, match="token") as info:
            async with delayd.open_producer(addr, token="wrong"):
                pass
        assert info.value.code == ErrorCode.UNAUTHORIZED
        with pytest.raises(RejectedError, match="token"):
            async with delayd.open_consumer(addr, subject="s", group="g"):
                pass  # no token at all
        async with delayd.open_producer(addr, token="s3cret") as producer:
            assert (await producer.send("s", b"x")).ok

    with BrokerProcess(tmp_path, token="s3cret") as broker:
        started = time.monotonic()
        for backend in BACKENDS:
            anyio.run(scenario, broker.addr, backend=backend)
        with pytest.raises(RejectedError, match="token") as info:
            delayd.Producer(broker.addr, token="wrong").send("s", b"x")
        assert info.value.code == ErrorCode.UNAUTHORIZED
        with delayd.Consumer(broker.addr, subject="s", group="g", token="s3cret") as consumer:
            assert consumer.receive(timeout_s=5).body == b"x"
        assert time.monotonic() - started < 5, "refusals are immediate, not retried"


# --- the consume command ------------------------------------------------------------------


def delayd_consume(*args: str, timeout_s: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*DELAYD, "consume", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=ROOT,
        env=child_env(),
        check=False,
    )


def test_consume_command_prints_json_lines(broker: BrokerProcess) -> None:
    subject, group = unique("cli"), unique("g")
    with delayd.Producer(broker.addr) as producer:
        receipts = producer.send_batch(
            [
                {"subject": subject, "body": "héllo\nworld", "key": "k1", "properties": {"a": "b"}},
                {"subject": subject, "body": b"\xff\x00binary"},
                {"subject": subject, "body": b"third"},
            ]
        )
    common = ["--broker", broker.addr, "--subject", subject, "--group", group]
    done = delayd_consume(*common, "--json", "--count", "2")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == 2
    # The one left (by --count: 0.5 s of silence was not the end when the first run's
    # leaving reached the broker after this run's join, on a loaded machine).
    done = delayd_consume(*common, "--json", "--count", "1", "--timeout", "10")
    assert done.returncode == 0, done.stderr
    lines += [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == 3, "the second run continues where the first stopped"
    by_id = {line["id"]: line for line in lines}
    assert set(by_id) == {r.message_id for r in receipts}
    text = by_id[receipts[0].message_id]
    assert text["body"] == "héllo\nworld" and text["body_encoding"] == "utf-8"
    assert (text["subject"], text["key"], text["properties"]) == (subject, "k1", {"a": "b"})
    assert (text["queue"], text["queue_offset"]) == (receipts[0].queue, receipts[0].queue_offset)
    assert isinstance(text["store_ms"], int)
    assert text["due_ms"] is None and text["dispatched_ms"] is None
    binary = by_id[receipts[1].message_id]
    assert binary["body_encoding"] == "base64" and binary["body"] == "/wBiaW5hcnk="
    assert by_id[receipts[2].message_id]["key"] is None


def test_consume_command_plain_lines_and_errors(broker: BrokerProcess) -> None:
    subject, group = unique("cli-plain"), unique("g")
    with delayd.Producer(broker.addr) as producer:
        receipt = producer.send(subject, "one\ntwo", key="k")
    common = ["--broker", broker.addr, "--subject", subject, "--group", group]
    done = delayd_consume(*common, "--count", "1")
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout
        == f'{receipt.queue}:{receipt.queue_offset} {receipt.message_id} key=k "one\\ntwo"\n'
    )
    bad = delayd_consume("--broker", "nowhere", "--subject", "s", "--group", "g")
    assert bad.returncode == 2 and "'nowhere' has no port; write HOST:PORT" in bad.stderr
