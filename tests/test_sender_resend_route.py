"""A resend after a restart or a failover reaches the broker group the first send went
to (docs/cluster.md, "A resend after a failover"): a bucket's route set is recorded in
its dispatch_log before its first send, a send anywhere but the set's first choice is
recorded (ROUTED) before it, and a new run routes a message an earlier run may have
sent by those records, not by the broker groups of the moment. In-process on trio's
clock (delivery_pipeline: the real sender, dispatch_log and wheel); the codec's side is
at the end."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

import pytest
import trio

from delayd.logs.dispatch_log import (
    BucketRoutes,
    DispatchEntry,
    EntryKind,
    decode_entry,
    encode_entry,
    encode_route_set,
    find_entry,
    read_state,
)
from delayd.sender.retry import RetryPolicy
from delayd.sender.routing import GroupWeight, Router
from delayd.sender.sender import SenderConfig
from delayd.sender.targets import TargetUnavailable
from delayd.server.config import ConfigError, config_from_mapping
from delayd.server.pending import PendingCounts
from storage.fs import REAL_FS
from storage.record_file import RecordFile
from tests.delivery_pipeline import T0, Pipeline, RecordingTarget, dispatch_entries, received_ids

FAST = SenderConfig(
    failure_threshold=1, open_ms=60_000, max_open_ms=60_000, retry=RetryPolicy(base_ms=10)
)

# In-process, recording targets: nothing real to wait for but worker threads.
pytestmark = pytest.mark.instant_autojump


def durable_entries(data: str) -> list[DispatchEntry]:
    """Every dispatch_log entry on disk now (what a crash would leave, at most)."""
    return [e for entries in dispatch_entries(data).values() for e in entries]


@dataclass
class WatchingTarget(RecordingTarget):
    """Records, at each send, what dispatch_log on disk says of the batch's routes; can
    hang (an unanswered send) or refuse at once with nothing stored (a group down)."""

    data: str = ""
    down: bool = False
    tried: list[str] = field(default_factory=list)
    seen_sets: list[tuple] = field(default_factory=list)
    seen_routed: dict[int, str] = field(default_factory=dict)

    async def send_batch(self, messages):
        self.tried += [m.message_id for m in messages]
        state = read_state(durable_entries(self.data))
        self.seen_sets.append(state.routes.route_set)
        self.seen_routed.update(state.routes.deviations)
        if self.down:
            raise TargetUnavailable(f"{self.name} is down (test)", nothing_stored=True)
        return await super().send_batch(messages)


def first_choices(ids: list[str], *names: str) -> dict[str, str]:
    router = Router([GroupWeight(name, 1) for name in names])
    return {i: router.choose(i, lambda _: True) for i in ids}


async def test_a_bucket_records_its_route_set_before_its_first_send(tmp_path, clock):
    data = str(tmp_path)
    a, b = WatchingTarget("a", data=data), WatchingTarget("b", data=data)
    with Pipeline(data, [a, b]) as pipeline:
        ids = pipeline.schedule([T0 + 1000 + i for i in range(100)])
        await pipeline.run_until(T0 + 3000)
    assert Counter(received_ids([a, b])) == Counter(ids)
    assert set(a.seen_sets + b.seen_sets) == {(("a", 1), ("b", 1))}  # durable at every send
    # Each went to its first choice: nothing recorded beside the set and the fates.
    kinds = Counter(e.kind for e in durable_entries(data))
    assert kinds[EntryKind.ROUTE] == 2 and kinds[EntryKind.ROUTED] == 0
    assert kinds[EntryKind.DISPATCHED] == 100
    expected = first_choices(ids, "a", "b")
    assert all(expected[r.message.message_id] == t.name for t in (a, b) for r in t.received)


async def test_a_send_off_the_first_choice_is_recorded_before_it(tmp_path, clock):
    data = str(tmp_path)
    a = WatchingTarget("a", data=data, down=True)
    b = WatchingTarget("b", data=data)
    with Pipeline(data, [a, b], sender=FAST) as pipeline:
        ids = pipeline.schedule([T0 + 1000 + i for i in range(100)])
        await pipeline.run_until(T0 + 3000)
    assert sorted(received_ids([b])) == sorted(ids)
    moved = {i for i, group in first_choices(ids, "a", "b").items() if group == "a"}
    assert moved  # some had a as their first choice
    routed = {e.offset: e.group for e in durable_entries(data) if e.kind is EntryKind.ROUTED}
    assert len(routed) == len(moved) and set(routed.values()) == {"b"}
    assert b.seen_routed == routed  # each on disk before b was sent it


async def test_a_group_added_mid_bucket_gets_routed_entries_until_the_next_bucket(tmp_path, clock):
    """The bucket keeps the set its first send recorded; what the new group takes of it
    is recorded one by one, and the next bucket records the new set."""
    data = str(tmp_path)
    a, b = WatchingTarget("a", data=data), WatchingTarget("b", data=data)
    with Pipeline(data, [a]) as pipeline:
        first = pipeline.schedule([T0 + 1000 + i for i in range(100)])
        same_bucket = pipeline.schedule([T0 + 5000 + i for i in range(100)])
        next_bucket = pipeline.schedule([T0 + 65_000 + i for i in range(100)])
        async with pipeline.running():
            await trio.sleep_until(3)
            b.clock = a.clock
            pipeline.delivery.sender.add_group(b)
            await trio.sleep_until(70)
            await pipeline.stop()
    assert Counter(received_ids([a, b])) == Counter(first + same_bucket + next_bucket)
    entries = dispatch_entries(data)
    (older, newer) = sorted(entries)
    assert read_state(entries[older]).routes.route_set == (("a", 1),)
    assert read_state(entries[newer]).routes.route_set == (("a", 1), ("b", 1))
    to_b = {r.message.message_id for r in b.received}
    assert to_b & set(same_bucket) and not to_b & set(first)
    routed = [e for e in entries[older] if e.kind is EntryKind.ROUTED]
    assert len(routed) == len(to_b & set(same_bucket))
    assert not any(e.kind is EntryKind.ROUTED for e in entries[newer])


async def test_a_member_that_may_no_longer_lead_sends_nothing_more_nor_routes_elsewhere(
    tmp_path, clock
):
    """Route records the group does not acknowledge (this member may no longer lead):
    the batch waits for its group. Had the sender charged the broker group's circuit
    and routed the batch to another group, the ROUTED entries it wrote, durable here,
    would send each message's resend, once this member leads again, away from a group
    that may hold it (a clean-clone CI run saw messages stored in two broker groups that
    way)."""
    data = str(tmp_path)
    a, b = WatchingTarget("a", data=data), WatchingTarget("b", data=data)
    asked: list[list[int]] = []

    async def not_leading(buckets) -> bool:
        asked.append(sorted(buckets))
        return False

    with Pipeline(data, [a, b], sender=FAST) as pipeline:
        pipeline.delivery.sender.acknowledge = not_leading
        pipeline.schedule([T0 + 1000 + i for i in range(100)])
        await pipeline.run_until(T0 + 5000)
        assert pipeline.delivery.sender.routes_unacknowledged > 1  # tried again, same group
    assert asked  # the bucket's route set was recorded and its acknowledgement asked for
    assert a.tried == [] and b.tried == []  # nothing sent unrecorded
    kinds = Counter(e.kind for e in durable_entries(data))
    assert kinds[EntryKind.ROUTE] == 2  # the set: a resend after a promotion goes by it
    assert kinds[EntryKind.ROUTED] == 0 and kinds[EntryKind.DISPATCHED] == 0


async def restart(data: str, targets: list[WatchingTarget], until_ms: int) -> None:
    for target in targets:
        target.received.clear()
    with Pipeline(data, targets) as pipeline:
        await pipeline.run_until(until_ms)


async def test_a_resend_goes_by_the_recorded_set_not_the_groups_of_the_moment(tmp_path, clock):
    """A crash while every send was unanswered (no DISPATCHED entry), and a group added
    before the restart: each message goes to the group it was first sent to, whose
    broker would drop it as a duplicate — never to the new group."""
    data = str(tmp_path)
    hang = trio.Event()
    a = WatchingTarget("a", data=data, hang=hang)
    b = WatchingTarget("b", data=data, hang=hang)
    with Pipeline(data, [a, b]) as pipeline:
        ids = pipeline.schedule([T0 + 1000] * 200)  # one batch per group: all in flight
        await pipeline.run_until(T0 + 3000)
    first_sent = {i: t.name for t in (a, b) for i in t.tried}
    assert len(first_sent) == 200
    assert not any(e.kind is EntryKind.DISPATCHED for e in durable_entries(data))

    a2, b2, c2 = (WatchingTarget(name, data=data) for name in "abc")
    await restart(data, [a2, b2, c2], T0 + 6000)
    assert Counter(received_ids([a2, b2, c2])) == Counter(ids)
    assert not c2.received  # c wins about a third of them under {a, b, c}
    assert {r.message.message_id: t.name for t in (a2, b2) for r in t.received} == first_sent
    assert set(first_choices(ids, "a", "b", "c").values()) == {"a", "b", "c"}


async def test_a_resend_goes_to_its_recorded_deviation(tmp_path, clock):
    """First sent to b because a was down; a is up again after the restart: the resend
    still goes to b (a would store it a second time)."""
    data = str(tmp_path)
    a = WatchingTarget("a", data=data, down=True)
    b = WatchingTarget("b", data=data, hang=trio.Event())
    with Pipeline(data, [a, b], sender=FAST) as pipeline:
        ids = pipeline.schedule([T0 + 1000] * 100)
        await pipeline.run_until(T0 + 3000)
    assert set(b.tried) == set(ids)

    a2, b2 = WatchingTarget("a", data=data), WatchingTarget("b", data=data)
    await restart(data, [a2, b2], T0 + 6000)
    assert sorted(received_ids([b2])) == sorted(ids) and not a2.received


async def test_a_resend_waits_for_its_recorded_group_while_it_is_down(tmp_path, clock):
    """As an unanswered send does, up to doubt_hold_ms (30 s): the group may hold it."""
    data = str(tmp_path)
    a = WatchingTarget("a", data=data, hang=trio.Event())
    with Pipeline(data, [a]) as pipeline:
        ids = pipeline.schedule([T0 + 1000 + i for i in range(20)])
        await pipeline.run_until(T0 + 3000)

    a2 = WatchingTarget("a", data=data, down=True)
    b2 = WatchingTarget("b", data=data)
    reopening = dataclasses.replace(FAST, open_ms=2000, max_open_ms=4000)
    with Pipeline(data, [a2, b2], sender=reopening) as pipeline:
        async with pipeline.running():
            await trio.sleep(10)
            assert not b2.received and set(a2.tried) == set(ids)
            a2.down = False
            await trio.sleep(10)  # a's circuit half-opens, the probe closes it
            await pipeline.stop()
    assert sorted(received_ids([a2])) == sorted(ids) and not b2.received


# ------------------------------------------------------------------ the codec


def entries_of(*groups_of_payloads: tuple[EntryKind, list[bytes]]) -> list[DispatchEntry]:
    return [
        decode_entry(kind, payload, "test", 0)
        for kind, payloads in groups_of_payloads
        for payload in payloads
    ]


def test_the_first_whole_route_set_of_a_file_is_the_buckets():
    route_set = (("a", 1), ("b", 3))
    cut_short = encode_route_set(route_set, 5)[:1]  # a crash after the first entry
    state = read_state(
        entries_of(
            (EntryKind.ROUTE, cut_short),
            (EntryKind.ROUTE, encode_route_set(route_set, 7)),
            (EntryKind.ROUTE, encode_route_set((("c", 1),), 9)),  # never replaces it
            (EntryKind.ROUTED, [encode_entry(41, 10, b"b"), encode_entry(41, 11, b"a")]),
            (EntryKind.DISPATCHED, [encode_entry(82, 12, b"a")]),
        )
    )
    assert state.routes == BucketRoutes(route_set, {41: "a"}, earlier=True)
    assert state.done == {82}  # ROUTE and ROUTED are no record's fate
    empty = read_state(entries_of((EntryKind.ROUTE, encode_route_set((), 1))))
    assert empty.routes.route_set == ()
    assert read_state(()).routes == BucketRoutes()  # an old file: no set


def test_routing_entries_are_no_fate_for_lookups_nor_for_the_pending_count(tmp_path):
    path = str(tmp_path / "bucket")
    with RecordFile.open(path) as record_file:
        record_file.append_batch(encode_route_set((("a", 1),), 1), EntryKind.ROUTE)
        record_file.append_batch([encode_entry(0, 2, b"b")], EntryKind.ROUTED)
        record_file.append_batch([encode_entry(0, 3, b"b")], EntryKind.DISPATCHED)
        record_file.append_batch([encode_entry(41, 4, b"b")], EntryKind.ROUTED)
        record_file.flush()
    entry = find_entry(REAL_FS, path, 0)
    assert entry is not None and entry.kind is EntryKind.DISPATCHED
    assert find_entry(REAL_FS, path, 41) is None
    counts = PendingCounts()
    counts.on_scheduled(T0, [0, 41], [T0, T0])
    counts.add_entries(T0, [(EntryKind.ROUTE.value, 1 << 32 | 1), (EntryKind.ROUTED.value, 41)])
    assert counts.total == 2


def test_a_weight_a_route_entry_cannot_hold_is_refused():
    group = {"name": "a", "addresses": ["127.0.0.1:1"], "weight": 2**32}
    with pytest.raises(ConfigError, match=r"weight must be 1\.\.4294967295"):
        config_from_mapping({"broker_groups": [group]})
