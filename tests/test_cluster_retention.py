"""Retention in a replicated group with real processes and a real etcd
(docs/replication.md, "Retention in a group"): the leader deletes message_log segments
its in-sync follower has copied, and the follower deletes the same ones at the leader's
word; the two copies then begin at the same segment and hold the same bytes from there.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

import delayd
from delayd.logs import layout
from tests.etcd_support import EtcdServer
from tests.test_cluster_replication import in_sync_pair
from tests.test_cluster_roles import LEASE_TTL_MS, Group, addr, wait_until

pytestmark = pytest.mark.slow


def retention_env() -> dict[str, str]:
    return {
        "DELAYD_CLUSTER_REPLICATION_LISTEN": "127.0.0.1:0",
        "DELAYD_CLUSTER_LEASE_TTL_MS": str(LEASE_TTL_MS),
        "DELAYD_CLUSTER_ACK": "sync",
        "DELAYD_MESSAGE_LOG_SEGMENT_BYTES": "8192",  # a few dozen messages a segment
        "DELAYD_INTAKE_MAX_RECORD_BYTES": "4096",
        "DELAYD_RETENTION_MESSAGE_LOG_MS": "0",  # as soon as it is safe
        "DELAYD_RETENTION_INTERVAL_MS": "200",
    }


def segments(data_dir: Path) -> dict[int, bytes]:
    directory = Path(layout.message_log_dir(str(data_dir)))
    return {int(p.name): p.read_bytes() for p in directory.iterdir() if p.name.isdigit()}


def send(address: str, prefix: str, count: int) -> None:
    with delayd.Producer(address, timeout_s=10) as producer:
        for i in range(count):
            receipt = producer.send(
                "orders", b"x" * 100, message_id=f"{prefix}-{i}", delay_ms=3_600_000
            )
            assert receipt.ok, receipt


def test_the_follower_deletes_message_log_in_step_with_its_leader(
    tmp_path: Path, etcd_server: EtcdServer
):
    group = Group(tmp_path, etcd_server.url, env=retention_env())
    try:
        a, b = in_sync_pair(group)
        send(addr(a.address), "m", 400)
        first = min(segments(a.data_dir))
        wait_until(lambda: min(segments(a.data_dir)) > first, 20, "the leader deletes segments")
        leader_start = min(segments(a.data_dir))

        rounds = itertools.count()

        def in_step() -> bool:
            send(addr(a.address), f"n{next(rounds)}", 5)  # RETAINED rides a growth
            return min(segments(b.data_dir)) >= leader_start

        wait_until(in_step, 20, "the follower deletes what the leader deleted")
        assert "the leader's message_log begins at" in b.log_path.read_text()
        leader, follower = segments(a.data_dir), segments(b.data_dir)
        common = max(min(leader), min(follower))
        shared = [base for base in sorted(follower) if base >= common and base in leader]
        assert shared, "the copies share segments"
        for base in shared[:-1]:  # the last may be growing on either
            assert follower[base] == leader[base]
    finally:
        group.close()
