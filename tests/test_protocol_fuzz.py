"""Fuzz the protocol parsers (STYLE.md #11, after h11's fuzz/afl-server.py).

Whatever bytes arrive, whole or one at a time, a Connection may only return events or
NEED_DATA, or raise ProtocolError. Anything else — IndexError, struct.error,
UnicodeDecodeError, KeyError, ValueError, a hang — is a bug. Random bytes alone rarely
get past the magic, so most tests start from valid frames and damage them, and some
re-seal the damage with a correct CRC so the body decoders see it.
"""

from __future__ import annotations

import struct

import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import delayd.protocol as p
from delayd.errors import ProtocolError
from delayd.protocol import CLIENT, NEED_DATA, SERVER, Connection, ConnectionClosed, Message
from delayd.protocol.bodies import encode_event
from delayd.protocol.frames import HEADER_PREFIX

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

MESSAGE = Message(
    "id-1", "orders", "k", {"p": "v", "é": "🙂"}, b"body", delay_ms=5, queue=2, due_ms=9
)
# One valid frame of every command, to start mutations from.
SAMPLES = [
    encode_event(e)
    for e in (
        p.Hello(token="t", client_name="c", request_id=1),
        p.SendBatch([MESSAGE, Message("id-2", "s")], request_id=2),
        p.Pull("orders", "g", "c", 5, 100, request_id=3),
        p.CommitOffset("g", "orders", 1, 7, request_id=4),
        p.JoinGroup("g", "orders", "c", request_id=5),
        p.Heartbeat("g", "orders", "c", request_id=6),
        p.Query("orders", message_id="id-1", request_id=7),
        p.Query("orders", key="k", request_id=8),
        p.Stats(request_id=9),
        p.Cancel("id-1", request_id=10),
        p.Reschedule("id-1", 99, request_id=11),
        p.HelloOk(1, "srv", 1 << 20, request_id=1),
        p.SendBatchResult(
            [p.SendResult(p.ResultCode.OK, "", 1, 2, 3, 4, 5), p.SendResult(p.ResultCode.BUSY)],
            request_id=2,
        ),
        p.PullResult([MESSAGE], request_id=3),
        p.CommitOffsetOk(request_id=4),
        p.JoinGroupResult([0, 1, 2], request_id=5),
        p.HeartbeatResult([1], request_id=6),
        p.QueryResult([MESSAGE], request_id=7),
        p.StatsResult({"a": 1, "b": 2.5, "c": "x"}, request_id=9),
        p.CancelResult(p.CancelOutcome.ALREADY_DELIVERED, 5, request_id=10),
        p.RescheduleResult(p.RescheduleOutcome.UNKNOWN, request_id=11),
        p.Error(p.ErrorCode.BUSY, "later", close=True, request_id=0),
    )
]
COMMANDS = [int(c) for c in p.Command]


def new_server() -> Connection:
    return Connection(SERVER, token="t", max_frame_size=1 << 20)


def new_client() -> Connection:
    """A client that has sent HELLO and request ids 2..11, so answers can match."""
    conn = Connection(CLIENT, max_frame_size=1 << 20)
    conn.send(p.Hello(token="t", request_id=conn.next_request_id()))
    for _ in range(10):
        conn.send(p.Stats(request_id=conn.next_request_id()))
    return conn


def feed(conn: Connection, chunks: list[bytes], eof: bool = True) -> list[p.Event]:
    """Feed ``chunks`` and drain events; only events, NEED_DATA or ProtocolError."""
    events: list[p.Event] = []
    try:
        for chunk in [*chunks, b""] if eof else chunks:
            conn.receive_data(chunk)
            while True:
                event = conn.next_event()
                if event is NEED_DATA:
                    break
                assert isinstance(event, p.Event)
                events.append(event)
                if isinstance(event, ConnectionClosed):
                    return events
    except ProtocolError:
        pass
    return events


def both_ways(data: bytes) -> None:
    """Into a server and a client, whole and one byte at a time."""
    for make in (new_server, new_client):
        whole = feed(make(), [data])
        bytewise = feed(make(), [data[i : i + 1] for i in range(len(data))])
        # Chunking must not change the outcome.
        assert whole == bytewise


def reseal(frame: bytes | bytearray) -> bytes:
    """``frame`` with its body length and CRC fixed up to match its (damaged) body."""
    frame = bytes(frame)
    magic, version, command, flags, rid, _ = HEADER_PREFIX.unpack_from(frame)
    body = frame[p.HEADER_SIZE :]
    prefix = HEADER_PREFIX.pack(magic, version, command, flags, rid, len(body))
    return prefix + struct.pack("<I", crc32c.crc32c(body, crc32c.crc32c(prefix))) + body


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes(data):
    both_ways(data)


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_after_a_valid_header_prefix(data):
    both_ways(p.MAGIC + b"\x01" + data)


@FUZZ
@given(
    command=st.sampled_from(COMMANDS),
    flags=st.sampled_from([0, 0, 0, p.FLAG_CLOSE]),
    request_id=st.sampled_from([0, 1, 2, 7, 2**64 - 1]),
    body=st.binary(max_size=120),
)
def test_well_sealed_frames_with_random_bodies(command, flags, request_id, body):
    # A correct header and CRC around junk: every body decoder gets to see it.
    both_ways(p.encode_frame(command, request_id, body, flags=flags))


@FUZZ
@given(
    sample=st.sampled_from(SAMPLES),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=4),
    resealed=st.booleans(),
)
def test_valid_frames_with_flipped_bytes(sample, flips, resealed):
    frame = bytearray(sample)
    for position, mask in flips:
        frame[position % len(frame)] ^= mask
    data = reseal(frame) if resealed else bytes(frame)
    both_ways(data)


@FUZZ
@given(sample=st.sampled_from(SAMPLES), cut=st.integers(0, 10_000), resealed=st.booleans())
def test_truncated_frames(sample, cut, resealed):
    cut %= len(sample)
    data = sample[:cut]
    if resealed and cut >= p.HEADER_SIZE:
        data = reseal(data)  # a complete frame whose body ends early
    both_ways(data)


@FUZZ
@given(
    sample=st.sampled_from(SAMPLES),
    position=st.integers(0, 10_000),
    junk=st.binary(min_size=1, max_size=16),
    delete=st.integers(0, 8),
)
def test_bytes_inserted_into_or_deleted_from_bodies(sample, position, junk, delete):
    body = sample[p.HEADER_SIZE :]
    at = position % (len(body) + 1)
    damaged = sample[: p.HEADER_SIZE] + body[:at] + junk + body[at + delete :]
    both_ways(reseal(damaged))


@FUZZ
@given(st.lists(st.sampled_from(SAMPLES), max_size=6), st.binary(max_size=30))
def test_sequences_of_valid_frames_then_junk(frames, junk):
    # Valid frames in arbitrary order violate the state rules (answers to nothing,
    # requests before HELLO): those must be ProtocolErrors too, never anything else.
    both_ways(b"".join(frames) + junk)
