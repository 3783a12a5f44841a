"""The data path wired into ``delayd serve`` (docs/replication.md), with real processes
and a real etcd: a follower holds the leader's message_log byte for byte once sends,
cancels and reschedules are acknowledged (ack = sync), takes over after a kill -9 of the
leader and delivers every acknowledged message once, not early (nor before the time a
reschedule moved it to), and none it answered CANCELLED; the old leader comes back as a
follower and copies what the group wrote meanwhile."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import trio

import delayd
from delayd.logs import layout
from delayd.logs.dispatch_log import EntryKind, decode_records
from delayd.protocol import Error, ErrorCode, Message, SendBatch, Stats, StatsResult
from storage.errors import StorageError
from storage.fs import O_READ, REAL_FS
from storage.scan import BadFrame, scan_frames
from tests.delivery_support import consume, now_ms
from tests.etcd_support import EtcdProxy, EtcdServer
from tests.fault_checker import History, check
from tests.intake_support import RawClient, ServeProcess
from tests.test_cluster_roles import (
    LEASE_TTL_MS,
    Group,
    addr,
    member_id,
    state,
    steady,
    wait_until,
)

pytestmark = pytest.mark.slow

COUNT = 200
DELAY_MS = 6_000  # due after the kill and the takeover: the new leader delivers them all
MOVE_MS = 3_000  # rescheduled this much later: delivered early if the move were lost


def sync_env() -> dict[str, str]:
    return {
        "DELAYD_CLUSTER_REPLICATION_LISTEN": "127.0.0.1:0",
        "DELAYD_CLUSTER_LEASE_TTL_MS": str(LEASE_TTL_MS),
        "DELAYD_CLUSTER_ACK": "sync",
    }


def message_log_bytes(data_dir: Path) -> bytes:
    """message_log's segments (the files named by their base offset), in order,
    concatenated."""
    directory = Path(layout.message_log_dir(str(data_dir)))
    segments = sorted(p for p in directory.iterdir() if p.name.isdigit())
    return b"".join(p.read_bytes() for p in segments)


def dispatch_log_bytes(data_dir: Path) -> bytes:
    """Every dispatch_log bucket file, in order, concatenated."""
    directory = Path(layout.dispatch_log_dir(str(data_dir)))
    if not directory.exists():
        return b""
    return b"".join(p.read_bytes() for p in sorted(directory.iterdir()))


def dispatched(data_dir: Path) -> int:
    """How many DISPATCHED entries the member's dispatch_log holds (0 while a file
    ends in a record still being written)."""
    directory = Path(layout.dispatch_log_dir(str(data_dir)))
    count = 0
    for path in sorted(directory.iterdir()) if directory.exists() else ():
        fd = REAL_FS.open(str(path), O_READ)
        try:
            records = scan_frames(REAL_FS, fd, str(path), 0, 0, REAL_FS.fsize(fd))
            entries = decode_records(records, str(path))
            count += sum(entry.kind is EntryKind.DISPATCHED for entry in entries)
        except (BadFrame, StorageError):
            return 0
        finally:
            REAL_FS.close(fd)
    return count


def sync_group(tmp_path: Path, etcd_url: str) -> Group:
    return Group(tmp_path, etcd_url, env=sync_env())


# The waits below follow process starts, elections and catching up: seconds each on
# a loaded machine, so 20 s (they return as soon as the condition holds).


def in_sync_pair(
    group: Group, first_env: dict[str, str] | None = None
) -> tuple[ServeProcess, ServeProcess]:
    """A leader and a follower of ``group``, the follower in the in-sync set; the
    leader started with ``first_env`` when given (else the group's)."""
    if first_env is None:
        a, b = group.start_pair()
    else:
        a = member(group, group.tmp_path / "a", env=first_env).start()
        wait_until(lambda: group.leader_id() == member_id(a), 20, "the first member leads")
        b = group.start("b")
    both = {member_id(a), member_id(b)}
    in_set = lambda: state(group.etcd_url, group.name).in_sync == both  # noqa: E731
    wait_until(in_set, 20, "the follower joins the in-sync set")
    return a, b


def stats(process: ServeProcess) -> dict:
    assert process.address is not None
    client = RawClient(process.address)
    try:
        answer = client.request(lambda rid: Stats(request_id=rid))
    finally:
        client.close()
    assert isinstance(answer, StatsResult), answer
    return answer.stats


def member(
    group: Group, data_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> ServeProcess:
    """A member of ``group`` on ``data_dir`` (not started), closed with the group."""
    process = ServeProcess(
        data_dir, "--etcd", group.etcd_url, "--group", group.name, *extra, env=env or sync_env()
    )
    group.processes.append(process)
    return process


def send_all(address: str, history: History, prefix: str, count: int) -> None:
    # Under ack = sync the first send may wait for a follower just started to copy
    # everything (seconds on a loaded machine): a generous time-out.
    with delayd.Producer(address, timeout_s=30) as producer:
        for i in range(count):
            send_one(producer, history, f"{prefix}-{i}")


def send_one(producer: delayd.Producer, history: History, message_id: str) -> None:
    """One message due in DELAY_MS, recorded sent and acknowledged."""
    history.sent(message_id, now_ms() + DELAY_MS)
    receipt = producer.send("orders", b"x" * 50, message_id=message_id, delay_ms=DELAY_MS)
    assert receipt.ok, receipt
    history.acked(message_id, receipt.due_ms)


def test_the_follower_copies_takes_over_after_kill_9_and_the_old_leader_follows(
    tmp_path: Path, etcd_server: EtcdServer
):
    group = sync_group(tmp_path, etcd_server.url)
    try:
        a, b = in_sync_pair(group)
        history = History()
        cancelled = {f"m-{i}" for i in range(0, COUNT, 20)}
        moved = {f"m-{i}" for i in range(10, COUNT, 20)}
        # Each cancel or reschedule right after its message's send: one request before
        # it is due in DELAY_MS, however long the whole series takes on a loaded machine
        # (a cancel that came after the due time would find it delivered).
        with delayd.Producer(f"{addr(a.address)},{addr(b.address)}", timeout_s=10) as producer:
            for message_id in (f"m-{i}" for i in range(COUNT)):
                send_one(producer, history, message_id)
                if message_id in cancelled:
                    receipt = producer.cancel(message_id)
                    assert receipt.cancelled, receipt
                    history.cancel(message_id, "CANCELLED")
                elif message_id in moved:
                    receipt = producer.reschedule(message_id, delay_ms=DELAY_MS + MOVE_MS)
                    assert receipt.rescheduled, receipt
                    history.reschedule(message_id, "RESCHEDULED", receipt.at_ms)
        # Acknowledged under ack = sync: the follower has every byte durable already.
        copied = message_log_bytes(b.data_dir)
        assert copied == message_log_bytes(a.data_dir)
        assert copied.count(b"m-199") == 1 and copied.count(b"m-180") == 2  # and its cancel
        # A cancel or reschedule is answered once the entry that decided it is the
        # group's: the follower holds the leader's dispatch_log (it wrote none itself).
        decided = dispatch_log_bytes(a.data_dir)
        assert decided != b""  # the leader's CANCELLED and RESCHEDULED entries
        assert dispatch_log_bytes(b.data_dir) == decided
        shown = stats(a)
        assert shown["replication.in_sync_followers"] == 1
        assert shown["replication.acked_offset_bytes"] == len(copied)
        assert shown[f"replication.lag_bytes/{member_id(b)}"] == 0
        scraped = a.metrics()  # the same figures on /metrics (delayd.replication.metrics)
        assert scraped["delayd_replication_in_sync_members"] == 1
        lag = f'delayd_replication_follower_lag_bytes{{member="{member_id(b)}"}}'
        assert scraped[lag] == 0

        a.kill()
        wait_until(lambda: group.leader_id() == member_id(b), 20, "the follower leads")
        # The follower derived the tombstones only; promoted, it decided them again.
        took_over = f"{len(cancelled) + len(moved)} cancels and reschedules decided again"
        wait_until(lambda: took_over in b.log_path.read_text(), 20, "the new leader takes over")
        # A producer's retry across the failover: the copied id is held, not stored again.
        with delayd.Producer(addr(b.address), timeout_s=10) as producer:
            retry = producer.send("orders", b"x" * 50, message_id="m-7", delay_ms=DELAY_MS)
        assert retry.code is delayd.ResultCode.DUPLICATE, retry
        # The old leader comes back (a new process, a new member id: its address) and
        # follows; acks of the new leader wait for it (min_in_sync = 1).
        a.start()
        wait_until(
            lambda: state(group.etcd_url, group.name).role_of(member_id(a)) == "follower",
            20,
            "the old leader follows",
        )
        send_all(addr(b.address), history, "n", 20)
        assert message_log_bytes(a.data_dir) == message_log_bytes(b.data_dir)

        assert b.broker_address is not None
        received = consume(b.broker_address, COUNT - len(cancelled) + 20, timeout_s=30)
        history.seen_all(r.sighting("check", committed=True) for r in received)
        report = check(history, due_by_ms=now_ms())
        report.assert_clean()
        expected = {f"m-{i}" for i in range(COUNT)} - cancelled | {f"n-{i}" for i in range(20)}
        assert {r.message_id for r in received} == expected
    finally:
        group.close()


def test_acks_wait_for_the_follower_under_sync(tmp_path: Path, etcd_server: EtcdServer):
    """A lone member under ack = sync has no follower to count: its acks wait, and
    come once a follower joined and copied the records."""
    group = Group(tmp_path, etcd_server.url, env=steady(sync_env()))  # no failover here
    try:
        a = group.start("a")
        wait_until(lambda: group.leader_id() == member_id(a), 20, "the first member leads")
        answered: list[object] = []

        def send() -> None:
            with delayd.Producer(addr(a.address), timeout_s=30) as producer:
                answered.append(producer.send("orders", b"x", message_id="w-1", delay_ms=60_000))

        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(1.0)
        assert answered == []  # no follower: not acknowledged
        b = group.start("b")
        sender.join(30)  # b's start, registration and copy
        assert answered and answered[0].ok  # type: ignore[attr-defined]
        assert message_log_bytes(b.data_dir) == message_log_bytes(a.data_dir)
    finally:
        group.close()


def test_a_returning_old_leader_cuts_its_unacknowledged_tail(
    tmp_path: Path, etcd_server: EtcdServer
):
    """The old leader acked a tail under ack = leader that its follower never got (the
    follower was down); the follower comes back under its own id, still in the set, and
    leads; the old leader returns, is cut back to what the group has, drops what it had
    derived from the cut records and replays (a start of its own), then follows."""
    group = sync_group(tmp_path, etcd_server.url)
    try:
        a, b = in_sync_pair(group, first_env={**sync_env(), "DELAYD_CLUSTER_ACK": "leader"})
        history = History()
        send_all(addr(a.address), history, "m", 20)
        wait_until(
            lambda: message_log_bytes(b.data_dir) == message_log_bytes(a.data_dir),
            20,
            "the follower has the first sends",
        )

        b.kill()
        # Acked by the leader alone; killed before it can drop b from the set.
        with delayd.Producer(addr(a.address), timeout_s=5) as producer:
            for i in range(5):
                assert producer.send("orders", b"t", message_id=f"t-{i}", delay_ms=DELAY_MS).ok
        a.kill()
        assert b"t-4" in message_log_bytes(a.data_dir)

        assert b.address is not None
        # The same address, so the same member id: it is in the set.
        b_again = member(group, b.data_dir, "--listen", addr(b.address)).start()
        wait_until(lambda: group.leader_id() == member_id(b_again), 20, "b leads again")

        assert a.address is not None
        # The same address: its start again (after the cut) binds it again.
        a = member(group, a.data_dir, "--listen", addr(a.address))
        a.start()  # cut back: what it derived from the tail is removed, it starts again
        restarted = lambda: "starting again" in a.log_tail()  # noqa: E731
        wait_until(restarted, 20, "the old leader starts again")
        assert "derived state removed, message_log cut, starting again" in a.log_path.read_text()
        wait_until(
            lambda: state(group.etcd_url, group.name).role_of(member_id(a)) == "follower",
            20,
            "the old leader follows",
        )
        send_all(addr(b_again.address), history, "n", 5)
        assert message_log_bytes(a.data_dir) == message_log_bytes(b_again.data_dir)
        assert b"t-0" not in message_log_bytes(a.data_dir)
    finally:
        group.close()


async def start_leading_through(group, proxy: EtcdProxy):
    """Start member "a", reaching etcd through ``proxy`` (so the test can cut it), and
    wait until it leads."""
    a = await trio.to_thread.run_sync(group.start, "a", proxy.url)
    with trio.fail_after(20):
        while await trio.to_thread.run_sync(group.leader_id) != member_id(a):
            await trio.sleep(0.02)
    return a


async def test_a_leader_that_steps_down_while_an_ack_waits_answers_not_leader(
    tmp_path: Path, etcd_server: EtcdServer, nursery: trio.Nursery
):
    """A lone member under ack = sync holds the answer (no follower has the record);
    cut from etcd it steps down, and the held answer is NOT_LEADER, never an ack."""
    proxy = EtcdProxy(etcd_server.url)
    await nursery.start(proxy.serve)
    group = sync_group(tmp_path, etcd_server.url)
    try:
        a = await start_leading_through(group, proxy)
        assert a.address is not None
        client = await trio.to_thread.run_sync(RawClient, a.address)
        message = Message("held-1", "orders", body=b"x", delay_ms=60_000)
        await trio.to_thread.run_sync(client.send, lambda rid: SendBatch([message], request_id=rid))
        await trio.sleep(0.5)
        proxy.cut()
        with trio.fail_after(LEASE_TTL_MS / 1000 + 2):
            answer = await trio.to_thread.run_sync(client.receive)
        assert isinstance(answer, Error) and answer.code is ErrorCode.NOT_LEADER, answer
        client.close()
    finally:
        await trio.to_thread.run_sync(group.close)


def test_a_wiped_follower_copies_everything_again(tmp_path: Path, etcd_server: EtcdServer):
    group = Group(tmp_path, etcd_server.url, env=steady(sync_env()))  # the leader stays
    try:
        a, b = group.start_pair()
        history = History()
        send_all(addr(a.address), history, "m", 30)
        b.kill()
        shutil.rmtree(b.data_dir)
        assert b.address is not None
        # The same address (the same member id) on an empty disk: no history, so the
        # leader has it start from nothing, and acks wait until it has it all again.
        b_again = member(group, b.data_dir, "--listen", addr(b.address)).start()
        send_all(addr(a.address), history, "n", 5)
        copied = message_log_bytes(b_again.data_dir)
        assert copied == message_log_bytes(a.data_dir)
        assert b"m-0" in copied and b"n-4" in copied
    finally:
        group.close()


async def test_a_leader_cut_from_etcd_follows_the_new_leader_in_process(
    tmp_path: Path, etcd_server: EtcdServer, nursery: trio.Nursery
):
    """Demotion without a restart: the leader, cut from etcd, steps down; the follower
    leads; once the cut heals the old leader follows it (same process) and copies what
    it takes, and acks wait for it."""
    proxy = EtcdProxy(etcd_server.url)
    await nursery.start(proxy.serve)
    group = sync_group(tmp_path, etcd_server.url)
    try:
        a = await start_leading_through(group, proxy)
        b = await trio.to_thread.run_sync(group.start, "b")
        both = {member_id(a), member_id(b)}
        with trio.fail_after(20):
            while (
                await trio.to_thread.run_sync(state, group.etcd_url, group.name)
            ).in_sync != both:
                await trio.sleep(0.02)
        history = History()
        await trio.to_thread.run_sync(send_all, addr(a.address), history, "m", 20)

        proxy.cut()
        with trio.fail_after(20):
            while await trio.to_thread.run_sync(group.leader_id) != member_id(b):
                await trio.sleep(0.05)
        proxy.heal()
        with trio.fail_after(20):
            while (await trio.to_thread.run_sync(state, group.etcd_url, group.name)).role_of(
                member_id(a)
            ) != "follower":
                await trio.sleep(0.05)
        await trio.to_thread.run_sync(send_all, addr(b.address), history, "n", 10)
        copied = message_log_bytes(a.data_dir)
        assert copied == message_log_bytes(b.data_dir)
        assert b"n-9" in copied
        assert a.proc is not None and a.proc.poll() is None  # the same process
    finally:
        await trio.to_thread.run_sync(group.close)


def test_the_new_leader_does_not_deliver_again_what_the_old_one_delivered(
    tmp_path: Path, etcd_server: EtcdServer
):
    """dispatch_log is shipped: the follower holds the leader's DISPATCHED entries, so
    after a kill -9 of the leader it delivers only what the old one had not; its
    embedded broker, replicated with it, holds the old leader's messages once each."""
    group = sync_group(tmp_path, etcd_server.url)
    try:
        a, b = in_sync_pair(group)
        history = History()
        early = 30
        with delayd.Producer(addr(a.address), timeout_s=10) as producer:
            for i in range(early):
                history.sent(f"d-{i}", now_ms() + 300)
                receipt = producer.send("orders", b"d", message_id=f"d-{i}", delay_ms=300)
                assert receipt.ok, receipt
                history.acked(f"d-{i}", receipt.due_ms)
        assert a.broker_address is not None
        delivered = consume(a.broker_address, early, timeout_s=30)
        history.seen_all(r.sighting("check", committed=True) for r in delivered)
        # The leader's DISPATCHED entries, durable, reach the follower byte for byte.
        copied = lambda: dispatched(b.data_dir) == early  # noqa: E731
        wait_until(copied, 20, "the follower has the leader's dispatch_log")
        assert dispatch_log_bytes(b.data_dir) == dispatch_log_bytes(a.data_dir)

        a.kill()
        wait_until(lambda: group.leader_id() == member_id(b), 20, "the follower leads")
        a.start()  # acks of the new leader wait for a follower (min_in_sync = 1)
        wait_until(
            lambda: state(group.etcd_url, group.name).role_of(member_id(a)) == "follower",
            20,
            "the old leader follows",
        )
        later = 10
        send_all(addr(b.address), history, "e", later)
        assert b.broker_address is not None
        # A new consumer group reads the new leader's broker from its start: the old
        # leader's 30 (copied with its commitlog) and the 10 sent after, each once.
        received = consume(b.broker_address, early + later, group="after", timeout_s=30)
        history.seen_all(r.sighting("after", committed=True) for r in received)
        expected = [f"d-{i}" for i in range(early)] + [f"e-{i}" for i in range(later)]
        assert sorted(r.message_id for r in received) == sorted(expected)
        wait_until(
            lambda: dispatched(b.data_dir) == early + later, 10, "the new leader records its sends"
        )
        check(history, due_by_ms=now_ms()).assert_clean()
    finally:
        group.close()
