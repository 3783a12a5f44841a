"""delayd.protocol: round trips of every event, the HELLO/token rule, the connection
state machine, and one test per way a frame can be malformed (STYLE.md #3)."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import pathlib
import struct
import subprocess
import sys
import timeit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import delayd.protocol as p
from delayd.errors import (
    ConnectionClosedError,
    DelaydError,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from delayd.protocol import (
    CLIENT,
    NEED_DATA,
    SERVER,
    Command,
    Connection,
    ConnectionClosed,
    Error,
    ErrorCode,
    Hello,
    HelloOk,
    Message,
    ResultCode,
    State,
)
from delayd.protocol.bodies import decode_event, encode_event
from delayd.protocol.frames import HEADER_PREFIX

ROOT = pathlib.Path(__file__).resolve().parent.parent

# --- strategies -----------------------------------------------------------------------

# Any Unicode that UTF-8 can carry (lone surrogates cannot be encoded, by design).
text = st.text(st.characters(codec="utf-8"), max_size=12)
i64 = st.integers(-(2**63), 2**63 - 1)
u64 = st.integers(0, 2**64 - 1)
u32 = st.integers(0, 2**32 - 1)
u16 = st.integers(0, 2**16 - 1)
request_ids = st.integers(1, 2**64 - 1)
bodies = st.one_of(
    st.binary(max_size=64),
    # A large body, cheaply: hypothesis generating 300 KB byte by byte would be slow.
    st.builds(lambda n, b: bytes([b]) * n, st.integers(60_000, 300_000), st.integers(0, 255)),
)


def optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.none() | strategy


def optional_ints(table: tuple) -> dict[str, st.SearchStrategy]:
    """Each optional integer of a layout's (bit, name, struct) table, in its range."""
    ranges = {"q": i64, "Q": u64, "I": u32}
    return {name: optional(ranges[fmt.format[-1]]) for _, name, fmt in table}


messages = st.builds(
    Message,
    message_id=text.filter(bool),
    subject=text,
    key=optional(text),
    properties=st.dictionaries(text, text, max_size=4),
    body=bodies,
    **optional_ints(p.message_layout.MSG_INTS),
)
message_lists = st.lists(messages, max_size=5).map(tuple)
send_results = st.builds(
    p.SendResult,
    code=st.sampled_from(ResultCode),
    reason=text,
    **optional_ints(p.bodies.RES_INTS),
)
stat_values = st.one_of(text, i64, st.floats(allow_nan=False))
queues = st.lists(u32, max_size=8).map(tuple)

requests = st.one_of(
    st.builds(Hello, token=optional(text), client_name=text, min_version=u16, max_version=u16),
    st.builds(p.SendBatch, message_lists),
    st.builds(p.Pull, text, text, text, u32, u32),
    st.builds(p.CommitOffset, text, text, u32, u64),
    st.builds(p.JoinGroup, text, text, text, st.none() | queues),
    st.builds(p.Heartbeat, text, text, text, st.none() | queues),
    st.builds(p.Query, text, message_id=text),
    st.builds(p.Query, text, key=text),
    st.builds(p.Stats),
    st.builds(p.Cancel, text),
    st.builds(p.HeldIds, st.lists(text, max_size=5).map(tuple)),
    st.builds(p.Reschedule, text, i64),
)
responses = st.one_of(
    st.builds(HelloOk, u16, text, u64),
    st.builds(p.SendBatchResult, st.lists(send_results, max_size=5).map(tuple)),
    st.builds(p.PullResult, message_lists),
    st.builds(p.CommitOffsetOk),
    st.builds(p.JoinGroupResult, queues),
    st.builds(p.HeartbeatResult, queues),
    st.builds(p.QueryResult, message_lists),
    st.builds(p.StatsResult, st.dictionaries(text, stat_values, max_size=5)),
    st.builds(p.CancelResult, st.sampled_from(p.CancelOutcome), optional(i64)),
    st.builds(p.HeldIdsResult, st.lists(optional(i64), max_size=5).map(tuple)),
    st.builds(p.RescheduleResult, st.sampled_from(p.RescheduleOutcome), optional(i64)),
    st.builds(Error, st.sampled_from(ErrorCode), text, st.booleans()),
)


def with_id(event_strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.builds(
        lambda e, rid: dataclasses.replace(e, request_id=rid), event_strategy, request_ids
    )


events = with_id(requests | responses)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def decode_all(chunks: list[bytes], max_frame_size: int = 2**32) -> list[p.Event]:
    decoder = p.FrameDecoder(max_frame_size)
    out = []
    for chunk in chunks:
        decoder.feed(chunk)
        while (frame := decoder.next_frame()) is not None:
            out.append(decode_event(frame.command, frame.flags, frame.request_id, frame.body))
    assert decoder.buffered == 0
    return out


def drain(conn: Connection) -> list[p.Event]:
    out = []
    while (event := conn.next_event()) is not NEED_DATA:
        out.append(event)
        if isinstance(event, ConnectionClosed):
            break
    return out


def connected(token: str | None = None, **server_kw) -> tuple[Connection, Connection]:
    """A client and a server after a successful HELLO exchange."""
    client, server = Connection(CLIENT), Connection(SERVER, token=token, **server_kw)
    hello = Hello(token=token, client_name="test", request_id=client.next_request_id())
    server.receive_data(client.send(hello))
    assert drain(server) == [hello]
    ok = HelloOk(server.protocol_version, "srv", server.max_frame_size, request_id=1)
    client.receive_data(server.send(ok))
    assert drain(client) == [ok]
    assert client.state is server.state is State.READY
    return client, server


def raw_request(event: p.Event) -> bytes:
    """A frame for ``event`` without any connection state check (for hostile peers)."""
    return encode_event(event)


SAMPLE_MESSAGE = Message("m-1", "orders.timeout", "order-42", {"a": "b"}, b"payload", delay_ms=5)


# --- round trips ----------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(event=events, cuts=st.lists(st.integers(0, 2**20), max_size=8))
def test_every_event_round_trips_whole_and_in_random_splits(event, cuts):
    data = encode_event(event)
    assert decode_all([data]) == [event]
    assert decode_all(split(data, cuts)) == [event]


@settings(max_examples=40, deadline=None)
@given(event=with_id(requests | responses).filter(lambda e: len(encode_event(e)) < 4000))
def test_every_event_round_trips_one_byte_at_a_time(event):
    data = encode_event(event)
    assert decode_all([data[i : i + 1] for i in range(len(data))]) == [event]


@settings(max_examples=100, deadline=None)
@given(batch=message_lists, results=st.lists(send_results, max_size=5), cuts=st.lists(u32))
def test_send_batch_through_connections_in_random_splits(batch, results, cuts):
    client, server = connected(token="s3cret")
    request = p.SendBatch(batch, request_id=client.next_request_id())
    for chunk in split(client.send(request), cuts):
        server.receive_data(chunk)
    assert drain(server) == [request]
    response = p.SendBatchResult(results, request_id=request.request_id)
    for chunk in split(server.send(response), cuts):
        client.receive_data(chunk)
    assert drain(client) == [response]
    assert client.outstanding == server.outstanding == {}


def test_each_request_kind_is_answered_through_connections():
    pairs = [
        (p.SendBatch([SAMPLE_MESSAGE]), p.SendBatchResult([p.SendResult(ResultCode.OK)])),
        (p.Pull("orders", "g", "c1", 10, 500), p.PullResult([SAMPLE_MESSAGE])),
        (p.CommitOffset("g", "orders", 3, 99), p.CommitOffsetOk()),
        (p.JoinGroup("g", "orders", "c1"), p.JoinGroupResult([0, 1])),
        (p.Heartbeat("g", "orders", "c1"), p.HeartbeatResult([1])),
        (p.Query("orders", key="order-42"), p.QueryResult([])),
        (p.Stats(), p.StatsResult({"wheel.loaded": 3, "lag_s": 0.5, "role": "delay"})),
        (p.Cancel("m-1"), p.CancelResult(p.CancelOutcome.ALREADY_DELIVERED, 1234)),
        (p.Reschedule("m-1", 99), p.RescheduleResult(p.RescheduleOutcome.RESCHEDULED)),
        (p.Stats(), Error(ErrorCode.BUSY, "try later")),
    ]
    client, server = connected()
    for request, response in pairs:
        request = dataclasses.replace(request, request_id=client.next_request_id())
        response = dataclasses.replace(response, request_id=request.request_id)
        server.receive_data(client.send(request))
        assert drain(server) == [request]
        client.receive_data(server.send(response))
        assert drain(client) == [response]
    assert client.state is server.state is State.READY


def test_pipelined_requests_in_one_write_and_answers_out_of_order():
    client = Connection(CLIENT)
    server = Connection(SERVER)
    first = Hello(request_id=client.next_request_id())
    reqs = [p.Pull("s", "g", "c", request_id=client.next_request_id()) for _ in range(50)]
    server.receive_data(client.send(first) + b"".join(client.send(r) for r in reqs))
    assert drain(server) == [first, *reqs]
    wire = server.send(HelloOk(p.PROTOCOL_VERSION, request_id=first.request_id))
    for r in reversed(reqs):
        wire += server.send(p.PullResult([], request_id=r.request_id))
    client.receive_data(wire)
    assert len(drain(client)) == 51
    assert client.outstanding == {}


def test_many_small_frames_fed_in_odd_chunks():
    data = b"".join(encode_event(p.Stats(request_id=i + 1)) for i in range(2000))
    for size in (len(data), 1009, 37):
        chunks = [data[i : i + size] for i in range(0, len(data), size)]
        assert [e.request_id for e in decode_all(chunks)] == list(range(1, 2001))


def test_decoded_messages_are_ordinary_messages():
    # The decoder builds Message without __init__ (message_layout._MessageBuilder); the result must
    # be indistinguishable from one built normally.
    (decoded,) = decode_all([encode_event(p.SendBatch([SAMPLE_MESSAGE], request_id=1))])[0].messages
    assert decoded == SAMPLE_MESSAGE
    assert repr(decoded) == repr(SAMPLE_MESSAGE)
    assert dataclasses.replace(decoded, body=b"x").body == b"x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        decoded.body = b"y"  # type: ignore[misc]


def test_decoded_send_results_are_ordinary_send_results():
    # The common result (stored, no reason) is decoded by a one-struct fast path.
    result = p.SendResult(ResultCode.DUPLICATE, "", 1, 2, 3, 4)
    frame = encode_event(p.SendBatchResult([result], request_id=1))
    (decoded,) = decode_all([frame])[0].results
    assert decoded == result and repr(decoded) == repr(result)
    assert decoded.code is ResultCode.DUPLICATE
    assert p.bodies.new_send_result(ResultCode.OK, "", 1, 2, 3, 4, 5) == p.SendResult(
        ResultCode.OK, "", 1, 2, 3, 4, 5
    )


def test_the_delay_servers_results_take_their_own_fast_path_both_ways():
    # Accepted by a delay server: the sequence in queue_offset and due_ms, nothing else.
    results = [p.SendResult(ResultCode.OK, "", None, None, None, 7, 1_700_000_000_000)]
    results.append(p.SendResult(ResultCode.DUPLICATE, "", None, None, None, 2**64 - 1, -5))
    results.append(p.SendResult(ResultCode.OK, "", None, None, None, 8, None))  # general path
    frame = encode_event(p.SendBatchResult(results, request_id=1))
    # code, mask (queue_offset | due_ms), reason length 0, queue_offset u64, due_ms i64
    assert struct.pack("<BBHQq", ResultCode.DUPLICATE, 0x18, 0, 2**64 - 1, -5) in frame
    decoded = decode_all([frame])[0].results
    assert list(decoded) == results and repr(decoded[0]) == repr(results[0])


# What a producer sends: no key, no properties, at most a delay or a time.
plain_messages = st.builds(
    Message,
    message_id=text.filter(bool),
    subject=text,
    body=st.binary(max_size=64),
    at_ms=optional(i64),
    delay_ms=optional(i64),
)


@settings(max_examples=100, deadline=None)
@given(batch=st.lists(plain_messages | messages, max_size=8))
def test_a_batch_encodes_as_each_message_encodes_alone(batch):
    # put_messages writes plain messages by a fast path of its own; the bytes must be
    # those of the general encoder, also with other messages between them.
    out = bytearray()
    p.message_layout.put_messages(out, tuple(batch))
    encoded = [p.message_layout.encode_message(m) for m in batch]
    assert bytes(out) == struct.pack("<I", len(batch)) + b"".join(encoded)


def test_a_plain_message_the_wire_cannot_carry_is_still_refused():
    too_long = Message("x" * 65_536, "orders", delay_ms=5)
    with pytest.raises(LocalProtocolError, match="message_id is 65536"):
        encode_event(p.SendBatch([SAMPLE_MESSAGE, too_long], request_id=1))
    with pytest.raises(LocalProtocolError, match="cannot encode SendBatch"):
        encode_event(p.SendBatch([Message("m", "orders", delay_ms=2**63)], request_id=1))


def test_a_delay_servers_whole_answer_is_decoded_in_one_pass_or_not_at_all():
    scheduled = [p.SendResult(ResultCode.OK, "", None, None, None, n, 1_700 + n) for n in range(3)]
    frame = encode_event(p.SendBatchResult(scheduled, request_id=1))
    assert list(decode_all([frame])[0].results) == scheduled
    # A refusal whose reason makes it as long as a scheduled result: the same body size,
    # so the one-pass decoder must see it is not one and leave it to the general path.
    refused = p.SendResult(ResultCode.INVALID_SUBJECT, "x" * 16)
    mixed = [refused, scheduled[0]]
    frame = encode_event(p.SendBatchResult(mixed, request_id=1))
    assert len(frame) == len(encode_event(p.SendBatchResult(scheduled[:2], request_id=1)))
    assert list(decode_all([frame])[0].results) == mixed


@settings(max_examples=100, deadline=None)
@given(batch=message_lists.filter(bool), store_ms=i64, data=st.data())
def test_stamp_messages_is_stamp_message_of_each(batch, store_ms, data):
    (decoded,) = decode_all([encode_event(p.SendBatch(batch, request_id=1))])
    spans = decoded.encoded
    indices = sorted(data.draw(st.sets(st.integers(0, len(batch) - 1))))
    queues = [data.draw(u32) for _ in indices]
    offsets = [data.draw(u64) for _ in indices]
    stamped = p.message_layout.stamp_messages(
        spans.data, spans.bounds, indices, store_ms, queues, offsets
    )
    assert stamped == [
        p.message_layout.stamp_message(
            spans.data, spans.bounds[i], spans.bounds[i + 1], store_ms, q, o
        )
        for i, q, o in zip(indices, queues, offsets, strict=True)
    ]


def test_stamp_messages_of_a_delay_servers_deliveries():
    # Only due_ms and dispatched_ms set (or one of them), with and without a key: the
    # broker's inlined path for what the delay server's sender sends.
    batch = tuple(
        Message(f"id-{i}", "orders", key, {}, b"body" * i, due_ms=due, dispatched_ms=sent)
        for i, (key, due, sent) in enumerate(
            [(None, 5, 7), ("k", -1, 2**62), (None, 5, None), ("", None, 9), ("k", 1, 2)]
        )
    )
    (decoded,) = decode_all([encode_event(p.SendBatch(batch, request_id=1))])
    spans = decoded.encoded
    indices = list(range(len(batch)))
    queues, offsets = [3] * len(batch), [10 + i for i in indices]
    stamped = p.message_layout.stamp_messages(
        spans.data, spans.bounds, indices, 99, queues, offsets
    )
    for i, record in enumerate(stamped):
        stored = p.message_layout.decode_message(record)
        assert (stored.store_ms, stored.queue, stored.queue_offset) == (99, 3, 10 + i)
        assert (stored.due_ms, stored.dispatched_ms, stored.key) == (
            batch[i].due_ms,
            batch[i].dispatched_ms,
            batch[i].key,
        )
        assert record == p.message_layout.stamp_message(
            spans.data, spans.bounds[i], spans.bounds[i + 1], 99, 3, 10 + i
        )


# --- message bytes: what the broker stores and delivers without re-encoding -----------


@settings(max_examples=200, deadline=None)
@given(batch=message_lists.filter(bool), request_id=request_ids)
def test_decoded_send_batch_keeps_each_message_span(batch, request_id):
    (decoded,) = decode_all([encode_event(p.SendBatch(batch, request_id=request_id))])
    spans = decoded.encoded
    assert len(spans) == len(batch)
    for i, message in enumerate(batch):
        start, end = spans.bounds[i], spans.bounds[i + 1]
        assert spans.data[start:end] == p.message_layout.encode_message(message)
        assert p.message_layout.decode_message(spans.data, start, end) == message
    # Senders never see it: it takes no part in comparisons or repr, and encoding
    # ignores it.
    assert decoded == p.SendBatch(batch, request_id=request_id)
    # (not a search for the word: a generated subject may well be "encoded")
    assert repr(decoded) == repr(p.SendBatch(batch, request_id=request_id))


@settings(max_examples=300, deadline=None)
@given(message=messages, store_ms=i64, queue=u32, queue_offset=u64, offset=u64)
def test_stamped_and_delivered_bytes_equal_encoding_the_message(
    message, store_ms, queue, queue_offset, offset
):
    layout = p.message_layout
    data = b"junk" + layout.encode_message(message) + b"more"
    stored = dataclasses.replace(
        message,
        at_ms=None,
        delay_ms=None,
        store_ms=store_ms,
        commitlog_offset=None,
        queue=queue,
        queue_offset=queue_offset,
    )
    record = layout.stamp_message(data, 4, len(data) - 4, store_ms, queue, queue_offset)
    assert record == layout.encode_message(stored)
    delivered = dataclasses.replace(stored, commitlog_offset=offset)
    assert layout.with_commitlog_offset(record, offset) == layout.encode_message(delivered)
    assert layout.with_commitlog_offset(layout.encode_message(delivered), 7) == (
        layout.encode_message(dataclasses.replace(delivered, commitlog_offset=7))
    )
    ints = tuple(getattr(message, attr) for _, attr, _ in layout.MSG_INTS)
    assert layout.message_ints(layout.encode_message(message)) == ints


@given(batch=message_lists)
def test_read_heads_agree_with_the_decoder(batch):
    layout = p.message_layout
    encoded = p.EncodedMessages.join([layout.encode_message(m) for m in batch])
    heads = layout.read_heads(encoded.data, encoded.bounds)
    for m, (mask, message_id, subject, key, count, body_len, due_ms) in zip(
        batch, heads, strict=True
    ):
        assert (message_id, subject) == (m.message_id.encode(), m.subject.encode())
        assert key == (None if m.key is None else m.key.encode())
        assert (count, body_len, due_ms) == (len(m.properties), len(m.body), m.due_ms)
        assert bool(mask & layout.MSG_AT_MS) == (m.at_ms is not None)


def test_read_heads_refuse_a_span_too_short_for_what_its_head_announces():
    layout = p.message_layout
    data = layout.encode_message(Message("m", "subject", due_ms=5))
    with pytest.raises(ValueError, match="head"):
        layout.read_heads(data, (0, 5))
    with pytest.raises(ValueError, match="due_ms"):
        layout.read_heads(data, (0, len(data) - 8))
    plain = layout.encode_message(Message("m", "subject"))
    with pytest.raises(ValueError, match="more bytes"):
        layout.read_heads(plain, (0, len(plain) - 1))


@given(message=messages, dispatched_ms=i64)
def test_delivered_head_and_tail_make_the_encoding(message, dispatched_ms):
    layout = p.message_layout
    due_ms = message.due_ms or 0
    plain = Message(message.message_id, message.subject, message.key, body=message.body)
    m = dataclasses.replace(plain, due_ms=due_ms, dispatched_ms=dispatched_ms)
    key = None if m.key is None else m.key.encode()
    texts = m.message_id.encode() + m.subject.encode() + (key or b"")
    head = layout.delivered_head(
        len(m.message_id.encode()),
        len(m.subject.encode()),
        None if key is None else len(key),
        len(m.body),
    )
    tail = layout.DELIVERED_TAIL.pack(due_ms, dispatched_ms)
    assert head + texts + m.body + tail == layout.encode_message(m)


def test_message_ints_refuses_a_message_too_short_for_its_integers():
    data = p.message_layout.encode_message(Message("m", "s", store_ms=5))
    with pytest.raises(ValueError, match="too short"):
        p.message_layout.message_ints(data[:-1])
    with pytest.raises(ValueError, match="head"):
        p.message_layout.message_ints(data[:5])
    with pytest.raises(RemoteProtocolError, match="trailing"):
        p.message_layout.decode_message(data + b"x")


@settings(max_examples=100, deadline=None)
@given(batch=message_lists, request_id=request_ids)
def test_pull_result_from_encoded_messages_is_the_same_frame(batch, request_id):
    parts = [p.message_layout.encode_message(m) for m in batch]
    encoded = p.EncodedMessages.join(parts)
    assert len(encoded) == len(batch)
    for kind in (p.PullResult, p.QueryResult):
        frame = encode_event(kind(encoded=encoded, request_id=request_id))
        assert frame == encode_event(kind(batch, request_id=request_id))
        assert decode_all([frame]) == [kind(batch, request_id=request_id)]


def test_pull_result_with_both_messages_and_encoded_is_refused():
    encoded = p.EncodedMessages.join([p.message_layout.encode_message(SAMPLE_MESSAGE)])
    event = p.PullResult([SAMPLE_MESSAGE], encoded=encoded, request_id=1)
    with pytest.raises(LocalProtocolError, match="both"):
        encode_event(event)


def test_lists_are_frozen_into_tuples():
    batch = p.SendBatch([SAMPLE_MESSAGE], request_id=1)
    assert batch.messages == (SAMPLE_MESSAGE,)
    assert p.JoinGroupResult([1, 2]).queues == (1, 2)


def test_close_flag_travels_only_on_error():
    data = encode_event(Error(ErrorCode.INTERNAL, "disk", close=True, request_id=7))
    assert struct.unpack_from("<H", data, 6)[0] == p.FLAG_CLOSE
    assert decode_all([data]) == [Error(ErrorCode.INTERNAL, "disk", close=True, request_id=7)]
    body = encode_event(p.Stats(request_id=1))[p.HEADER_SIZE :]
    with pytest.raises(RemoteProtocolError, match="only allowed on ERROR"):
        decode_all([p.encode_frame(Command.STATS, 1, body, flags=p.FLAG_CLOSE)])


# --- HELLO and the token --------------------------------------------------------------


def reject_hello(server: Connection, hello: Hello) -> RemoteProtocolError:
    server.receive_data(raw_request(hello))
    with pytest.raises(RemoteProtocolError) as info:
        server.next_event()
    assert server.state is State.ERROR
    return info.value


@pytest.mark.parametrize("token", [None, "", "wrong", "s3cre", "s3cret!", "S3CRET"])
def test_server_with_token_rejects_missing_or_wrong_token(token):
    exc = reject_hello(Connection(SERVER, token="s3cret"), Hello(token=token, request_id=1))
    assert exc.code == ErrorCode.UNAUTHORIZED
    assert exc.request_id == 1
    assert "s3cret" not in str(exc)  # the reason must not leak the expected token


def test_server_with_token_accepts_the_right_one_even_non_ascii():
    # hmac.compare_digest refuses non-ASCII str; the connection compares UTF-8 bytes.
    _, server = connected(token="pässwörd-🔑")
    assert server.protocol_version == p.PROTOCOL_VERSION


def test_server_without_token_accepts_any_hello():
    for token in (None, "whatever"):
        server = Connection(SERVER)
        server.receive_data(raw_request(Hello(token=token, request_id=1)))
        assert isinstance(server.next_event(), Hello)
        assert server.state is State.READY


@pytest.mark.parametrize(
    "command",
    [
        p.SendBatch([SAMPLE_MESSAGE]),
        p.Pull("s", "g", "c"),
        p.Stats(),
        p.Cancel("m"),
        p.CommitOffset("g", "s", 0, 0),
    ],
)
def test_any_command_before_hello_is_rejected_and_closes(command):
    server = Connection(SERVER, token="s3cret")
    # The hostile client pipelines a correct HELLO behind the command: too late.
    server.receive_data(
        raw_request(dataclasses.replace(command, request_id=5))
        + raw_request(Hello(token="s3cret", request_id=6))
    )
    with pytest.raises(RemoteProtocolError) as info:
        server.next_event()
    assert info.value.code == ErrorCode.HELLO_REQUIRED
    assert info.value.request_id == 5
    with pytest.raises(RemoteProtocolError):
        server.next_event()  # still refusing, the HELLO behind it is never parsed
    answer = server.send(Error.for_exception(info.value))
    assert server.state is State.CLOSED
    with pytest.raises(ConnectionClosedError):
        server.next_event()
    with pytest.raises(ConnectionClosedError):
        server.send(Error(ErrorCode.INTERNAL, "again", close=True))
    assert decode_all([answer]) == [
        Error(ErrorCode.HELLO_REQUIRED, str(info.value), close=True, request_id=5)
    ]


def test_rejected_hello_reaches_the_client_as_a_closing_error():
    client, server = Connection(CLIENT), Connection(SERVER, token="right")
    server.receive_data(client.send(Hello(token="wrong", request_id=client.next_request_id())))
    with pytest.raises(RemoteProtocolError) as info:
        server.next_event()
    client.receive_data(server.send(Error.for_exception(info.value)))
    (error,) = drain(client)
    assert (error.code, error.close, error.request_id) == (ErrorCode.UNAUTHORIZED, True, 1)
    assert client.state is State.CLOSED
    with pytest.raises(ConnectionClosedError):
        client.send(p.Stats(request_id=client.next_request_id()))
    client.receive_data(b"")
    assert drain(client) == [ConnectionClosed()]


@pytest.mark.parametrize("versions", [(4, 5), (0, 0), (3, 1), (4, 4)])
def test_hello_without_a_common_version_is_rejected(versions):
    low, high = versions
    exc = reject_hello(Connection(SERVER), Hello(min_version=low, max_version=high, request_id=1))
    assert exc.code == ErrorCode.UNSUPPORTED_VERSION
    assert f"{low}..{high}" in str(exc)


def test_hello_negotiates_the_highest_common_version():
    server = Connection(SERVER)
    server.receive_data(raw_request(Hello(min_version=0, max_version=9, request_id=1)))
    server.next_event()
    assert server.protocol_version == p.PROTOCOL_VERSION
    with pytest.raises(LocalProtocolError, match="negotiated"):
        server.send(HelloOk(p.PROTOCOL_VERSION + 1, request_id=1))


def test_client_refuses_a_version_it_did_not_offer():
    client = Connection(CLIENT)
    client.send(Hello(request_id=1))
    client.receive_data(encode_event(HelloOk(p.PROTOCOL_VERSION + 1, request_id=1)))
    with pytest.raises(RemoteProtocolError, match="picked protocol version"):
        client.next_event()


def test_second_hello_is_refused_both_ways():
    client, server = connected()
    with pytest.raises(LocalProtocolError, match="already sent"):
        client.send(Hello(request_id=client.next_request_id()))
    server.receive_data(raw_request(Hello(request_id=9)))
    with pytest.raises(RemoteProtocolError, match="second HELLO"):
        server.next_event()


def test_token_is_never_in_repr():
    assert "s3cret" not in repr(Hello(token="s3cret", request_id=1))
    with pytest.raises(ValueError, match="Hello"):
        Connection(CLIENT, token="s3cret")


def test_pre_hello_frames_are_small():
    server = Connection(SERVER, token="t")
    big = Hello(token="t", client_name="x" * 60_000, request_id=1)
    server.receive_data(raw_request(big)[: p.HEADER_SIZE])  # header alone is enough
    assert len(raw_request(big)) < p.PRE_HELLO_MAX_FRAME_SIZE
    assert server.next_event() is NEED_DATA
    server = Connection(SERVER, token="t")
    batch = p.SendBatch([Message("m", "s", body=bytes(70_000))], request_id=1)
    server.receive_data(raw_request(batch)[: p.HEADER_SIZE])
    with pytest.raises(RemoteProtocolError) as info:
        server.next_event()
    assert info.value.code == ErrorCode.FRAME_TOO_LARGE


# --- the state machine ----------------------------------------------------------------


def test_client_must_start_with_hello_and_use_fresh_request_ids():
    client = Connection(CLIENT)
    assert client.state is State.AWAIT_HELLO
    with pytest.raises(LocalProtocolError, match="before HELLO"):
        client.send(p.Stats(request_id=1))
    assert client.state is State.AWAIT_HELLO  # a refused send changes nothing
    with pytest.raises(LocalProtocolError, match="next_request_id"):
        client.send(Hello())
    client.send(Hello(request_id=client.next_request_id()))
    with pytest.raises(LocalProtocolError, match="reuses"):
        client.send(p.Stats(request_id=1))
    assert client.next_request_id() == 2
    with pytest.raises(LocalProtocolError, match="only a server sends"):
        client.send(p.CommitOffsetOk(request_id=3))


def test_server_answers_only_outstanding_requests_with_the_right_kind():
    client, server = connected()
    with pytest.raises(LocalProtocolError, match="not waiting"):
        server.send(p.PullResult([], request_id=42))
    with pytest.raises(LocalProtocolError, match="only a client sends"):
        server.send(p.Stats(request_id=1))
    with pytest.raises(LocalProtocolError, match="only a client assigns"):
        server.next_request_id()
    server.receive_data(client.send(p.Stats(request_id=client.next_request_id())))
    (stats,) = drain(server)
    with pytest.raises(LocalProtocolError, match="cannot answer"):
        server.send(p.PullResult([], request_id=stats.request_id))
    server.send(Error(ErrorCode.UNSUPPORTED, "no stats here", request_id=stats.request_id))
    assert server.outstanding == {}
    server.send(Error(ErrorCode.SHUTTING_DOWN, "bye", request_id=0))  # connection-wide
    assert server.state is State.READY


def test_client_refuses_unexpected_answers():
    for bad in (
        p.CommitOffsetOk(request_id=77),  # not outstanding
        p.PullResult([], request_id=1),  # outstanding, but it was a Stats
        p.Stats(request_id=1),  # a request, from the server
        Error(ErrorCode.BUSY, "x", request_id=77),
    ):
        client = Connection(CLIENT)
        client.send(Hello(request_id=1))
        client.receive_data(encode_event(bad))
        with pytest.raises(RemoteProtocolError):
            client.next_event()
        assert client.state is State.ERROR


def test_server_refuses_request_id_zero_and_reused_ids():
    _, server = connected()
    server.receive_data(raw_request(p.Stats(request_id=0)))
    with pytest.raises(RemoteProtocolError, match="reserved"):
        server.next_event()
    _, server = connected()
    server.receive_data(raw_request(p.Stats(request_id=5)) * 2)
    server.next_event()
    with pytest.raises(RemoteProtocolError, match="reuses request id 5"):
        server.next_event()


def test_after_a_protocol_error_only_a_closing_error_may_be_sent():
    _, server = connected()
    server.receive_data(b"DLYD\x09" + bytes(30))
    with pytest.raises(RemoteProtocolError) as info:
        server.next_event()
    assert info.value.code == ErrorCode.UNSUPPORTED_VERSION
    with pytest.raises(RemoteProtocolError, match="already broke"):
        server.next_event()
    server.receive_data(b"more bytes are ignored")
    with pytest.raises(LocalProtocolError, match="closing Error"):
        server.send(Error(ErrorCode.MALFORMED, "x"))
    server.send(Error.for_exception(info.value))
    assert server.state is State.CLOSED


def test_eof_between_frames_and_in_the_middle_of_one():
    client, server = connected()
    server.receive_data(b"")
    assert drain(server) == [ConnectionClosed()]
    assert server.next_event() == ConnectionClosed()
    assert server.state is State.CLOSED
    with pytest.raises(ConnectionClosedError):
        server.send(Error(ErrorCode.INTERNAL, "gone"))
    with pytest.raises(LocalProtocolError, match="after EOF"):
        server.receive_data(b"x")

    client, server = connected()
    server.receive_data(client.send(p.Stats(request_id=client.next_request_id()))[:-1])
    server.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="middle of a frame"):
        server.next_event()


def test_send_refuses_frames_larger_than_the_peer_accepts():
    client, _ = connected(max_frame_size=4096)
    assert client.peer_max_frame_size == 4096
    big = p.SendBatch([Message("m", "s", body=bytes(5000))], request_id=client.next_request_id())
    with pytest.raises(LocalProtocolError, match="at most 4096"):
        client.send(big)
    assert client.outstanding == {}
    client.send(p.SendBatch([Message("m", "s", body=bytes(100))], request_id=big.request_id))


@pytest.mark.parametrize(
    "event, problem",
    [
        (p.Cancel("x" * 70_000), "at most 65535"),
        (p.Cancel("\ud800"), "cannot encode"),
        (p.CommitOffset("g", "s", 2**32, 0), "cannot encode"),
        (p.Reschedule("m", 2**63), "cannot encode"),
        (p.Query("s"), "exactly one"),
        (p.Query("s", message_id="a", key="b"), "exactly one"),
        (p.SendBatch([Message("m", "s", properties={"k": "v" * 70_000})]), "property value"),
        (p.SendBatch([Message("m", "s", queue=-1)]), "cannot encode"),
    ],
)
def test_unencodable_events_are_local_protocol_errors(event, problem):
    client, _ = connected()
    with pytest.raises(LocalProtocolError, match=problem):
        client.send(dataclasses.replace(event, request_id=client.next_request_id()))
    assert client.state is State.READY and client.outstanding == {}


def test_stats_values_must_be_str_int_or_float():
    with pytest.raises(LocalProtocolError, match="only str, int and float"):
        encode_event(p.StatsResult({"a": [1]}, request_id=1))  # type: ignore[dict-item]


# --- malformed frames, one test per path ----------------------------------------------


def frame_with(command: int, body: bytes, *, version: int = 1, flags: int = 0) -> bytes:
    """A frame with a correct CRC around whatever header values and body are given."""
    import crc32c

    prefix = HEADER_PREFIX.pack(p.MAGIC, version, command, flags, 1, len(body))
    return prefix + struct.pack("<I", crc32c.crc32c(body, crc32c.crc32c(prefix))) + body


def refuse(data: bytes, *, max_frame_size: int = 1 << 20) -> RemoteProtocolError:
    _, server = connected(max_frame_size=max_frame_size)
    server.receive_data(data)
    with pytest.raises(RemoteProtocolError) as info:
        server.next_event()
    return info.value


VALID_BATCH = encode_event(p.SendBatch([SAMPLE_MESSAGE, SAMPLE_MESSAGE], request_id=1))
VALID_BODY = VALID_BATCH[p.HEADER_SIZE :]


def test_oversize_frame_is_refused_from_its_header_before_the_body_arrives():
    header = HEADER_PREFIX.pack(p.MAGIC, 1, Command.SEND_BATCH, 0, 1, 4096 - p.HEADER_SIZE + 1)
    exc = refuse(header + bytes(4), max_frame_size=4096)
    assert exc.code == ErrorCode.FRAME_TOO_LARGE
    assert "4097 bytes" in str(exc) and "4096" in str(exc)
    # Exactly at the limit it waits for the body instead.
    _, server = connected(max_frame_size=4096)
    server.receive_data(
        HEADER_PREFIX.pack(p.MAGIC, 1, Command.SEND_BATCH, 0, 1, 4096 - p.HEADER_SIZE) + bytes(4)
    )
    assert server.next_event() is NEED_DATA


def test_bad_magic_is_refused_from_the_first_byte():
    exc = refuse(b"G")
    assert "bad magic" in str(exc) and exc.code == ErrorCode.MALFORMED
    assert refuse(b"GET / HTTP/1.1\r\n\r\n").code == ErrorCode.MALFORMED


def test_unknown_frame_version():
    exc = refuse(frame_with(Command.STATS, b"", version=2))
    assert exc.code == ErrorCode.UNSUPPORTED_VERSION


def test_unknown_command():
    exc = refuse(frame_with(0x42, b""))
    assert exc.code == ErrorCode.UNKNOWN_COMMAND and "0x42" in str(exc)


def test_unknown_flags():
    assert "flag bits 0x0100" in str(refuse(frame_with(Command.STATS, b"", flags=0x0100)))


def test_bad_crc():
    for position in (10, p.HEADER_SIZE + 3, len(VALID_BATCH) - 1):
        damaged = bytearray(VALID_BATCH)
        damaged[position] ^= 0x20
        assert "CRC" in str(refuse(bytes(damaged)))


def test_truncated_field():
    exc = refuse(frame_with(Command.SEND_BATCH, VALID_BODY[:-1]))
    assert "needs" in str(exc) and "SEND_BATCH" in str(exc)
    assert exc.request_id == 1  # the CRC held, so the answer can name the request


def test_every_truncation_of_every_body_is_refused():
    bodies = [
        encode_event(e)[p.HEADER_SIZE :]
        for e in (
            p.SendBatch([SAMPLE_MESSAGE], request_id=1),
            Hello(token="t", client_name="c", request_id=1),
            p.Pull("s", "g", "c", request_id=1),
            p.CommitOffset("g", "s", 1, 2, request_id=1),
            p.Query("s", key="k", request_id=1),
            p.Reschedule("m", 5, request_id=1),
        )
    ]
    for body, command in zip(bodies, [2, 1, 3, 4, 7, 10], strict=True):
        for cut in range(len(body)):
            with pytest.raises(RemoteProtocolError, match=r"needs|cannot fit|kind|presence"):
                decode_event(Command(command), 0, 1, body[:cut])


def test_trailing_garbage():
    exc = refuse(frame_with(Command.SEND_BATCH, VALID_BODY + b"\x00"))
    assert "1 trailing bytes" in str(exc)


def test_lying_counts():
    assert "cannot fit" in str(refuse(frame_with(Command.SEND_BATCH, b"\xff\xff\xff\xff")))
    bad_mask = struct.pack("<IH", 1, 0x8000) + bytes(12)
    assert "unknown message field bits" in str(refuse(frame_with(Command.SEND_BATCH, bad_mask)))


def test_bad_utf8():
    body = bytearray(VALID_BODY)
    body[4 + 14] = 0xFF  # first byte of the first message_id (after count and head)
    assert "not UTF-8" in str(refuse(frame_with(Command.SEND_BATCH, bytes(body))))
    body = bytearray(encode_event(p.Cancel("abc", request_id=1))[p.HEADER_SIZE :])
    body[2] = 0xC3  # a lead byte without its continuation
    assert "message_id is not UTF-8" in str(refuse(frame_with(Command.CANCEL, bytes(body))))


def test_duplicate_property_and_unknown_enum_values():
    body = bytearray(
        encode_event(
            p.SendBatch([Message("m", "s", properties={"a": "1", "b": "2"})], request_id=1)
        )[p.HEADER_SIZE :]
    )
    index = body.index(b"b\x01\x002")
    body[index] = ord("a")
    assert "appears twice" in str(refuse(frame_with(Command.SEND_BATCH, bytes(body))))
    cancel = frame_with(Command.CANCEL_RESULT, b"\x07\x00")
    client = Connection(CLIENT)
    client.send(Hello(request_id=1))
    client.receive_data(cancel)
    with pytest.raises(RemoteProtocolError, match="unknown cancel outcome 7"):
        client.next_event()
    with pytest.raises(RemoteProtocolError, match="unknown error code"):
        decode_event(Command.ERROR, 0, 0, b"\x99\x99\x00\x00")
    with pytest.raises(RemoteProtocolError, match="presence byte"):
        decode_event(Command.HELLO, 0, 1, b"\x01\x00\x01\x00\x02")


# --- subjects -------------------------------------------------------------------------


@pytest.mark.parametrize("subject", ["a", "orders.timeout", "A-Z_0-9", "x" * 255, "a..b", "-"])
def test_valid_subjects(subject):
    assert p.validate_subject(subject) is None


@pytest.mark.parametrize(
    "subject, reason",
    [
        ("", "empty"),
        ("x" * 256, "256 characters"),
        (".hidden", "starts with '.'"),
        ("..", "starts with '.'"),
        ("a/b", "'/' at index 1"),
        ("ordérs", "'é' at index 3"),
        ("a b", "' ' at index 1"),
    ],
)
def test_invalid_subjects(subject, reason):
    assert reason in p.validate_subject(subject)


def test_a_heartbeat_without_held_queues_is_the_version_1_body():
    old = encode_event(p.Heartbeat("g", "s", "c", request_id=2))
    new = encode_event(p.Heartbeat("g", "s", "c", (0, 3), request_id=3))
    body = old[p.HEADER_SIZE :]
    assert body == b"\x01\x00g\x01\x00s\x01\x00c"
    assert new[p.HEADER_SIZE :] == body + b"\x02\x00" + b"\x00" * 4 + b"\x03\x00\x00\x00"
    server = Connection(SERVER)
    server.receive_data(raw_request(Hello(request_id=1)))
    server.next_event()
    server.receive_data(old + new)
    assert [e.held for e in drain(server)] == [None, (0, 3)]


def test_a_join_without_held_queues_is_the_version_1_body():
    old = encode_event(p.JoinGroup("g", "s", "c", request_id=2))
    new = encode_event(p.JoinGroup("g", "s", "c", (1,), request_id=3))
    body = old[p.HEADER_SIZE :]
    assert body == b"\x01\x00g\x01\x00s\x01\x00c"
    assert new[p.HEADER_SIZE :] == body + b"\x01\x00" + b"\x01\x00\x00\x00"
    server = Connection(SERVER)
    server.receive_data(raw_request(Hello(request_id=1)))
    server.next_event()
    server.receive_data(old + new)
    assert [e.held for e in drain(server)] == [None, (1,)]


def test_worked_examples_in_docs_match_the_code():
    hello = encode_event(Hello(token="s3cret", client_name="cli", request_id=1))
    assert hello.hex(" ") == (
        "44 4c 59 44 01 01 00 00 01 00 00 00 00 00 00 00 12 00 00 00 f5 4e eb 04 "
        "01 00 03 00 01 06 00 73 33 63 72 65 74 03 00 63 6c 69"
    )
    batch = p.SendBatch([Message("m-1", "orders", body=b"hi", delay_ms=60000)], request_id=2)
    assert encode_event(batch).hex(" ") == (
        "44 4c 59 44 01 02 00 00 02 00 00 00 00 00 00 00 25 00 00 00 81 61 0d ed "
        "01 00 00 00 04 00 03 00 06 00 00 00 00 00 02 00 00 00 6d 2d 31 6f 72 64 65 72 73 "
        "68 69 60 ea 00 00 00 00 00 00"
    )


# --- error tree, layering, speed ------------------------------------------------------


def test_error_tree():
    assert issubclass(LocalProtocolError, ProtocolError)
    assert issubclass(RemoteProtocolError, ProtocolError)
    assert issubclass(ProtocolError, DelaydError)
    from delayd import errors

    assert issubclass(errors.DelaydTimeout, TimeoutError)
    assert issubclass(errors.CorruptionError, errors.StorageError)
    rejected = errors.RejectedError(ResultCode.DELAY_TOO_LONG, "delay of 3 y exceeds 2 y")
    assert rejected.reason == "delay of 3 y exceeds 2 y" and rejected.code == 6


FORBIDDEN = {"trio", "anyio", "asyncio", "socket", "storage"}


def test_protocol_imports_no_io_framework():
    files = [*sorted((ROOT / "delayd" / "protocol").glob("*.py")), ROOT / "delayd/errors.py"]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                allowed = path.name == "errors.py" and name == "storage.errors"
                assert top not in FORBIDDEN or allowed, f"{path.name} imports {name}"
    # At run time too (socket is left out: the crc32c package pulls it in through
    # importlib.metadata, which the protocol does not control and never uses).
    code = "import sys, delayd.protocol; print(sorted(sys.modules))"
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    for name in ("trio", "anyio", "asyncio"):
        assert f"'{name}'" not in loaded


def test_batch_of_100_encodes_and_decodes_fast():
    batch = p.SendBatch(
        [Message(f"id-{i}", "orders", f"k{i}", {"t": "x"}, bytes(100)) for i in range(100)],
        request_id=1,
    )

    def round_trip() -> None:
        assert len(decode_all([encode_event(batch)])[0].messages) == 100

    best_s = min(timeit.repeat(round_trip, number=20, repeat=5)) / 20
    # About 0.25-0.45 ms of CPU on a shared 2-core machine; the bound only catches a
    # regression by an order of magnitude (say an accidental quadratic copy).
    assert best_s < 0.005
