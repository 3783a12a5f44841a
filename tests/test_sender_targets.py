"""Send targets: the embedded broker and a broker process behind one interface.

The contract tests run against both (STYLE.md #10): an in-process Broker, and
``delayd broker`` on a loopback port. The RemoteTarget tests then break the process —
kill -9, SIGSTOP, wrong token, nobody listening — and check that a dead group fails
fast with TargetUnavailable and that the same target works again once the broker is
back. Real sockets, real fsyncs.
"""

from __future__ import annotations

import functools
import signal

import pytest
import trio

from delayd.broker import Broker, BrokerConfig
from delayd.protocol import (
    NEED_DATA,
    SERVER,
    Connection,
    ConnectionClosed,
    Error,
    ErrorCode,
    Hello,
    HelloOk,
    Message,
    ResultCode,
    SendBatch,
    SendBatchResult,
    SendResult,
)
from delayd.sender import EmbeddedTarget, RemoteTarget, SendTarget, TargetUnavailable
from tests.client_support import HANG, BrokerProcess, ScriptedServer, SilentServer
from tests.process_support import free_port

pytestmark = pytest.mark.slow

CONFIG = BrokerConfig(index_slot_count=1009, index_max_entries=50, dedupe_max_ids=1000)
MiB = 1024 * 1024


def due(prefix: str, count: int, subject: str = "orders", body_bytes: int = 0) -> list[Message]:
    """Messages as the sender sends them: due_ms and dispatched_ms set, no delay."""
    return [
        Message(
            f"{prefix}-{i}",
            subject,
            body=b"%d" % i if not body_bytes else bytes([i % 256]) * body_bytes,
            due_ms=1_700_000_000_000 + i,
            dispatched_ms=1_700_000_000_005 + i,
        )
        for i in range(count)
    ]


@pytest.fixture
def processes(tmp_path):
    """Make BrokerProcesses (not started); all are killed at the end of the test."""
    made: list[BrokerProcess] = []

    def make(name: str = "broker", **kwargs) -> BrokerProcess:
        process = BrokerProcess(tmp_path / name, **kwargs)
        made.append(process)
        return process

    yield make
    for process in made:
        if process.proc is not None and process.proc.poll() is None:
            process.proc.send_signal(signal.SIGCONT)  # a stopped one too
        process.__exit__()


async def start(process: BrokerProcess) -> BrokerProcess:
    return await trio.to_thread.run_sync(process.start)


@pytest.fixture(params=["embedded", "remote"])
async def target(request, tmp_path, processes):
    """The same SendTarget contract, against both kinds of target."""
    if request.param == "embedded":
        broker = await trio.to_thread.run_sync(Broker.open, str(tmp_path / "embedded"), CONFIG)
        async with trio.open_nursery() as nursery:
            await nursery.start(broker.run)
            embedded = EmbeddedTarget("local", broker)
            yield embedded
            await embedded.aclose()
            nursery.cancel_scope.cancel()
    else:
        process = await start(processes())
        remote = RemoteTarget("remote", [process.addr])
        yield remote
        await remote.aclose()


# ---------------------------------------------------------------- the contract


async def test_stores_the_batch_and_answers_in_order(target: SendTarget):
    sent = due("a", 5)
    results = await target.send_batch(sent)
    assert [r.code for r in results] == [ResultCode.OK] * 5
    offsets = [r.commitlog_offset for r in results]
    assert offsets == sorted(offsets) and len(set(offsets)) == 5
    assert [r.due_ms for r in results] == [m.due_ms for m in sent]
    # Stored for real: the same ids again are duplicates, pointing at the same records.
    again = await target.send_batch(list(reversed(sent)))
    assert [r.code for r in again] == [ResultCode.DUPLICATE] * 5
    assert [r.commitlog_offset for r in again] == list(reversed(offsets))


async def test_duplicate_ids_within_and_across_batches(target: SendTarget):
    first = await target.send_batch(due("b", 2))
    x, y = due("b", 2)
    results = await target.send_batch([*due("c", 1), x, *due("c", 1), y])
    assert [r.code for r in results] == [
        ResultCode.OK,
        ResultCode.DUPLICATE,
        ResultCode.DUPLICATE,
        ResultCode.DUPLICATE,
    ]
    assert results[1].commitlog_offset == first[0].commitlog_offset
    assert results[2].commitlog_offset == results[0].commitlog_offset


async def test_refusals_are_results_not_exceptions(target: SendTarget):
    good = due("d", 2)
    results = await target.send_batch(
        [
            good[0],
            Message("", "orders"),
            Message("d-bad-subject", "../etc"),
            Message("d-delayed", "orders", delay_ms=5),
            good[1],
        ]
    )
    assert [r.code for r in results] == [
        ResultCode.OK,
        ResultCode.EMPTY_ID,
        ResultCode.INVALID_SUBJECT,
        ResultCode.INVALID_DELAY,
        ResultCode.OK,
    ]
    assert all(r.reason for r in results[1:4])


async def test_empty_batch(target: SendTarget):
    assert await target.send_batch([]) == []


async def test_concurrent_batches(target: SendTarget):
    results: dict[int, list[SendResult]] = {}

    async def send(n: int) -> None:
        results[n] = await target.send_batch(due(f"e{n}", 10))

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for n in range(40):
                nursery.start_soon(send, n)
    assert all(r.code is ResultCode.OK for batch in results.values() for r in batch)
    offsets = {r.commitlog_offset for batch in results.values() for r in batch}
    assert len(offsets) == 400


# ---------------------------------------------------------------- embedded


async def test_embedded_messages_reach_consumers_with_delay_fields(tmp_path):
    broker = await trio.to_thread.run_sync(Broker.open, str(tmp_path), CONFIG)
    async with trio.open_nursery() as nursery:
        await nursery.start(broker.run)
        target = EmbeddedTarget("local", broker)
        sent = due("f", 3)
        await target.send_batch(sent)
        broker.join("g", "orders", "c", None, broker.monotonic_ms())
        got = await broker.pull("orders", "g", "c", 100, 0)
        assert sorted((m.message_id, m.due_ms, m.dispatched_ms, m.body) for m in got) == [
            (m.message_id, m.due_ms, m.dispatched_ms, m.body) for m in sent
        ]
        await target.aclose()  # leaves the broker open
        assert [r.code for r in await broker.send_batch(due("f2", 1))] == [ResultCode.OK]
        nursery.cancel_scope.cancel()


# ---------------------------------------------------------------- remote: failures


async def test_kill_9_fails_fast_and_the_same_target_recovers_after_restart(processes):
    process = await start(processes())
    # A connect time-out of 5 s, not 1: a just-started broker on a loaded machine was
    # slower than 1 s to answer HELLO. Failing fast after kill -9 needs no time-out.
    target = RemoteTarget("remote", [process.addr], connect_timeout_s=5.0)
    before = await target.send_batch(due("g", 3))
    assert [r.code for r in before] == [ResultCode.OK] * 3
    process.kill()
    with trio.fail_after(3):
        with pytest.raises(TargetUnavailable, match=f"remote.*{process.addr}"):
            await target.send_batch(due("h", 1))
        # Nobody listens now: connection refused, at once, naming the address.
        with pytest.raises(TargetUnavailable, match=process.addr):
            await target.send_batch(due("h", 1))
    await start(process)  # the same data directory and port
    with trio.fail_after(10):
        after = await target.send_batch([*due("h", 1), *due("g", 3)])
    assert [r.code for r in after] == [ResultCode.OK] + [ResultCode.DUPLICATE] * 3
    assert [r.commitlog_offset for r in after[1:]] == [r.commitlog_offset for r in before]
    assert target.connects == 2
    await target.aclose()


async def test_stopped_broker_times_out_then_answers_again(processes):
    process = await start(processes())
    target = RemoteTarget("remote", [process.addr], timeout_s=1.0, connect_timeout_s=0.3)
    assert (await target.send_batch(due("i", 1)))[0].code is ResultCode.OK
    process.proc.send_signal(signal.SIGSTOP)
    try:
        # A request on the open connection: bounded by timeout_s.
        began = trio.current_time()
        with trio.fail_after(5), pytest.raises(TargetUnavailable, match=r"within 1\.0 s"):
            await target.send_batch(due("j", 1))
        assert 0.9 < trio.current_time() - began < 3
        # A new connection: the kernel accepts it, HELLO gets no answer.
        began = trio.current_time()
        with trio.fail_after(5), pytest.raises(TargetUnavailable, match="no HELLO_OK within"):
            await target.send_batch(due("j", 1))
        assert trio.current_time() - began < 0.9
    finally:
        process.proc.send_signal(signal.SIGCONT)
    with trio.fail_after(10):
        results = await target.send_batch(due("j", 2))
    # j-0 may have been stored by the request that timed out: either answer is right.
    assert results[0].code.is_success and results[1].code is ResultCode.OK
    await target.aclose()


async def test_nobody_listening_fails_at_once():
    address = f"127.0.0.1:{free_port()}"
    target = RemoteTarget("nobody", [address])
    with trio.fail_after(2), pytest.raises(TargetUnavailable, match=f"nobody: {address}"):
        await target.send_batch(due("k", 1))
    assert target.connects == 0


async def test_silent_server_bounded_by_connect_timeout():
    with SilentServer() as silent:
        target = RemoteTarget("silent", [silent.addr], connect_timeout_s=0.2)
        began = trio.current_time()
        with trio.fail_after(3), pytest.raises(TargetUnavailable, match="no HELLO_OK"):
            await target.send_batch(due("l", 1))
        assert trio.current_time() - began < 1


async def test_hung_request_bounded_by_timeout_and_connection_replaced():
    hang = True
    with ScriptedServer(on_send=lambda batch: HANG if hang else None) as server:
        target = RemoteTarget("scripted", [server.addr], timeout_s=0.5)
        with trio.fail_after(3), pytest.raises(TargetUnavailable, match=r"within 0\.5 s"):
            await target.send_batch(due("m", 1))
        hang = False
        assert [r.code for r in await target.send_batch(due("m", 1))] == [ResultCode.OK]
        assert target.connects == 2  # the hung connection was not reused


async def test_wrong_or_missing_token(processes):
    process = await start(processes(token="s3cret"))
    for token in ("wrong", None):
        target = RemoteTarget("secure", [process.addr], token=token)
        with trio.fail_after(3), pytest.raises(TargetUnavailable, match="token"):
            await target.send_batch(due("n", 1))
    target = RemoteTarget("secure", [process.addr], token="s3cret")
    assert [r.code for r in await target.send_batch(due("n", 1))] == [ResultCode.OK]
    await target.aclose()


async def test_addresses_tried_in_order_and_the_working_one_kept(processes):
    dead = f"127.0.0.1:{free_port()}"
    a = await start(processes("a"))
    b = await start(processes("b"))
    target = RemoteTarget("pair", [dead, a.addr, b.addr])
    assert target.address == dead
    await target.send_batch(due("o", 1))
    assert target.address == a.addr and target.connects == 1
    await target.send_batch(due("o", 1))
    assert target.connects == 1
    a.kill()
    with trio.fail_after(3), pytest.raises(TargetUnavailable):
        await target.send_batch(due("p", 1))  # in flight when it died: no retry inside
    with trio.fail_after(5):
        await target.send_batch(due("p", 1))  # next call: a refuses, b takes it
    assert target.address == b.addr and target.connects == 2
    await start(a)
    for n in range(3):  # a is back, but b works: stay on b
        await target.send_batch(due(f"q{n}", 1))
    assert target.address == b.addr and target.connects == 2
    await target.aclose()


# ---------------------------------------------------------------- remote: the protocol


async def test_batch_larger_than_a_frame_is_split_and_a_huge_message_refused(processes):
    process = await start(processes())
    target = RemoteTarget("big", [process.addr], timeout_s=60)
    big = due("r", 4, body_bytes=4 * MiB)  # 16 MiB of bodies: more than one 16 MiB frame
    huge = Message("r-huge", "orders", body=b"x" * (17 * MiB))
    small = due("s", 1)
    results = await target.send_batch([*big, huge, *small])
    assert [r.code for r in results] == [ResultCode.OK] * 4 + [
        ResultCode.BODY_TOO_LARGE,
        ResultCode.OK,
    ]
    assert "at most" in results[4].reason
    offsets = [r.commitlog_offset for r in results if r.code is ResultCode.OK]
    assert offsets == sorted(offsets)  # the halves went in order
    assert target.connects == 1
    await target.aclose()


async def test_many_concurrent_requests_share_one_connection(processes):
    process = await start(processes())
    target = RemoteTarget("busy", [process.addr])
    done: list[int] = []

    async def send(n: int) -> None:
        results = await target.send_batch(due(f"t{n}", 50, body_bytes=2000))
        assert all(r.code is ResultCode.OK for r in results)
        done.append(n)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for n in range(100):
                nursery.start_soon(send, n)
    assert sorted(done) == list(range(100)) and target.connects == 1
    await target.aclose()


async def serve_scripted(stream: trio.SocketStream, answers: list) -> None:
    """A broker that answers the n-th SEND_BATCH of a connection with ``answers[n]``:
    an Error, or a list of results."""
    conn = Connection(SERVER)
    count = 0
    while True:
        event = conn.next_event()
        if event is NEED_DATA:
            conn.receive_data(await stream.receive_some(65536))
        elif isinstance(event, ConnectionClosed):
            return
        elif isinstance(event, Hello):
            hello_ok = HelloOk(conn.protocol_version, request_id=event.request_id)
            await stream.send_all(conn.send(hello_ok))
        else:
            assert isinstance(event, SendBatch)
            answer = answers[count]
            count += 1
            if isinstance(answer, Error):
                answer = Error(answer.code, answer.reason, request_id=event.request_id)
            else:
                answer = SendBatchResult(answer, request_id=event.request_id)
            await stream.send_all(conn.send(answer))


async def test_whole_request_refused_is_unavailable_and_the_connection_kept(nursery):
    answers = [
        Error(ErrorCode.BUSY, "too many requests"),
        [SendResult(ResultCode.OK)],
        [SendResult(ResultCode.OK)],  # one result for two messages
    ]
    handler = functools.partial(serve_scripted, answers=answers)
    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    target = RemoteTarget("scripted", [f"127.0.0.1:{port}"])
    with pytest.raises(TargetUnavailable, match=r"refused the batch: too many requests \(BUSY\)"):
        await target.send_batch(due("u", 1))
    assert [r.code for r in await target.send_batch(due("u", 1))] == [ResultCode.OK]
    assert target.connects == 1  # a refusal is an answer: the connection is fine
    with pytest.raises(TargetUnavailable, match="1 results for 2 messages"):
        await target.send_batch(due("v", 2))
    await target.aclose()


async def test_closed_target():
    target = RemoteTarget("closed", ["127.0.0.1:1"])
    await target.aclose()
    await target.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await target.send_batch(due("w", 1))


@pytest.mark.parametrize(
    ("addresses", "kwargs"),
    [
        ([], {}),
        ("127.0.0.1:20811", {}),  # a string, not a list of addresses
        (["localhost"], {}),
        (["127.0.0.1:0"], {}),
        (["127.0.0.1:70000"], {}),
        (["127.0.0.1:x"], {}),
        (["127.0.0.1:20811"], {"timeout_s": 0}),
        (["127.0.0.1:20811"], {"connect_timeout_s": -1}),
    ],
)
def test_bad_arguments(addresses, kwargs):
    with pytest.raises(ValueError):
        RemoteTarget("bad", addresses, **kwargs)


def test_ipv6_address_form():
    target = RemoteTarget("v6", ["[::1]:20811", "broker.internal:20812"])
    assert target._endpoints == [("::1", 20811), ("broker.internal", 20812)]
