"""The embedded Broker (what the delay server runs in-process): refusals, fields the
delay server sets, and recovery of the derived files from the commitlog."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from delayd.broker import Broker, BrokerConfig, open_broker
from delayd.broker.record import RECORD_TYPE, encode_record
from delayd.broker.store import CACHED_RECORD_OVERHEAD, CHECKPOINT_NAME, RecentRecords
from delayd.errors import CorruptionError, RejectedError
from delayd.protocol import Command, Message, ResultCode, SendBatch, decode_event, encode_event
from delayd.protocol.frames import HEADER_SIZE
from storage import framing
from storage.consumequeue import ENTRY
from storage.index_store import file_name

CONFIG = BrokerConfig(index_slot_count=1009, index_max_entries=50, dedupe_max_ids=1000)


def batch(prefix: str, count: int, **fields) -> list[Message]:
    return [Message(f"{prefix}-{i}", "orders", body=b"%d" % i, **fields) for i in range(count)]


async def drain(broker, group: str) -> list[Message]:
    broker.join(group, "orders", "c", None, broker.monotonic_ms())
    out: list[Message] = []
    while got := await broker.pull("orders", group, "c", 1000, 0):
        out += got
    return out


async def test_refusals_name_what_to_change(tmp_path):
    config = BrokerConfig(max_body_bytes=10, max_properties_bytes=8)
    async with open_broker(str(tmp_path), config) as broker:
        results = await broker.send_batch(
            [
                Message("", "orders"),
                Message("a", "../etc"),
                Message("b", "orders", body=b"x" * 11),
                Message("c", "orders", properties={"name": "value!"}),
                Message("d", "orders", at_ms=1),
                Message("e", "orders", body=b"x" * 10, properties={"k": "v"}),
            ]
        )
        codes = [r.code for r in results]
        assert codes == [
            ResultCode.EMPTY_ID,
            ResultCode.INVALID_SUBJECT,
            ResultCode.BODY_TOO_LARGE,
            ResultCode.PROPERTIES_TOO_LARGE,
            ResultCode.INVALID_DELAY,
            ResultCode.OK,
        ]
        assert all(r.reason for r in results[:5]) and results[5].reason == ""
        assert "delay server" in results[4].reason
        assert broker.store.next_queue_offset == {("orders", 0): 1}  # refusals use none
        try:
            await broker.pull("orders", "g", "nobody", 1, 0)
        except RejectedError as exc:
            assert exc.reason == "join the group first"
        else:
            raise AssertionError("a PULL before JOIN must be refused")


async def test_delay_server_fields_survive_and_keys_keep_order(tmp_path):
    async with open_broker(str(tmp_path), CONFIG) as broker:
        sent = [
            Message(
                f"d-{i}",
                "orders",
                key="customer-1",
                body=b"%d" % i,
                due_ms=1000 + i,
                dispatched_ms=2000 + i,
            )
            for i in range(20)
        ]
        results = await broker.send_batch(sent)
        assert {r.queue for r in results} == {results[0].queue}  # one key, one queue
        assert [r.due_ms for r in results] == [1000 + i for i in range(20)]
        got = await drain(broker, "g")
        assert [m.message_id for m in got] == [m.message_id for m in sent]  # in order
        assert [(m.due_ms, m.dispatched_ms) for m in got] == [
            (1000 + i, 2000 + i) for i in range(20)
        ]
        assert [m.message_id for m in broker.query("orders", key="customer-1")][:2] == [
            "d-19",
            "d-18",
        ]


async def test_a_batch_mixing_keys_dedupes_and_indexes_every_message(tmp_path):
    # Keyed messages after unkeyed ones in one batch (the reput's index keys switch from
    # one per record to id and key per record mid-batch), an in-batch copy, a resend.
    async with open_broker(str(tmp_path), CONFIG) as broker:
        first = await broker.send_batch([Message("old", "orders")])
        sent = [*batch("u", 3), Message("k-0", "orders", key="A"), Message("u-1", "orders")]
        sent += [Message("k-1", "orders", key="B"), Message("old", "orders")]
        results = await broker.send_batch(sent)
        assert [r.code for r in results] == [ResultCode.OK] * 4 + [
            ResultCode.DUPLICATE,
            ResultCode.OK,
            ResultCode.DUPLICATE,
        ]
        assert results[4].commitlog_offset == results[1].commitlog_offset
        assert results[6].commitlog_offset == first[0].commitlog_offset
        for message_id in ["u-0", "u-1", "u-2", "k-0", "k-1", "old"]:
            assert [m.message_id for m in broker.query("orders", message_id=message_id)] == [
                message_id
            ]
        assert [m.message_id for m in broker.query("orders", key="A")] == ["k-0"]
        assert [m.message_id for m in broker.query("orders", key="B")] == ["k-1"]
        assert len(await drain(broker, "g")) == 6


async def test_restart_rebuilds_queues_and_index_from_the_commitlog(tmp_path):
    async with open_broker(str(tmp_path), CONFIG) as broker:
        for n in range(5):  # enough index entries to roll index files (max 50 each)
            await broker.send_batch(batch(f"r{n}", 30, key=None))
        await broker.send_batch([Message("keyed", "orders", key="K")])
        before = await drain(broker, "g1")
    assert len(before) == 151
    queue_dir = tmp_path / "broker" / "consumequeue" / "orders" / "0"
    segment = queue_dir / sorted(os.listdir(queue_dir))[0]

    # 1. Entries past the checkpoint (as a crash can leave) are cut and rebuilt exactly.
    with open(segment, "ab") as f:
        f.write(ENTRY.pack(10**9, 50, 0) * 3)
    async with open_broker(str(tmp_path), CONFIG) as broker:
        after = await drain(broker, "g2")
        assert [m.commitlog_offset for m in after] == [m.commitlog_offset for m in before]
        # 2. Records appended now land behind the rebuilt entries with dense offsets.
        results = await broker.send_batch(batch("more", 8))
        n0 = sum(1 for m in before if m.queue == 0)
        assert sorted(r.queue_offset for r in results if r.queue == 0) == [n0, n0 + 1]

    # 3. Without the checkpoint and without a queue, everything is re-derived.
    os.unlink(tmp_path / "broker" / CHECKPOINT_NAME)
    for name in os.listdir(queue_dir):
        os.unlink(queue_dir / name)
    async with open_broker(str(tmp_path), CONFIG) as broker:
        again = await drain(broker, "g3")
        assert len(again) == 159
        assert [m.message_id for m in broker.query("orders", message_id="r2-7")] == ["r2-7"]
        assert [m.message_id for m in broker.query("orders", key="K")] == ["keyed"]
        dup = await broker.send_batch([Message("r0-0", "orders")])
        assert dup[0].code is ResultCode.DUPLICATE


async def test_the_index_file_is_created_when_the_broker_opens_not_by_the_first_send(tmp_path):
    # Creating one allocates a slot table and fsyncs twice: not in a delivery's step.
    index_dir = tmp_path / "broker" / "index"
    async with open_broker(str(tmp_path), CONFIG) as broker:
        assert sorted(n for n in os.listdir(index_dir) if n.isdigit()) == [file_name(0)]
        await broker.send_batch(batch("first", 3))
        assert sorted(n for n in os.listdir(index_dir) if n.isdigit()) == [file_name(0)]
        assert [m.message_id for m in broker.query("orders", message_id="first-2")] == ["first-2"]


@contextlib.asynccontextmanager
async def pulling(broker: Broker, consumer_id: str, wait_ms: int) -> AsyncIterator[list[Message]]:
    """A PULL of up to 10 messages of "orders" for ``consumer_id`` of group "g", held in
    the background; the list it yields holds what the PULL returned once the block ends."""
    got: list[Message] = []

    async def pull() -> None:
        got.extend(await broker.pull("orders", "g", consumer_id, 10, wait_ms))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pull)
        yield got


async def test_long_poll_is_woken_by_the_reput_not_by_a_timer(tmp_path):
    async with open_broker(str(tmp_path), CONFIG) as broker:
        broker.join("g", "orders", "c", None, broker.monotonic_ms())
        async with pulling(broker, "c", 60_000) as got:
            await trio.testing.wait_all_tasks_blocked()
            assert broker.hub.held == 1
            with trio.fail_after(5):
                await broker.send_batch([Message("wake", "orders")])
        assert [m.message_id for m in got] == ["wake"]
        assert broker.hub.held == 0


async def test_a_member_waiting_in_a_long_poll_does_not_time_out(tmp_path, clock):
    # A blocking consumer cannot heartbeat while its PULL is held: the held PULL is its
    # heartbeat, however much longer than heartbeat_timeout_ms it waits.
    config = dataclasses.replace(CONFIG, heartbeat_timeout_ms=3000)
    async with open_broker(str(tmp_path), config) as broker:
        broker.join("g", "orders", "waiting", None, broker.monotonic_ms())
        broker.join("g", "orders", "silent", None, broker.monotonic_ms())
        async with pulling(broker, "waiting", 30_000) as got:
            await trio.sleep(10)  # three heartbeat timeouts
            assert broker.groups.members("g", "orders") == ["waiting"]  # silent is gone
            await broker.send_batch([Message("late", "orders", key="k")])
        assert [m.message_id for m in got] == ["late"]


async def test_records_are_the_received_bytes_with_the_broker_integers_stamped_in(tmp_path):
    # The TCP path stores the producer's bytes (SendBatch.encoded); the embedded path
    # encodes Messages. Both must write exactly the record encode_record describes.
    sent = [
        Message("b-0", "orders", key="k", properties={"a": "é"}, body=b"\x00\xff"),
        Message("b-1", "orders", body=b"x" * 300, due_ms=5, dispatched_ms=6),
        # Integers only the broker sets are replaced, whatever a producer put there.
        Message("b-2", "orders", store_ms=-1, commitlog_offset=9, queue=77, queue_offset=8),
    ]
    frame = encode_event(SendBatch(sent, request_id=1))
    decoded = decode_event(Command.SEND_BATCH, 0, 1, frame[HEADER_SIZE:])
    assert isinstance(decoded, SendBatch) and decoded.encoded is not None
    async with open_broker(str(tmp_path), CONFIG) as broker:
        via_bytes = broker.append_batch(decoded.messages, broker.clock(), decoded.encoded)
        await broker.store.wait_durable()
        again = [dataclasses.replace(m, message_id=m.message_id + "'") for m in sent]
        via_messages = await broker.send_batch(again)
        for messages, results in ((sent, via_bytes), (again, via_messages)):
            for m, r in zip(messages, results, strict=True):
                assert r.code is ResultCode.OK
                payload = broker.store.commitlog.read(r.commitlog_offset).payload
                assert payload == encode_record(m, r.store_ms, r.queue, r.queue_offset)
                assert broker.store.message_at(r.commitlog_offset) == dataclasses.replace(
                    m,
                    store_ms=r.store_ms,
                    commitlog_offset=r.commitlog_offset,
                    queue=r.queue,
                    queue_offset=r.queue_offset,
                )
        with pytest.raises(ValueError, match="spans"):
            broker.append_batch(decoded.messages[:1], broker.clock(), decoded.encoded)


@pytest.mark.parametrize("queues", [4, 16])  # 16: too sparse to scan, read one by one
async def test_pull_reads_the_commitlog_when_the_cache_misses(tmp_path, queues):
    config = dataclasses.replace(CONFIG, queues_per_subject=queues, recent_cache_bytes=0)
    async with open_broker(str(tmp_path), config) as broker:
        results = []
        for n in range(3):
            results += await broker.send_batch(batch(f"c{n}", 50))
        got = await drain(broker, "g")
        assert len(broker.store.recent) == 0  # every message came from the commitlog
    by_id = {m.message_id: m for m in got}
    assert len(by_id) == 150
    for n in range(3):
        for i, r in enumerate(results[n * 50 : n * 50 + 50]):
            m = by_id[f"c{n}-{i}"]
            assert (m.commitlog_offset, m.queue, m.queue_offset, m.store_ms) == (
                r.commitlog_offset,
                r.queue,
                r.queue_offset,
                r.store_ms,
            )
            assert m.body == b"%d" % i


async def test_a_queue_entry_pointing_at_another_queues_record_is_corruption(tmp_path):
    config = dataclasses.replace(CONFIG, recent_cache_bytes=0)
    async with open_broker(str(tmp_path), config) as broker:
        results = await broker.send_batch(batch("x", 8))
        queue_dir = tmp_path / "broker" / "consumequeue" / "orders" / "0"
        (segment,) = sorted(os.listdir(queue_dir))
        other = next(r for r in results if r.queue == 1)
        with open(queue_dir / segment, "r+b") as f:  # entry 1 of queue 0 -> queue 1's record
            f.seek(ENTRY.size)
            f.write(ENTRY.pack(other.commitlog_offset, 30, 0))
        broker.join("g", "orders", "c", None, broker.monotonic_ms())
        with pytest.raises(CorruptionError, match="points at commitlog offset"):
            for _ in range(4):
                await broker.pull("orders", "g", "c", 100, 0)


async def test_pulls_cross_from_the_commitlog_into_the_recent_cache(tmp_path):
    # A cache smaller than the backlog: a PULL starts in records only the commitlog has
    # and continues into the cached ones, in queue order, nothing lost or repeated.
    config = dataclasses.replace(CONFIG, queues_per_subject=2, recent_cache_bytes=4000)
    async with open_broker(str(tmp_path), config) as broker:
        results = []
        for n in range(6):
            results += await broker.send_batch(batch(f"e{n}", 20))
        recent = broker.store.recent
        assert 0 < len(recent) < 120 and recent.bytes <= 4000
        assert recent.cached_from(("orders", 0)) > 0  # the oldest were evicted
        got = await drain(broker, "g")
    expected = {(r.queue, r.queue_offset): r.commitlog_offset for r in results}
    assert {(m.queue, m.queue_offset): m.commitlog_offset for m in got} == expected
    for queue in (0, 1):
        offsets = [m.queue_offset for m in got if m.queue == queue]
        assert offsets == list(range(len(offsets)))


def test_recent_records_evict_oldest_first_and_read_by_queue_offset():
    recent = RecentRecords(max_bytes=10 * (CACHED_RECORD_OVERHEAD + 4))
    for start in range(0, 40, 4):  # four records a pass, alternating queues
        key = ("s", start // 4 % 2)
        base = start // 8 * 4
        offsets = [1000 + start + i for i in range(4)]
        recent.extend(key, base, offsets, [b"%04d" % o for o in offsets])
    assert len(recent) <= 10
    run0 = recent.cached_from(("s", 0))
    offsets, payloads = recent.read(("s", 0), run0, run0 + 100)
    assert payloads == [b"%04d" % o for o in offsets] and len(offsets) == 20 - run0
    assert recent.read(("s", 0), run0 - 1, run0 + 1) == ([], [])  # evicted: not served


def test_worked_example_of_a_record_in_docs_matches_the_code():
    payload = encode_record(Message("m-1", "orders", key="k1", body=b"hi"), 1700000000000, 2, 5)
    assert framing.encode_record(payload, RECORD_TYPE).hex(" ") == (
        "2f 00 00 00 db 9e 2c 35 02 69 00 03 00 06 00 02 00 00 00 02 00 00 00 "
        "6d 2d 31 6f 72 64 65 72 73 6b 31 68 69 00 68 e5 cf 8b 01 00 00 "
        "02 00 00 00 05 00 00 00 00 00 00 00"
    )
