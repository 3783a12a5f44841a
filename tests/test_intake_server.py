"""``delayd serve`` as a real process on loopback: what it stores and where, what it
refuses, bad input, kill -9 during a steady send, torn tails, configuration errors.
Producers here are raw protocol clients (tests.intake_support.RawClient)."""

from __future__ import annotations

import contextlib
import random
import re
import signal
import socket
import struct
import time
from pathlib import Path

import pytest

from delayd.errors import ProtocolError
from delayd.logs import layout
from delayd.logs.buckets import bucket_name, bucket_of
from delayd.protocol import (
    ConnectionClosed,
    Error,
    ErrorCode,
    Hello,
    Message,
    Pull,
    ResultCode,
    SendBatch,
    SendBatchResult,
    SendResult,
    Stats,
    StatsResult,
    encode_event,
)
from delayd.replay.state import read_replay_checkpoint
from storage.fs import REAL_FS
from tests.delivery_support import SteadySender, Workload, now_ms, poll
from tests.intake_support import (
    RawClient,
    ServeProcess,
    check_exactly_once,
    interrupt,
    ok,
    raw_exchange,
    terminate,
    write_config,
)

pytestmark = pytest.mark.slow
MINUTE = 60_000
# As fast as acks come back, a few batches in flight, due within 20 minutes.
FLOOD = Workload(
    delay_ms=(0, 20 * MINUTE - 1),
    past_due=0,
    max_body=200,
    batch=25,
    in_flight=4,
    pause_s=0,
    warm=100,
)


def test_accepted_messages_land_in_their_buckets_with_their_contents(procs, tmp_path):
    config = write_config(tmp_path / "c.toml", "[schedule_log]\nsegment_scale_minutes = 5\n")
    server = procs.serve(tmp_path / "data", "--config", config)
    client = RawClient(server.address)
    base = now_ms()
    rng = random.Random(4)
    sent: dict[str, Message] = {}
    receipts = {}
    for b in range(5):
        batch = []
        for i in range(40):
            mid = f"b{b}-{i}"
            when = {"delay_ms": rng.randrange(90 * MINUTE)} if i % 3 else {}
            if i % 3 == 0:
                when = {"at_ms": base + rng.randrange(-MINUTE, 90 * MINUTE)}
            batch.append(
                Message(
                    mid,
                    f"orders.s{i % 3}",
                    key=None if i % 2 else f"k{i}",
                    properties={"n": str(i), "b": str(b)} if i % 4 else {},
                    body=rng.randbytes(rng.randrange(300)),
                    **when,
                )
            )
        for m, result in zip(batch, ok(client.send_batch(batch)), strict=True):
            sent[m.message_id] = m
            receipts[m.message_id] = result
    client.close()
    assert interrupt(server) == 0  # SIGINT: graceful too
    scheduled = check_exactly_once(tmp_path / "data", 5)
    assert set(scheduled) == set(sent)
    sequences = sorted(r.queue_offset for r in receipts.values())
    assert sequences == list(range(1, 201))
    for mid, m in sent.items():
        s = scheduled[mid]
        receipt = receipts[mid]
        assert s.message.due_ms == receipt.due_ms and s.message.sequence == receipt.queue_offset
        if m.at_ms is not None:
            assert s.message.due_ms == max(m.at_ms, s.message.receive_ms)
        else:
            assert s.message.due_ms == s.message.receive_ms + m.delay_ms
        assert base <= s.message.receive_ms <= now_ms()
        assert (s.message.subject, s.message.key, s.message.properties, s.message.body) == (
            m.subject,
            m.key,
            m.properties,
            m.body,
        )
        assert s.bucket == bucket_of(s.message.due_ms, 5)
    names = {p.name for p in Path(layout.schedule_log_dir(str(tmp_path / "data"))).iterdir()}
    assert names == {bucket_name(s.bucket) for s in scheduled.values()}
    checkpoint = read_replay_checkpoint(REAL_FS, str(tmp_path / "data"))
    assert checkpoint.next_sequence == 201  # shutdown replayed all and checkpointed


def stats(client: RawClient) -> dict:
    answer = client.request(lambda rid: Stats(request_id=rid))
    assert isinstance(answer, StatsResult)
    return answer.stats


def test_refusals_past_due_and_metrics(procs, tmp_path):
    config = write_config(
        tmp_path / "c.toml",
        "[intake]\nmax_delay_ms = 86_400_000\nmax_body_bytes = 1000\nmax_properties_bytes = 64\n",
    )
    server = procs.serve(tmp_path / "data", "--config", config, "--metrics-listen", "127.0.0.1:0")
    client = RawClient(server.address)
    before = now_ms()
    batch = [
        Message("past", "orders", at_ms=before - 3_600_000, body=b"late"),
        Message("far", "orders", delay_ms=86_400_001),
        Message("big", "orders", delay_ms=1, body=b"x" * 1001),
        Message("fits", "orders", delay_ms=1, body=b"x" * 1000),
        Message("props", "orders", properties={"k": "v" * 100}),
        Message("", "orders"),
        Message("subject", "no spaces"),
        Message("both", "orders", at_ms=before, delay_ms=5),
        Message("negative", "orders", delay_ms=-5),
    ]
    results = client.send_batch(batch)
    assert [r.code for r in results] == [
        ResultCode.OK,
        ResultCode.DELAY_TOO_LONG,
        ResultCode.BODY_TOO_LARGE,
        ResultCode.OK,
        ResultCode.PROPERTIES_TOO_LARGE,
        ResultCode.EMPTY_ID,
        ResultCode.INVALID_SUBJECT,
        ResultCode.INVALID_DELAY,
        ResultCode.INVALID_DELAY,
    ]
    assert before <= results[0].due_ms <= now_ms()  # past due: due at receipt
    assert all(r.reason for r in results if r.code is not ResultCode.OK)
    assert "max_delay" in results[1].reason and "max_body_bytes" in results[2].reason
    # STATS reports replay lag; once it is 0 every accepted message is in schedule_log
    poll(lambda: stats(client)["replay.lag_records"] == 0)
    values = server.metrics()
    assert values["delayd_intake_accepted_messages_total"] == 2
    assert values["delayd_intake_past_due_messages_total"] == 1
    assert values['delayd_intake_refused_messages_total{reason="delay_too_long"}'] == 1
    assert values['delayd_intake_refused_messages_total{reason="body_too_large"}'] == 1
    assert values['delayd_intake_refused_messages_total{reason="invalid_delay"}'] == 2
    assert values['delayd_intake_refused_messages_total{reason="busy"}'] == 0
    assert values["delayd_replay_lag_records"] == 0
    assert "delayd_broker_stored_messages_total" in values  # the embedded broker's too
    client.close()
    terminate(server)
    scheduled = check_exactly_once(tmp_path / "data", 1)
    assert set(scheduled) == {"past", "fits"}


def frame(command: int, request_id: int, body: bytes, flags: int = 0) -> bytes:
    """A frame built by hand (docs/protocol.md), so tests can send what a Connection
    never would."""
    import crc32c

    head = b"DLYD" + struct.pack("<BBHQI", 1, command, flags, request_id, len(body))
    return head + struct.pack("<I", crc32c.crc32c(body, crc32c.crc32c(head))) + body


def test_bad_input_gets_an_error_and_never_crashes_the_server(procs, tmp_path):
    config = write_config(tmp_path / "c.toml", '[server]\ntoken = "s3cret"\n')
    server = procs.serve(tmp_path / "data", "--config", config)
    address = server.address
    hello = encode_event(Hello(token="s3cret", request_id=1))
    cases = [
        (b"GET / HTTP/1.1\r\n\r\n", ErrorCode.MALFORMED),
        (encode_event(SendBatch([Message("a", "orders")], request_id=1)), ErrorCode.HELLO_REQUIRED),
        (encode_event(Hello(token="wrong", request_id=1)), ErrorCode.UNAUTHORIZED),
        (encode_event(Hello(request_id=1)), ErrorCode.UNAUTHORIZED),
        (hello + b"DLYD\x01\x02\x00\x00" + b"\x02" + b"\x00" * 7 + b"\xff" * 8, None),
        (hello + frame(0x02, 2, b"\x05\x00\x00\x00garbage"), ErrorCode.MALFORMED),
        (hello + frame(0x02, 2, b"\x00\x00\x00\x00", flags=2), ErrorCode.MALFORMED),
        (hello + frame(0x77, 2, b""), ErrorCode.UNKNOWN_COMMAND),
    ]
    for data, code in cases:
        events = raw_exchange(address, data)
        errors = [e for e in events if isinstance(e, Error)]
        assert errors, (data[:40], events)
        assert errors[-1].close
        if code is not None:
            assert errors[-1].code is code, (data[:40], errors[-1])
        else:  # a frame announcing more than max_frame_size
            assert errors[-1].code is ErrorCode.FRAME_TOO_LARGE
    # half a frame, then the peer goes away: nothing to answer, nothing breaks
    with socket.create_connection(address) as sock:
        sock.sendall(hello + frame(0x02, 2, b"\x01\x00\x00\x00")[:20])
    # requests the delay server does not serve are refused, the connection stays usable
    client = RawClient(address, token="s3cret")
    answer = client.request(lambda rid: Pull("orders", "g", "c", request_id=rid))
    assert isinstance(answer, Error) and answer.code is ErrorCode.UNSUPPORTED
    assert not answer.close and "broker at" in answer.reason
    ok(client.send_batch([Message("after", "orders", delay_ms=1000)]))
    client.close()
    assert server.proc.poll() is None
    terminate(server)
    assert set(check_exactly_once(tmp_path / "data", 1)) == {"after"}


def test_kill_9_during_a_steady_send_never_loses_or_duplicates(procs, tmp_path):
    config = write_config(
        tmp_path / "c.toml",
        "[replay]\ncheckpoint_interval_ms = 40\n"
        "[schedule_log]\nmax_open_files = 4\n"
        "[message_log]\nsegment_bytes = 262144\n"
        "[intake]\nmax_body_bytes = 32768\nmax_record_bytes = 65536\n",
    )
    data = tmp_path / "data"
    rng = random.Random(20261122)
    acked: dict[str, int] = {}
    rounds = 22
    for round_no in range(rounds):
        server = procs.serve(data, "--config", config)
        sender = SteadySender(server.address, f"r{round_no}", rng.randrange(2**32), FLOOD)
        sender.start()
        assert sender.started_acking.wait(20), server.log_tail()
        time.sleep(rng.uniform(0.0, 0.2))  # the workload's length, not a synchronisation
        server.kill()
        sender.join(20)
        assert sender.error is None, sender.error
        acked.update(sender.acked)
        server.close()
    server = procs.serve(data, "--config", config)
    terminate(server)  # a graceful stop replays everything and checkpoints
    scheduled = check_exactly_once(data, 1)
    lost = [mid for mid in acked if mid not in scheduled]
    assert not lost, f"{len(lost)} acknowledged messages lost, e.g. {lost[:5]}"
    assert all(scheduled[mid].message.due_ms == due for mid, due in acked.items())
    assert len(acked) >= rounds * 100
    log = server.log_path.read_text()
    assert log.count("replay recovery") == rounds + 1
    # some restarts found records replayed past their checkpoint and cut them
    cuts = [int(n) for n in re.findall(r"(\d+) cut \(\d+ bytes\)", log)]
    assert len(cuts) == rounds + 1 and any(cuts), cuts


def test_torn_tails_after_kill_are_cut_and_replayed(procs, tmp_path):
    # No checkpoint until shutdown, so everything the killed run wrote is past it.
    config = write_config(tmp_path / "c.toml", "[replay]\ncheckpoint_interval_ms = 3600000\n")
    data = tmp_path / "data"
    server = procs.serve(data, "--config", config)
    sender = SteadySender(server.address, "r0", 7, FLOOD)
    sender.start()
    assert sender.started_acking.wait(20)
    poll(lambda: len(sender.acked) >= 300 and stats_of(server)["replay.lag_records"] == 0)
    server.kill()
    sender.join(20)
    segments = sorted(Path(layout.message_log_dir(str(data))).glob("0*"))
    with open(segments[-1], "ab") as f:  # the last append, cut short
        f.write(b"\x80\x00\x00\x00\x01\x02\x03\x04\x02" + b"cut short")
    buckets = sorted(Path(layout.schedule_log_dir(str(data))).iterdir())
    biggest = max(buckets, key=lambda p: p.stat().st_size)
    size = biggest.stat().st_size
    with open(biggest, "r+b") as f:  # a torn bucket append: half a record, then junk
        f.truncate(size - 50)
        f.seek(0, 2)
        f.write(b"\x00\x00\xffjunk")
    server = procs.serve(data, "--config", config)
    terminate(server)
    log = server.log_path.read_text()
    assert "message_log: cut a torn tail of 18 bytes" in log
    scheduled = check_exactly_once(data, 1)
    assert all(mid in scheduled for mid in sender.acked)
    assert biggest.stat().st_size >= size  # filled again


def stats_of(server: ServeProcess) -> dict:
    client = RawClient(server.address)
    try:
        return stats(client)
    finally:
        client.close()


def test_changing_segment_scale_or_a_taken_port_is_refused(procs, tmp_path):
    data = tmp_path / "data"
    server = procs.serve(data)
    client = RawClient(server.address)
    ok(client.send_batch([Message("a", "orders", delay_ms=1)]))
    client.close()
    taken = "{}:{}".format(*server.address)
    code, log = ServeProcess(
        tmp_path / "other", "--listen", taken, "--broker-listen", "off"
    ).run_to_exit()
    assert code == 1 and "address already in use" in log.lower() and "Traceback" not in log
    terminate(server)
    config = write_config(tmp_path / "c.toml", "[schedule_log]\nsegment_scale_minutes = 10\n")
    code, log = ServeProcess(data, "--config", config).run_to_exit()
    assert code == 1
    assert "segment_scale = 1 minute" in log and "segment_scale = 10" in log
    assert "Traceback" not in log


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[intake]\nmax_dealy_ms = 5\n", ["unknown key intake.max_dealy_ms", "max_delay_ms"]),
        ("[intake]\nmax_delay_ms = -1\n", ["intake.max_delay_ms", "positive integer"]),
        ("[schedule_log]\nsegment_scale_minutes = 90\n", ["segment_scale_minutes", "1..60"]),
        ("[message_log]\nflush = 'sometimes'\n", ["message_log.flush", "sync, async"]),
        ("[wheels]\ntick_ms = 1\n", ["unknown table [wheels]"]),
        ("[delivery]\nmax_batch = 0\n", ["delivery.max_batch", "positive integer"]),
        ("[[broker_groups]]\nname = 'a b'\nembedded = true\n", ["broker group name"]),
        ("[server\n", ["not valid TOML", "line 1"]),
    ],
)
def test_bad_configuration_is_refused_naming_the_key(tmp_path, text, words):
    config = write_config(tmp_path / "c.toml", text)
    code, log = ServeProcess(tmp_path / "data", "--config", config).run_to_exit()
    assert code == 2
    for word in words:
        assert word in log
    assert not (tmp_path / "data").exists()  # refused before touching the data


def test_a_graceful_stop_answers_every_batch_it_appended(procs, tmp_path):
    """SIGTERM while a client has 40 SEND_BATCHes pipelined: every batch the server
    appended is answered (OK) before the connection closes — none is left appended and
    unanswered — and every OK message is in schedule_log after the restart."""
    server = procs.serve(tmp_path / "data")
    client = RawClient(server.address)
    due = int(time.time() * 1000) + 3_600_000
    batches = [
        [Message(f"g{b}-{i}", "orders", body=b"x" * 100, at_ms=due) for i in range(100)]
        for b in range(40)
    ]
    rids = [client.send(lambda rid, m=m: SendBatch(m, request_id=rid)) for m in batches[:20]]
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    for messages in batches[20:]:
        try:
            rids.append(client.send(lambda rid, m=messages: SendBatch(m, request_id=rid)))
        except OSError:
            break  # the server stopped reading and closed
    answered: dict[int, list[SendResult]] = {}
    with contextlib.suppress(OSError, ProtocolError):
        while len(answered) < len(rids):
            event = client.receive()
            if isinstance(event, ConnectionClosed):
                break
            assert isinstance(event, SendBatchResult), event
            answered[event.request_id] = ok(list(event.results))
    client.close()
    assert server.proc.wait(30) == 0
    assert answered, "not even the first batch was answered before the stop"
    server.start()
    terminate(server)
    scheduled = check_exactly_once(tmp_path / "data", 1)
    acked = {f"g{b}-{i}" for b, rid in enumerate(rids) if rid in answered for i in range(100)}
    assert acked <= set(scheduled)
    # Appended but never answered would show as scheduled ids of unanswered batches.
    assert set(scheduled) == acked, sorted(set(scheduled) - acked)[:5]
