"""Fuzzed frames over real sockets never crash the broker (h11's fuzz/afl-server.py idea).

Two generators, each bounded: random bytes, and valid request frames whose bodies are
mutated and then re-sealed with a correct CRC (so the mutation reaches the body decoder
and the broker's argument checks instead of stopping at the CRC). After every example
the broker process must be alive; at the end a good client must be served.
"""

from __future__ import annotations

import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delayd.protocol import (
    Command,
    CommitOffset,
    Heartbeat,
    Hello,
    JoinGroup,
    Message,
    Pull,
    Query,
    ResultCode,
    SendBatch,
    Stats,
    encode_event,
    encode_frame,
)
from delayd.protocol.frames import HEADER_SIZE
from tests.broker_support import BrokerProcess

pytestmark = pytest.mark.slow

HELLO = encode_event(Hello(client_name="fuzz", request_id=1))
VALID = [
    encode_event(e)
    for e in (
        SendBatch(
            [
                Message("f-1", "orders", key="k", properties={"a": "b"}, body=b"body"),
                Message("f-2", "orders", body=b"x" * 40),
            ],
            request_id=2,
        ),
        Pull("orders", "g", "c", 10, 50, request_id=2),
        CommitOffset("g", "orders", 1, 0, request_id=2),
        JoinGroup("g", "orders", "c", request_id=2),
        Heartbeat("g", "orders", "c", request_id=2),
        Query("orders", message_id="f-1", request_id=2),
        Stats(request_id=2),
    )
]


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    process = BrokerProcess(tmp_path_factory.mktemp("fuzz") / "data").start()
    yield process
    process.close()


def exchange(address: tuple[str, int], data: bytes) -> bytes:
    """Send ``data``, half-close, and read what the broker answers until it closes."""
    with socket.create_connection(address, timeout=5) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return b""  # the broker already closed on an early byte
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        return reply


SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@SETTINGS
@given(st.binary(max_size=300), st.booleans())
def test_random_bytes(broker, data, after_hello):
    exchange(broker.address, (HELLO if after_hello else b"") + data)
    assert broker.alive, broker.log_tail()


@SETTINGS
@given(
    st.sampled_from(VALID),
    st.lists(
        st.tuples(
            st.integers(0, 10_000),
            st.integers(0, 255),
            st.sampled_from(["flip", "set", "flip", "set", "cut"]),
        ),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from([0, 0, 0, 1]),  # mostly the body's own command
)
def test_mutated_frames_with_valid_crc(broker, frame, mutations, command_shift):
    body = bytearray(frame[HEADER_SIZE:])
    for position, value, kind in mutations:
        if not body:
            break
        i = position % len(body)
        if kind == "flip":
            body[i] ^= value or 1
        elif kind == "set":
            body[i] = value
        else:
            del body[i:]
    commands = [c for c in Command if c.is_request and c is not Command.HELLO]
    command = commands[(frame[5] - 2 + command_shift) % len(commands)]
    mutated = encode_frame(command, 2, bytes(body))
    exchange(broker.address, HELLO + mutated)
    assert broker.alive, broker.log_tail()


def test_broker_still_serves_after_fuzzing(broker):
    # Runs after the fuzz tests of this module (pytest keeps file order).
    with broker.client() as c:
        result = c.send_batch([Message("after-fuzz", "orders", body=b"ok")])
        assert result[0].code in (ResultCode.OK, ResultCode.DUPLICATE)
        assert c.stats()["broker.messages_stored_total"] >= 1
    assert broker.alive
