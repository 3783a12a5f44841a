"""CANCEL_BATCH on the wire (docs/protocol.md): round trips through a client and a
server Connection, every malformed body refused as a protocol error, never a crash."""

from __future__ import annotations

import pytest

from delayd.errors import LocalProtocolError, RemoteProtocolError
from delayd.protocol import (
    CLIENT,
    NEED_DATA,
    PROTOCOL_VERSION,
    SERVER,
    CancelBatch,
    CancelBatchResult,
    CancelOutcome,
    Connection,
    Hello,
    HelloOk,
)
from delayd.protocol.bodies import decode_event, encode_event
from delayd.protocol.codes import Command
from delayd.protocol.frames import HEADER_SIZE


def connected() -> tuple[Connection, Connection]:
    client, server = Connection(CLIENT), Connection(SERVER)
    server.receive_data(client.send(Hello(request_id=1)))
    server.next_event()
    client.receive_data(server.send(HelloOk(PROTOCOL_VERSION, "test", request_id=1)))
    client.next_event()
    return client, server


def test_cancel_batch_round_trip():
    client, server = connected()
    ids = ("a", "é-2", "x" * 300)
    server.receive_data(client.send(CancelBatch(ids, request_id=2)))
    request = server.next_event()
    assert request == CancelBatch(ids, request_id=2)
    assert server.next_event() is NEED_DATA
    results = (
        (CancelOutcome.CANCELLED, None),
        (CancelOutcome.ALREADY_DELIVERED, 1_795_341_600_123),
        (CancelOutcome.UNKNOWN, None),
    )
    client.receive_data(server.send(CancelBatchResult(results, request_id=2)))
    assert client.next_event() == CancelBatchResult(results, request_id=2)


def test_an_empty_cancel_batch_round_trips():
    client, server = connected()
    server.receive_data(client.send(CancelBatch((), request_id=2)))
    assert server.next_event() == CancelBatch((), request_id=2)


def body(event) -> bytes:
    return encode_event(event)[HEADER_SIZE:]


@pytest.mark.parametrize(
    "data",
    [
        b"\x02\x00\x01\x00a",  # two ids announced, one present
        b"\x01\x00\x05\x00ab",  # an id shorter than its length
        b"\x01\x00\x01\x00\xff",  # not UTF-8
        b"\x00\x00\x00",  # a byte after the end
    ],
)
def test_malformed_cancel_batches_are_protocol_errors(data):
    with pytest.raises(RemoteProtocolError):
        decode_event(Command.CANCEL_BATCH, 0, 2, data)


@pytest.mark.parametrize(
    "data",
    [
        b"\x01\x00\x07\x00",  # an unknown outcome
        b"\x01\x00\x01\x02",  # a presence byte other than 0 or 1
        b"\x02\x00\x00\x00",  # two results announced, one present
    ],
)
def test_malformed_cancel_batch_results_are_protocol_errors(data):
    with pytest.raises(RemoteProtocolError):
        decode_event(Command.CANCEL_BATCH_RESULT, 0, 2, data)


def test_a_cancel_batch_over_the_u16_count_is_refused_locally():
    with pytest.raises(LocalProtocolError, match="at most 65535"):
        encode_event(CancelBatch(("a",) * 65_536, request_id=2))
    assert body(CancelBatch(("ab",), request_id=2)) == b"\x01\x00\x02\x00ab"
