"""The embedded Broker (what the delay server runs in-process): refusals, fields the
delay server sets, and recovery of the derived files from the commitlog."""

from __future__ import annotations

import os

import trio

from delayd.broker import BrokerConfig, open_broker
from delayd.broker.store import CHECKPOINT_NAME
from delayd.errors import RejectedError
from delayd.protocol import Message, ResultCode
from storage.consumequeue import ENTRY

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


async def test_long_poll_is_woken_by_the_reput_not_by_a_timer(tmp_path):
    async with open_broker(str(tmp_path), CONFIG) as broker:
        broker.join("g", "orders", "c", None, broker.monotonic_ms())
        got: list[Message] = []

        async def consumer() -> None:
            got.extend(await broker.pull("orders", "g", "c", 10, 60_000))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consumer)
            await trio.testing.wait_all_tasks_blocked()
            assert broker.hub.held == 1
            with trio.fail_after(5):
                await broker.send_batch([Message("wake", "orders")])
        assert [m.message_id for m in got] == ["wake"]
        assert broker.hub.held == 0
