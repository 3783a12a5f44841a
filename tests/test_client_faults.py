"""Client behaviour on failures a real broker shows only by chance, against small
scripted servers: lost acknowledgements, BUSY and a full disk, refusals, silence, wrong
tokens.

Each async scenario runs under trio and under asyncio (``anyio.run`` with either
backend); the blocking client gets the same scenarios.
"""

from __future__ import annotations

import time

import anyio
import pytest

import delayd
from delayd.errors import BusyError, DelaydTimeout, RejectedError, UnreachableError
from delayd.protocol import ErrorCode, ResultCode, SendBatch, SendResult
from tests.client_support import (
    DROP_ACK,
    HANG,
    ScriptedServer,
    SendHook,
    SilentServer,
)
from tests.process_support import free_port

BACKENDS = ["trio", "asyncio"]
DISK_FULL = "disk full: cannot write /data/delay/message_log/0 (ENOSPC); 0 bytes free"


def drop_first_ack() -> SendHook:
    """Store the first batch but close before acknowledging it."""
    seen: list[SendBatch] = []

    def hook(batch: SendBatch) -> str | None:
        seen.append(batch)
        return DROP_ACK if len(seen) == 1 else None

    return hook


def refuse_second(batch: SendBatch) -> list[SendResult]:
    """OK for every message but the second, which is refused as too large."""
    results = [SendResult(ResultCode.OK) for _ in batch.messages]
    if len(results) > 1:
        results[1] = SendResult(ResultCode.BODY_TOO_LARGE, "body of 5 bytes exceeds 4")
    return results


# --- lost acknowledgement -----------------------------------------------------------------


def check_resent_with_same_ids(server: ScriptedServer, receipts: list) -> None:
    assert len(server.batches) == 2, "the unacknowledged batch is sent once more"
    first, second = server.batches
    assert [m.message_id for m in first.messages] == [m.message_id for m in second.messages]
    assert [r.message_id for r in receipts] == [m.message_id for m in first.messages]
    # The server had stored them before the ack was lost: the retry is a DUPLICATE,
    # which counts as success, and each message is stored once.
    assert all(r.ok and r.code is ResultCode.DUPLICATE for r in receipts)
    assert len(server.stored) == 3
    assert server.connections == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_send_whose_ack_was_lost_is_retried_with_the_same_ids(backend: str) -> None:
    async def scenario() -> None:
        with ScriptedServer(on_send=drop_first_ack()) as server:
            async with delayd.open_producer(server.addr, timeout_s=5) as producer:
                receipts = await producer.send_batch([("s", b"1"), ("s", b"2"), ("s", b"3")])
            check_resent_with_same_ids(server, receipts)

    anyio.run(scenario, backend=backend)


def test_blocking_send_whose_ack_was_lost_is_retried_with_the_same_ids() -> None:
    with ScriptedServer(on_send=drop_first_ack()) as server:
        with delayd.Producer(server.addr, timeout_s=5) as producer:
            receipts = producer.send_batch([("s", b"1"), ("s", b"2"), ("s", b"3")])
        check_resent_with_same_ids(server, receipts)


@pytest.mark.parametrize("backend", [*BACKENDS, "blocking"])
def test_big_batch_is_cut_into_frames_and_survives_a_lost_ack(backend: str) -> None:
    """2,500 messages go out as three frames (at most 1,000 each); the connection dies
    after the first is stored; every message ends up stored once, receipts in order."""
    items = [("s", b"%d" % i) for i in range(2500)]

    async def scenario(server: ScriptedServer) -> list:
        async with delayd.open_producer(server.addr, timeout_s=5) as producer:
            return await producer.send_batch(items)

    with ScriptedServer(on_send=drop_first_ack()) as server:
        if backend == "blocking":
            with delayd.Producer(server.addr, timeout_s=5) as producer:
                receipts = producer.send_batch(items)
        else:
            receipts = anyio.run(scenario, server, backend=backend)
        assert all(r.ok for r in receipts) and len(receipts) == 2500
        assert [server.stored[r.message_id].body for r in receipts] == [b for _, b in items]
        assert len(server.stored) == 2500
        assert max(len(b.messages) for b in server.batches) == 1000


# --- BUSY ---------------------------------------------------------------------------------


# A full server disk is treated as BUSY: sent again with back-off, and still refused
# after the retries, a BusyError (send) or a receipt whose reason says why (send_batch).
RETRIED = [
    (ResultCode.BUSY, "try later", "busy"),
    (ResultCode.DISK_FULL, DISK_FULL, "disk full"),
]


def refused_for(rounds: int, code: ResultCode, reason: str) -> SendHook:
    """Answer ``code`` (storing nothing) to the first ``rounds`` batches."""
    seen: list[SendBatch] = []

    def hook(batch: SendBatch) -> list[SendResult] | None:
        seen.append(batch)
        if len(seen) <= rounds:
            return [SendResult(code, reason) for _ in batch.messages]
        return None

    return hook


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("code", "reason", "says"), RETRIED)
def test_async_busy_is_retried_then_raises_busy_error(
    backend: str, code: ResultCode, reason: str, says: str
) -> None:
    async def scenario() -> None:
        with ScriptedServer(on_send=refused_for(2, code, reason)) as server:
            async with delayd.open_producer(server.addr) as producer:
                receipt = await producer.send("s", b"x")
            assert receipt.code is ResultCode.OK
            assert len(server.batches) == 3
        with ScriptedServer(on_send=refused_for(100, code, reason)) as server:
            async with delayd.open_producer(server.addr, busy_retries=3) as producer:
                with pytest.raises(BusyError, match=says):
                    await producer.send("s", b"x")
                (receipt,) = await producer.send_batch([("s", b"y")])
            assert receipt.code is code and not receipt.ok and receipt.reason == reason
            assert len(server.batches) == 2 * (1 + 3)

    anyio.run(scenario, backend=backend)


@pytest.mark.parametrize(("code", "reason", "says"), RETRIED)
def test_blocking_busy_is_retried_then_raises_busy_error(
    code: ResultCode, reason: str, says: str
) -> None:
    with ScriptedServer(on_send=refused_for(2, code, reason)) as server:
        with delayd.Producer(server.addr) as producer:
            assert producer.send("s", b"x").code is ResultCode.OK
        assert len(server.batches) == 3
    with ScriptedServer(on_send=refused_for(100, code, reason)) as server:
        with delayd.Producer(server.addr, busy_retries=3) as producer:
            with pytest.raises(BusyError, match=says):
                producer.send("s", b"x")
            assert len(server.batches) == 1 + 3
            (receipt,) = producer.send_batch([("s", b"y")])
        assert receipt.code is code and receipt.reason == reason


# --- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_refusals(backend: str) -> None:
    async def scenario() -> None:
        with ScriptedServer(on_send=refuse_second) as server:
            async with delayd.open_producer(server.addr) as producer:
                receipts = await producer.send_batch([("s", b"1"), ("s", b"12345"), ("s", b"3")])
                assert [r.ok for r in receipts] == [True, False, True]
                assert receipts[1].code is ResultCode.BODY_TOO_LARGE
                assert "exceeds" in receipts[1].reason
                with pytest.raises(ValueError, match="not both"):
                    await producer.send("s", b"", at_ms=1, delay_ms=1)

        def refuse_all(batch: SendBatch) -> list[SendResult]:
            return [
                SendResult(ResultCode.DELAY_TOO_LONG, "beyond max_delay") for _ in batch.messages
            ]

        with ScriptedServer(on_send=refuse_all) as server:
            async with delayd.open_producer(server.addr) as producer:
                with pytest.raises(RejectedError) as info:
                    await producer.send("s", b"x", delay_ms=10**12)
            assert info.value.code is ResultCode.DELAY_TOO_LONG
            assert info.value.reason == "beyond max_delay"

    anyio.run(scenario, backend=backend)


def test_blocking_refusals() -> None:
    with ScriptedServer(on_send=refuse_second) as server, delayd.Producer(server.addr) as producer:
        receipts = producer.send_batch([("s", b"1"), ("s", b"12345"), ("s", b"3")])
        assert [r.ok for r in receipts] == [True, False, True]
        assert receipts[1].code is ResultCode.BODY_TOO_LARGE
    with ScriptedServer(
        on_send=lambda batch: [SendResult(ResultCode.EMPTY_ID, "empty id")]
    ) as server:
        with delayd.Producer(server.addr) as producer, pytest.raises(RejectedError) as info:
            producer.send("s", b"x", message_id="")
        assert info.value.code is ResultCode.EMPTY_ID


# --- silence and tokens ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_server_that_never_answers_hello_times_out(backend: str) -> None:
    async def scenario() -> None:
        with SilentServer() as server:
            started = time.monotonic()
            with pytest.raises(DelaydTimeout, match=r"within 0\.4 s"):
                async with delayd.open_producer(server.addr, timeout_s=0.4):
                    pass
            with pytest.raises(DelaydTimeout):
                async with delayd.open_consumer(server.addr, subject="s", group="g", timeout_s=0.4):
                    pass
            assert time.monotonic() - started < 2.0

    anyio.run(scenario, backend=backend)


def test_blocking_server_that_never_answers_hello_times_out() -> None:
    with SilentServer() as server:
        started = time.monotonic()
        producer = delayd.Producer(server.addr, timeout_s=0.4)
        with pytest.raises(DelaydTimeout):
            producer.send("s", b"x")
        with (
            pytest.raises(DelaydTimeout),
            delayd.Consumer(server.addr, subject="s", group="g", timeout_s=0.4),
        ):
            pass
        assert time.monotonic() - started < 2.0
        assert isinstance(DelaydTimeout("x"), TimeoutError)


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_send_without_answer_times_out(backend: str) -> None:
    async def scenario() -> None:
        with ScriptedServer(on_send=lambda batch: HANG) as server:
            async with delayd.open_producer(server.addr, timeout_s=0.3) as producer:
                started = time.monotonic()
                with pytest.raises(DelaydTimeout, match="took over"):
                    await producer.send("s", b"x")
                assert 0.3 <= time.monotonic() - started < 1.5

    anyio.run(scenario, backend=backend)


def test_blocking_send_without_answer_times_out() -> None:
    server = ScriptedServer(on_send=lambda batch: HANG)
    with server, delayd.Producer(server.addr, timeout_s=0.3) as producer:
        started = time.monotonic()
        with pytest.raises(DelaydTimeout, match="took over"):
            producer.send("s", b"x")
        assert 0.3 <= time.monotonic() - started < 1.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_wrong_token_is_refused_at_once(backend: str) -> None:
    async def scenario() -> None:
        with ScriptedServer(token="s3cret") as server:
            started = time.monotonic()
            for token in ("wrong", None):
                with pytest.raises(RejectedError, match="token") as info:
                    async with delayd.open_producer(server.addr, token=token):
                        pass
                assert info.value.code == ErrorCode.UNAUTHORIZED
            assert time.monotonic() - started < 1.0  # refused, not retried until a time-out
            async with delayd.open_producer(server.addr, token="s3cret") as producer:
                assert (await producer.send("s", b"x")).ok

    anyio.run(scenario, backend=backend)


def test_blocking_wrong_token_is_refused_at_once() -> None:
    with ScriptedServer(token="s3cret") as server:
        with pytest.raises(RejectedError, match="token") as info:
            delayd.Producer(server.addr, token="wrong").send("s", b"x")
        assert info.value.code == ErrorCode.UNAUTHORIZED
        with delayd.Producer(server.addr, token="s3cret") as producer:
            assert producer.send("s", b"x").ok


# --- nobody listening ---------------------------------------------------------------------

UNREACHABLE = r"cannot connect to 127\.0\.0\.1:\d+: Connection refused\. Is `delayd serve`"


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_first_connect_fails_at_once_when_not_retried(backend: str) -> None:
    addr = f"127.0.0.1:{free_port()}"

    async def scenario() -> None:
        started = time.monotonic()
        with pytest.raises(UnreachableError, match=UNREACHABLE):
            async with delayd.open_producer(addr, retry_first_connect=False):
                pass
        with pytest.raises(UnreachableError, match=UNREACHABLE):
            async with delayd.open_consumer(
                addr, subject="s", group="g", retry_first_connect=False
            ):
                pass
        assert time.monotonic() - started < 0.5  # no back-off, no time-out
        with pytest.raises(DelaydTimeout, match=r"within 0\.3 s"):
            async with delayd.open_producer(addr, timeout_s=0.3):  # retried by default
                pass

    anyio.run(scenario, backend=backend)


def test_blocking_first_connect_fails_at_once_when_not_retried() -> None:
    addr = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(UnreachableError, match=UNREACHABLE):
        delayd.Producer(addr, retry_first_connect=False).send("s", b"x")
    with pytest.raises(UnreachableError, match=UNREACHABLE):
        delayd.Consumer(addr, subject="s", group="g", retry_first_connect=False).connect()
    assert time.monotonic() - started < 0.5
    started = time.monotonic()
    with pytest.raises(DelaydTimeout, match="ConnectionRefused"):  # (1 s: time to try once)
        delayd.Producer(addr, timeout_s=1.0).send("s", b"x")  # retried by default
    assert time.monotonic() - started >= 1.0


def test_reconnections_after_the_first_are_retried_either_way() -> None:
    server = ScriptedServer(on_send=drop_first_ack())
    # 1.5 s: a loaded machine spent a 0.5 s time-out before the first reconnection was
    # tried, and the error then named no refused connection.
    with server, delayd.Producer(server.addr, retry_first_connect=False, timeout_s=1.5) as p:
        assert p.send("s", b"x").ok  # the lost ack: reconnected and sent again
        assert server.connections == 2
        server.close()
        started = time.monotonic()
        with pytest.raises(DelaydTimeout, match="ConnectionRefused"):
            p.send("s", b"y")  # the server is gone: retried until the time-out
        assert time.monotonic() - started >= 1.5


# --- closing ------------------------------------------------------------------------------


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    """Whether ``condition()`` held within ``timeout_s`` (generous: the scripted server's
    thread may wait for a core on a loaded machine; an open connection never closes)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("backend", BACKENDS)
def test_async_close_closes_the_connection(backend: str) -> None:
    """The broker drops a consumer's membership when its connection closes, so a
    client that left its socket open would hold its queues until the heartbeat
    time-out."""

    async def scenario() -> None:
        with ScriptedServer() as server:
            async with delayd.open_producer(server.addr) as producer:
                await producer.send("s", b"x")
                assert server.active == 1
            assert await anyio.to_thread.run_sync(lambda: wait_for(lambda: server.active == 0))

    anyio.run(scenario, backend=backend)


def test_blocking_close_closes_the_connection() -> None:
    with ScriptedServer() as server:
        with delayd.Producer(server.addr) as producer:
            producer.send("s", b"x")
            assert server.active == 1
        assert wait_for(lambda: server.active == 0)


# --- the user's exceptions ------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_errors_in_the_body_propagate_unwrapped(backend: str) -> None:
    """Not an ExceptionGroup from the clients' task group: ``except ValueError`` works."""

    async def scenario() -> None:
        with ScriptedServer() as server, pytest.raises(ValueError, match="mine"):
            async with delayd.open_producer(server.addr):
                raise ValueError("mine")

    anyio.run(scenario, backend=backend)
