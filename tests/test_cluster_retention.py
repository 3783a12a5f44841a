"""Retention in a replicated group with real processes and a real etcd
(docs/replication.md, "Retention in a group"): the leader deletes message_log segments
its in-sync follower has copied, and the follower deletes the same ones at the leader's
word; the two copies then begin at the same segment and hold the same bytes from there.
A member whose disk was wiped after the leader deleted segments is brought back by a
snapshot of the leader's state, and leads after the old leader is killed.
A bucket the leader retires goes on the follower too, when it replays the record.
"""

from __future__ import annotations

import itertools
import shutil
import time
from pathlib import Path

import pytest

import delayd
from delayd.logs import layout, message_log
from delayd.logs.buckets import bucket_name, bucket_of
from delayd.logs.message_log import MessageRecord
from storage.segmented_log import SegmentedLog
from tests.delivery_support import consume, now_ms
from tests.etcd_support import EtcdServer
from tests.fault_checker import History, check
from tests.intake_support import ServeProcess
from tests.test_cluster_replication import in_sync_pair, member, sync_env
from tests.test_cluster_roles import Group, addr, member_id, state, steady, wait_until

pytestmark = pytest.mark.slow


def retention_env() -> dict[str, str]:
    return {
        **sync_env(),
        "DELAYD_MESSAGE_LOG_SEGMENT_BYTES": "8192",  # a few dozen messages a segment
        "DELAYD_INTAKE_MAX_RECORD_BYTES": "4096",
        "DELAYD_RETENTION_MESSAGE_LOG_MS": "0",  # as soon as it is safe
        "DELAYD_RETENTION_INTERVAL_MS": "200",
    }


def segments(data_dir: Path) -> dict[int, bytes]:
    """The member's message_log segments by base offset. Retention runs while we look:
    a segment listed and deleted before it is read is gone, and left out."""
    directory = Path(layout.message_log_dir(str(data_dir)))
    found = {}
    for path in directory.iterdir():
        if path.name.isdigit():
            try:
                found[int(path.name)] = path.read_bytes()
            except FileNotFoundError:
                continue
    return found


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
    group = Group(tmp_path, etcd_server.url, env=steady(retention_env()))
    try:
        a, b = in_sync_pair(group)
        send(addr(a.address), "m", 400)
        first = min(segments(a.data_dir))
        wait_until(lambda: min(segments(a.data_dir)) > first, 60, "the leader deletes segments")
        leader_start = min(segments(a.data_dir))

        rounds = itertools.count()

        def in_step() -> bool:
            send(addr(a.address), f"n{next(rounds)}", 5)  # RETAINED rides a growth
            return min(segments(b.data_dir)) >= leader_start

        wait_until(in_step, 60, "the follower deletes what the leader deleted")
        assert "the leader's message_log begins at" in b.log_path.read_text()
        leader, follower = segments(a.data_dir), segments(b.data_dir)
        common = max(min(leader), min(follower))
        shared = [base for base in sorted(follower) if base >= common and base in leader]
        assert shared, "the copies share segments"
        for base in shared[:-1]:  # the last may be growing on either
            assert follower[base] == leader[base]
    finally:
        group.close()


DELAY_MS = 8_000  # due after the wipe, the snapshot and the failover


def send_checked(address: str, history: History, prefix: str, count: int) -> None:
    with delayd.Producer(address, timeout_s=10) as producer:
        for i in range(count):
            message_id = f"{prefix}-{i}"
            history.sent(message_id, now_ms() + DELAY_MS)
            receipt = producer.send("orders", b"x" * 100, message_id=message_id, delay_ms=DELAY_MS)
            assert receipt.ok, receipt
            history.acked(message_id, receipt.due_ms)
            if i % 25 == 0:
                cancelled = producer.cancel(message_id)
                assert cancelled.cancelled, cancelled
                history.cancel(message_id, "CANCELLED")


def installed_snapshots(group: Group, process: ServeProcess) -> float | None:
    """The member's count of installed snapshots, from the metrics address it
    registered (the start after an install bound new ports)."""
    members = state(group.etcd_url, group.name).members
    mine = [m for m in members if m.member_id == member_id(process)]
    if not mine or not mine[0].metrics:
        return None
    host, port = mine[0].metrics.rsplit(":", 1)
    process.metrics_address = (host, int(port))
    return process.metrics().get('delayd_replication_snapshots_total{outcome="installed"}')


def test_a_wiped_member_is_brought_back_by_a_snapshot_and_leads(
    tmp_path: Path, etcd_server: EtcdServer
):
    """b's disk is wiped after a deleted message_log segments b had copied: b cannot
    copy them again, so a sends it a snapshot of its state (replay checkpoint,
    schedule_log, message_log from where a's begins); b installs it, copies the rest,
    joins the in-sync set and, a killed, leads and delivers every acknowledged message
    (those only in the snapshot's schedule_log too), none early, none twice, none
    cancelled."""
    group = Group(tmp_path, etcd_server.url, env=retention_env())
    try:
        a, b = in_sync_pair(group)
        history = History()
        send_checked(addr(a.address), history, "m", 100)
        wait_until(lambda: min(segments(a.data_dir)) > 0, 60, "the leader deletes segments")
        b.kill()
        shutil.rmtree(b.data_dir)
        assert b.address is not None
        b = member(group, b.data_dir, "--listen", addr(b.address), env=retention_env()).start()
        installed = lambda: "installed a snapshot of the leader" in b.log_path.read_text()  # noqa: E731
        wait_until(installed, 60, "the wiped member installs a snapshot of the leader's state")
        assert "snapshot sent to member" in a.log_path.read_text()
        assert a.metrics()['delayd_replication_snapshots_total{outcome="sent"}'] >= 1
        wait_until(lambda: installed_snapshots(group, b) == 1, 30, "b counts the install")
        assert min(segments(b.data_dir)) > 0  # it begins where the leader's copy did
        # Acknowledged under ack = sync: b holds them, and everything before, durable.
        send_checked(addr(a.address), history, "n", 10)
        both = {member_id(a), member_id(b)}
        assert state(group.etcd_url, group.name).in_sync == both

        a.kill()
        wait_until(lambda: group.leader_id() == member_id(b), 30, "the resynced member leads")
        # Under ack = sync a lone leader stores nothing its consumers may read: the old
        # leader returns (a new port, a new member) and follows.
        a.start()
        follows = lambda: state(group.etcd_url, group.name).role_of(member_id(a)) == "follower"  # noqa: E731
        wait_until(follows, 30, "the old leader follows")
        # The start after the install bound a new broker port: the one b registered.
        leader = state(group.etcd_url, group.name).leader
        assert leader is not None
        host, port = leader.broker.rsplit(":", 1)
        expected = {m for m, fate in history.fates.items() if not fate.cancelled}
        received = consume((host, int(port)), len(expected), timeout_s=30)
        history.seen_all(r.sighting("check", committed=True) for r in received)
        check(history, due_by_ms=now_ms()).assert_clean()
        assert {r.message_id for r in received} == expected
    finally:
        group.close()


def bucket_files(data_dir: Path) -> set[str]:
    found = set()
    for directory in (layout.schedule_log_dir, layout.dispatch_log_dir):
        path = Path(directory(str(data_dir)))
        found |= {f"{path.name}/{p.name}" for p in path.iterdir()} if path.is_dir() else set()
    return found


def test_the_follower_deletes_a_bucket_when_it_replays_the_leaders_retirement(
    tmp_path: Path, etcd_server: EtcdServer
):
    """The first leader holds messages received an hour ago (its message_log written
    here, as a server's): the first of their buckets is delivered at once, complete and
    old enough with ``bucket_ms = 0``. Its retirement reaches the follower in message_log, and the
    follower's replay deletes its copies of the bucket's files."""
    received_ms = int(time.time() * 1000) - 3_600_000
    # Ten in one bucket, ten two minutes later: the loader moves on past the first (the
    # bucket it loaded last is kept).
    dues = [received_ms] * 10 + [received_ms + 120_000] * 10
    with SegmentedLog.open(layout.message_log_dir(str(tmp_path / "a"))) as log:
        records = [
            MessageRecord(due, i + 1, received_ms, f"old-{i}", "orders", body=b"x")
            for i, due in enumerate(dues)
        ]
        log.append_batch(list(map(message_log.encode_record, records)), message_log.TYPE_MESSAGE)
    old = bucket_name(bucket_of(received_ms, 1))
    env = steady({**retention_env(), "DELAYD_RETENTION_BUCKET_MS": "0"})
    group = Group(tmp_path, etcd_server.url, env=env)
    try:
        a, b = in_sync_pair(group)
        names = {f"schedule_log/{old}", f"dispatch_log/{old}"}
        wait_until(lambda: not names & bucket_files(a.data_dir), 45, "the leader retires it")
        wait_until(lambda: not names & bucket_files(b.data_dir), 45, "the follower deletes it")
        for member in (a, b):
            with SegmentedLog.open(layout.message_log_dir(str(member.data_dir))) as copy:
                kinds = [r.type for r in copy.iter_from(copy.min_offset)]
            assert kinds.count(message_log.TYPE_RETIRE_BUCKET) == 1
            assert "retention: deleted 1 complete bucket(s)" in member.log_path.read_text()
    finally:
        group.close()
