"""HELD_IDS (docs/protocol.md): which ids a delay server holds, read-only, through both
producers against a DelayServer run in process — each id answered with the due time a
send of it would be answered DUPLICATE with (after a reschedule the new one; a
cancelled id is held too), None for an id it does not hold, and nothing stored by
asking; a request the connection's protocol version is too old for is refused before
it is sent."""

from __future__ import annotations

import pytest
import trio

import delayd
from delayd.client import _calls as calls
from delayd.errors import RejectedError
from delayd.protocol import ErrorCode, ResultCode
from delayd.server import DelayServer
from tests.test_intake_path import intake_only


async def test_held_ids_answers_what_a_send_would_and_stores_nothing(tmp_path):
    server = await trio.to_thread.run_sync(DelayServer.open, str(tmp_path), intake_only())
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(server.run)
        address = "{}:{}".format(*bound.intake)
        async with delayd.open_producer(address) as producer:
            sent = await producer.send_batch(
                [{"subject": "orders", "body": b"x", "message_id": f"m{i}", "delay_ms": 60_000}
                 for i in range(3)]
            )  # fmt: skip
            moved = await producer.reschedule("m1", delay_ms=120_000)
            assert (await producer.cancel("m2")).outcome.name == "CANCELLED"
            held = await producer.held(["m0", "m1", "m2", "never"])
            assert held == [sent[0].due_ms, moved.at_ms, sent[2].due_ms, None]
            with pytest.raises(ValueError, match="empty"):
                await producer.held([""])
            again = await producer.send_batch(
                [{"subject": "orders", "body": b"y", "message_id": i} for i in ("m0", "m1", "new")]
            )
            assert [r.code for r in again] == [ResultCode.DUPLICATE] * 2 + [ResultCode.OK]
            assert [r.due_ms for r in again[:2]] == held[:2]

        def blocking() -> list[int | None]:
            with delayd.Producer(address) as blocking_producer:
                return blocking_producer.held(["new", "m0", "never"])

        assert await trio.to_thread.run_sync(blocking) == [again[2].due_ms, held[0], None]
        accepted = server.intake.receiver.accepted_total
        server.request_stop()
    assert accepted == 4  # m0, m1, m2 and new: asking stored nothing


def test_a_request_newer_than_the_connection_is_refused_before_it_is_sent():
    (call,) = calls.held_batches(["m0"])
    call.check_version(3, "10.0.0.9:20801")
    with pytest.raises(RejectedError, match=r"10.0.0.9:20801 speaks protocol version 2.*upgrade"):
        call.check_version(2, "10.0.0.9:20801")
    with pytest.raises(RejectedError) as refused:
        call.check_version(1, "h:1")
    assert refused.value.code is ErrorCode.UNSUPPORTED
