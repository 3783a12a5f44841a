"""Replication's metrics (delayd.replication.metrics): a real Leader and Follower on
127.0.0.1, each scraped through a registry as /metrics does, the values moving as
records are copied, a follower falls behind, and the leader stops or is fenced."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import trio
from prometheus_client import CollectorRegistry, generate_latest

from delayd.replication import MESSAGE_LOG, Follower, Leader, dispatch_stream
from delayd.replication.metrics import FENCED, SERVING, STOPPED, ReplicationCollector, stream_kind
from tests.exported_metrics import parse_exposition
from tests.test_metric_names import naming_problems
from tests.test_replication import BUCKETS, GROUP, caught_up, follower_of, in_sync, members


def scrape(current: Callable[[], Leader | Follower | None]) -> dict[tuple[str, str], float]:
    """``(sample name, its one label value or "")`` -> value, from a fresh registry
    (the names checked against the naming rules on the way)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReplicationCollector(current))
    families = parse_exposition(generate_latest(registry).decode())
    assert naming_problems(families) == []
    return {
        (name, next(iter(labels.values()), "")): value
        for family in families.values()
        for name, labels, value in family.samples
    }


async def test_leader_and_follower_metrics_move_with_the_copy(tmp_path: Path) -> None:
    with members(tmp_path, "a", "b") as (a, b):
        a.append_messages(30)
        a.append_dispatch(BUCKETS[0], 4)
        a.append_dispatch(BUCKETS[1], 2)
        leader = Leader(a.streams, a.history, 7, group=GROUP, replica_lag_ms=100_000)
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            before = scrape(lambda: leader)
            assert before[("delayd_replication_leader_state", "")] == SERVING
            assert before[("delayd_replication_term_revision", "")] == 7
            assert before[("delayd_replication_in_sync_members", "")] == 0
            assert not any(name.startswith("delayd_replication_follower_lag") for name, _ in before)

            follower = follower_of(b, "b", leader)
            following = trio.CancelScope()

            async def follow() -> None:
                with following:
                    await follower.run()

            nursery.start_soon(follow)
            await caught_up(b, a)
            await in_sync(leader, {"b"})
            message_end = a.streams.message_log.end_offset
            dispatch_end = sum(a.streams.get(dispatch_stream(n)).end_offset for n in BUCKETS[:2])
            await leader.wait_acknowledged(MESSAGE_LOG, message_end)
            on_leader = scrape(lambda: leader)
            assert on_leader[("delayd_replication_in_sync_members", "")] == 1
            assert on_leader[("delayd_replication_connected_members", "")] == 1
            assert on_leader[("delayd_replication_follower_lag_bytes", "b")] == 0
            assert on_leader[("delayd_replication_follower_lag_seconds", "b")] == 0
            assert on_leader[("delayd_replication_follower_lag_records", "b")] == 0
            acked = "delayd_replication_acknowledged_offset_bytes"
            assert on_leader[(acked, "message_log")] == message_end
            assert on_leader[(acked, "dispatch_log")] == dispatch_end  # one series, two buckets
            assert on_leader[("delayd_replication_sent_bytes_total", "")] == (
                message_end + dispatch_end
            )

            on_follower = scrape(lambda: follower)
            durable = "delayd_replication_durable_offset_bytes"
            assert on_follower[(durable, "message_log")] == message_end
            assert on_follower[(durable, "dispatch_log")] == dispatch_end
            assert on_follower[("delayd_replication_received_bytes_total", "")] == (
                message_end + dispatch_end
            )
            assert on_follower[("delayd_replication_term_revision", "")] == 7
            assert on_follower[("delayd_replication_leader_connections_total", "")] == 1
            assert on_follower[("delayd_replication_session_failures_total", "network")] == 0

            # b stops following; the leader goes on appending: b's lag grows in bytes
            # and in time.
            following.cancel()
            with trio.fail_after(5):
                while leader.connected:
                    await trio.sleep(0.005)
            grown = a.append_messages(5) - message_end
            await trio.sleep(0.1)
            a.append_messages(2)
            behind = scrape(lambda: leader)
            assert behind[("delayd_replication_follower_lag_bytes", "b")] > grown
            assert behind[("delayd_replication_follower_lag_records", "b")] == 7
            # The age of the oldest record b lacks, not of the newest.
            assert behind[("delayd_replication_follower_lag_seconds", "b")] >= 0.1
            assert behind[("delayd_replication_connected_members", "")] == 0

            # Back: it catches up, the lag returns to 0, and it counts a reconnect.
            nursery.start_soon(follower.run)
            await caught_up(b, a)
            with trio.fail_after(5):
                while leader.lag()["b"]:
                    await trio.sleep(0.005)
            again = scrape(lambda: leader)
            assert again[("delayd_replication_follower_lag_seconds", "b")] == 0
            assert again[("delayd_replication_follower_lag_records", "b")] == 0
            assert (
                scrape(lambda: follower)[("delayd_replication_leader_connections_total", "")] == 2
            )

            leader.stop()
            assert scrape(lambda: leader)[("delayd_replication_leader_state", "")] == STOPPED
            with trio.fail_after(5):  # the leader gone, the follower's attempts fail
                while follower.failures["network"] == 0:
                    await trio.sleep(0.005)
            failures = scrape(lambda: follower)
            assert failures[("delayd_replication_session_failures_total", "network")] >= 1
            nursery.cancel_scope.cancel()


async def test_a_fenced_leader_says_so_and_no_role_exports_nothing(tmp_path: Path) -> None:
    with members(tmp_path, "a", "b") as (a, b):
        leader = Leader(a.streams, a.history, 4, group=GROUP)
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            b.history.begin(9, {})  # b followed a newer leader: its FOLLOW fences a
            nursery.start_soon(follower_of(b, "b", leader).run)
            with trio.fail_after(5):
                while leader.stopped is None:
                    await trio.sleep(0.005)
            assert scrape(lambda: leader)[("delayd_replication_leader_state", "")] == FENCED
            nursery.cancel_scope.cancel()
    assert scrape(lambda: None) == {}


def test_an_embedded_brokers_streams_count_as_commitlog_and_offsets() -> None:
    """A delay member's set holds its broker's streams under ``broker/``: their kinds
    are the broker's own, not one ``broker`` series summing the log and the offsets."""
    assert stream_kind("broker/commitlog") == "commitlog"
    assert stream_kind("broker/offsets/" + "0" * 20) == "offsets"
    assert stream_kind("offsets/" + "0" * 20) == "offsets"
    assert stream_kind("dispatch_log/202611221530") == "dispatch_log"
    assert stream_kind("message_log") == "message_log"
