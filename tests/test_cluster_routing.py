"""Producers over every delay group of a cluster (``etcd://H:P/CLUSTER/*``), with real
``delayd serve`` processes (one single-member group each) on a real etcd: ids spread
over the groups, a retry lands where the first try went, cancels and reschedules find
their message wherever it is; a group added while producing takes new ids and old ids'
cancels are still honoured; a drained group takes no new id, still answers and
delivers, and is retired only once empty; a group that is down keeps its ids (its
sends fail) and nothing goes elsewhere. The checker runs over what was produced and
consumed from every group's broker: 0 lost, 0 early, 0 twice, every cancel honoured."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

import delayd
from delayd.client._blocking_cluster_producer import ClusterProducer
from delayd.client._cluster_view import read_delay_groups
from delayd.client._routing import DelayGroups
from delayd.errors import DelaydTimeout
from delayd.group_address import parse_group_address
from delayd.protocol import CancelOutcome, RescheduleOutcome, ResultCode
from tests.delivery_support import consume, now_ms, serve_stats
from tests.etcd_support import EtcdServer
from tests.fault_checker import History, check
from tests.intake_support import ServeProcess
from tests.process_support import DELAYD, ROOT, child_env, free_port
from tests.test_cluster_roles import member_env, steady, wait_until

pytestmark = pytest.mark.slow

DELAY_MS = 3_000


class Cluster:
    """Single-member delay groups of a fresh cluster on the session's etcd."""

    def __init__(self, tmp_path: Path, etcd: EtcdServer) -> None:
        self.name = f"c{uuid.uuid4().hex[:10]}"
        self.etcd_url = etcd.url
        self.address = f"etcd://{etcd.url.removeprefix('http://')}/{self.name}/*"
        self.tmp_path = tmp_path
        self.members: dict[str, ServeProcess] = {}
        # A lease no loaded machine makes a leader step down from; a test that kills a
        # member and waits for its keys to expire sets member_env()'s 1 s one.
        self.env = steady(member_env())

    def start(self, group: str) -> ServeProcess:
        member = self.members.get(group) or ServeProcess(
            self.tmp_path / group,
            "--etcd", self.etcd_url, "--group", group, "--cluster", self.name,
            # A fixed port: a member restarted is the same member (its id is its address),
            # still in its group's in-sync set.
            "--listen", f"127.0.0.1:{free_port()}",
            env=self.env, http_listen="127.0.0.1:0",
        )  # fmt: skip
        self.members[group] = member
        member.start()
        wait_until(lambda: group in self.groups().lookup, 10, f"{group} registers")
        return member

    def groups(self) -> DelayGroups:
        return trio.run(read_delay_groups, parse_group_address(self.address))

    def accepted(self, group: str) -> int:
        address = self.members[group].address
        assert address is not None
        return int(serve_stats(address)["intake.accepted_total"])

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*DELAYD, "cluster", *args, "--etcd", self.etcd_url, "--cluster", self.name],
            cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=30,
        )  # fmt: skip

    def command(self, *args: str) -> str:
        """``delayd COMMAND --server <the cluster> ARGS``; its stdout (it must succeed)."""
        done = subprocess.run(
            [*DELAYD, args[0], "--server", self.address, *args[1:]],
            cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.returncode == 0, f"delayd {args[0]} failed: {done.stderr}"
        return done.stdout

    def close(self) -> None:
        for member in self.members.values():
            member.close()


@pytest.fixture
def cluster(tmp_path: Path, etcd_server: EtcdServer) -> Iterator[Cluster]:
    made = Cluster(tmp_path, etcd_server)
    yield made
    made.close()


def messages(ids: list[str], delay_ms: int = DELAY_MS) -> list[dict]:
    return [{"subject": "orders", "body": b"x", "message_id": i, "delay_ms": delay_ms} for i in ids]


def send(
    producer: delayd.Producer, history: History, ids: list[str], delay_ms: int = DELAY_MS
) -> None:
    due_ms = now_ms() + delay_ms
    for message_id in ids:
        history.sent(message_id, due_ms)
    receipts = producer.send_batch(messages(ids, delay_ms))
    assert [r.message_id for r in receipts] == ids  # the caller's order
    for receipt in receipts:
        assert receipt.ok, receipt
        duplicate = receipt.code is ResultCode.DUPLICATE
        history.acked(receipt.message_id, receipt.due_ms or due_ms, duplicate=duplicate)


def cancel(producer: delayd.Producer, history: History, ids: list[str]) -> list[CancelOutcome]:
    receipts = producer.cancel_many(ids)
    for receipt in receipts:
        history.cancel(receipt.message_id, receipt.outcome.name)
    return [r.outcome for r in receipts]


def consume_all(cluster: Cluster, history: History) -> None:
    """Everything every group's broker holds, once the last due time has passed."""
    for group, member in cluster.members.items():
        assert member.broker_address is not None
        for received in consume(member.broker_address, 0, group=f"check-{group}"):
            history.seen(received.sighting(group, committed=True))


def test_ids_spread_over_the_groups_and_every_lookup_finds_its_message(cluster: Cluster):
    cluster.start("d1")
    cluster.start("d2")
    history = History()
    ids = [f"a-{i}" for i in range(300)]
    # Those cancelled, moved or looked up below are due in a minute: still pending after
    # the calls before them, however long a loaded machine takes (two are commands).
    acted_on = [*ids[:50], ids[60], ids[100]]
    with delayd.Producer(cluster.address, timeout_s=20) as producer:
        assert isinstance(producer, delayd.Producer)
        send(producer, history, [i for i in ids if i not in acted_on])
        send(producer, history, acted_on, delay_ms=60_000)
        counts = {g: cluster.accepted(g) for g in ("d1", "d2")}
        assert sum(counts.values()) == 300 and min(counts.values()) > 100, counts
        # A retry lands where the first try went: every id answered DUPLICATE there.
        again = producer.send_batch(messages(ids, 60_000))
        assert {r.code for r in again} == {ResultCode.DUPLICATE}
        assert {g: cluster.accepted(g) for g in ("d1", "d2")} == counts
        assert set(cancel(producer, history, ids[:50])) == {CancelOutcome.CANCELLED}
        assert cancel(producer, history, ["never-sent"]) == [CancelOutcome.UNKNOWN]
        moved = producer.reschedule(ids[60], delay_ms=DELAY_MS + 1000)
        assert moved.outcome is RescheduleOutcome.RESCHEDULED
        history.reschedule(ids[60], moved.outcome.name, moved.at_ms)
        assert producer.reschedule("never-sent", delay_ms=1).outcome is RescheduleOutcome.UNKNOWN
    # Over HTTP: `delayd cluster route` names the owner, whose leader knows the id.
    shown = cluster.cli("route", ids[100]).stdout.splitlines()
    assert re.fullmatch(rf"{ids[100]}  d\d http 127.0.0.1:\d+ intake 127.0.0.1:\d+", shown[0])
    assert re.fullmatch(r" +d\d http 127.0.0.1:\d+ intake 127.0.0.1:\d+", shown[1])
    (route,) = json.loads(cluster.cli("route", ids[100], "--json").stdout)["routes"]
    assert sorted(a["group"] for a in route["ask"]) == ["d1", "d2"]
    owner, other = route["ask"]
    assert owner["group"] == route["owner"] == DelayGroups(("d1", "d2"), ()).owner(ids[100])
    assert http_status(owner["http"], ids[100]) == "pending"
    assert http_status(other["http"], ids[100]) == 404
    time.sleep((DELAY_MS + 2500) / 1000)
    consume_all(cluster, history)
    check(history, due_by_ms=now_ms() - 1000).assert_clean()


def test_the_docs_example_runs_against_a_cluster(cluster: Cluster):
    cluster.start("d1")
    cluster.start("d2")
    text = (ROOT / "docs" / "cluster.md").read_text()
    marker = text.index("<!-- tests/test_cluster_routing.py runs this example")
    (block,) = re.findall(r"```python\n(.*?)```", text[marker:], re.S)[:1]
    assert '"etcd://10.0.0.9:2379/prod/*"' in block
    done = subprocess.run(
        [sys.executable, "-c", block.replace("etcd://10.0.0.9:2379/prod/*", cluster.address)],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["CANCELLED"]


def http_status(http: str, message_id: str) -> str | int:
    """The status the HTTP API at ``http`` gives ``message_id``, or its HTTP error."""
    try:
        with urllib.request.urlopen(f"http://{http}/v1/messages/{message_id}", timeout=10) as got:
            return json.loads(got.read())["status"]
    except urllib.error.HTTPError as exc:
        return exc.code


async def test_the_async_producer_routes_and_finds_the_same_way(cluster: Cluster):
    for group in ("d1", "d2"):
        await trio.to_thread.run_sync(cluster.start, group)  # it reads etcd in a trio run
    ids = [f"b-{i}" for i in range(100)]
    async with delayd.open_producer(cluster.address, timeout_s=20) as producer:
        receipts = await producer.send_batch(messages(ids, 60_000))
        assert [r.message_id for r in receipts] == ids and all(r.ok for r in receipts)
        cancelled = await producer.cancel_many([*ids[:10], "never-sent"])
        assert [r.outcome for r in cancelled] == [CancelOutcome.CANCELLED] * 10 + [
            CancelOutcome.UNKNOWN
        ]
        moved = await producer.reschedule(ids[20], delay_ms=90_000)
        assert moved.outcome is RescheduleOutcome.RESCHEDULED
    assert min(cluster.accepted("d1"), cluster.accepted("d2")) > 25
    cluster.members["d2"].kill()
    owners = DelayGroups(("d1", "d2"), ())
    on_d1 = [i for i in ids[50:] if owners.owner(i) == "d1"]
    on_d2 = [i for i in ids[50:] if owners.owner(i) == "d2"]
    async with delayd.open_producer(cluster.address, timeout_s=2) as producer:
        # d2's part fails naming d2, d1's part is stored all the same
        with pytest.raises(DelaydTimeout, match=f"{cluster.name}/d2"):
            await producer.cancel_many([*on_d1, *on_d2])
        with pytest.raises(DelaydTimeout, match=f"{cluster.name}/d2"):
            await producer.cancel(f"{on_d2[0]}")
    async with delayd.open_producer(cluster.address, timeout_s=20) as producer:
        cancelled = await producer.cancel_many(on_d1)  # d1 answered the first time
        assert {r.outcome for r in cancelled} == {CancelOutcome.CANCELLED}


def test_a_group_added_and_one_drained_while_producing_lose_nothing(cluster: Cluster):
    cluster.start("d1")
    cluster.start("d2")
    history = History()
    old = [f"old-{i}" for i in range(200)]
    with delayd.Producer(cluster.address, timeout_s=20) as producer:
        send(producer, history, old)
        cluster.start("d3")
        producer.view.stale()  # rather than wait out the refresh interval
        before = cluster.accepted("d3")
        send(producer, history, [f"new-{i}" for i in range(200)])
        assert cluster.accepted("d3") - before > 40  # new ids reach the new group
        # Old ids the new group now owns are still found where they were stored (never
        # UNKNOWN; a loaded machine may have taken DELAY_MS since they were sent).
        now_owned_by_d3 = [i for i in old if producer.view.groups.owner(i) == "d3"]
        assert now_owned_by_d3
        found = {CancelOutcome.CANCELLED, CancelOutcome.ALREADY_DELIVERED}
        assert set(cancel(producer, history, now_owned_by_d3)) <= found

        drained = cluster.cli("drain", "d1")
        assert drained.returncode == 0 and "draining" in drained.stdout, drained.stderr
        producer.view.stale()
        held_by_d1 = cluster.accepted("d1")
        send(producer, history, [f"late-{i}" for i in range(200)])
        assert cluster.accepted("d1") == held_by_d1  # a draining group takes no new id
        d1_ids = [i for i in old if DelayGroups(("d1", "d2"), ()).owner(i) == "d1"]
        outcomes = cancel(producer, history, d1_ids[-20:])  # still answered by d1
        assert set(outcomes) <= found

        # This test resends no id of d1's: the resend window need not pass first.
        retire = ("retire", "d1", "--resend-window-s", "0")
        refused = cluster.cli(*retire)
        assert refused.returncode == 1 and "pending message(s)" in refused.stderr
        time.sleep((DELAY_MS + 2500) / 1000)  # d1 delivers what it holds
        wait_until(lambda: cluster.cli(*retire).returncode == 0, 15, "d1 retires")
        producer.view.stale()
        assert producer.view.groups is not None
        assert "d1" not in producer.delay_groups().lookup
    consume_all(cluster, history)
    check(history, due_by_ms=now_ms() - 1000).assert_clean()


def test_a_resend_after_the_active_groups_changed_is_a_duplicate(cluster: Cluster):
    """An application sends ids, a group is added, then one drained, and after each
    change it sends the same ids again in new calls (new producers, as after a crash):
    every resend is answered DUPLICATE with the held due time, each id is held by
    exactly one group, a cancel of each is honoured, the rest delivered once."""
    cluster.start("d1")
    cluster.start("d2")
    history = History()
    ids = [f"r-{i}" for i in range(200)]
    due_ms = now_ms() + RESEND_DELAY_MS
    with delayd.Producer(cluster.address, timeout_s=20) as producer:
        receipts = answered(history, producer.send_batch(resent(ids, history)))
        first = {r.message_id: r.due_ms for r in receipts}
    cluster.start("d3")
    accepted = {g: cluster.accepted(g) for g in ("d1", "d2", "d3")}
    with delayd.Producer(cluster.address, timeout_s=20) as producer:
        assert isinstance(producer, ClusterProducer)
        assert producer.delay_groups().active == ("d1", "d2", "d3")
        moved = [i for i in ids if producer.delay_groups().owner(i) == "d3"]
        again = answered(history, producer.send_batch(resent(ids, history)))
    assert len(moved) > 30  # ids the new group owns now: each would have been stored twice
    assert {r.code for r in again} == {ResultCode.DUPLICATE}
    assert {r.message_id: r.due_ms for r in again} == first
    # HTTP clients route by `delayd cluster route`: the same groups to ask first.
    (route,) = json.loads(cluster.cli("route", moved[0], "--json").stdout)["routes"]
    before = DelayGroups(("d1", "d2"), ()).owner(moved[0])
    assert route["owner"] == "d3" and route["previous_owners"] == [before]
    assert cluster.cli("drain", "d1").returncode == 0

    async def resend_async() -> list:
        async with delayd.open_producer(cluster.address, timeout_s=20) as producer:
            return answered(history, await producer.send_batch(resent(ids, history)))

    assert {r.code for r in trio.run(resend_async)} == {ResultCode.DUPLICATE}
    assert {g: cluster.accepted(g) for g in ("d1", "d2", "d3")} == accepted  # none stored again
    with delayd.Producer(cluster.address, timeout_s=20) as producer:
        assert set(cancel(producer, history, ids[::2])) == {CancelOutcome.CANCELLED}
    held = {}
    for group, member in cluster.members.items():
        assert member.address is not None
        with delayd.Producer("{}:{}".format(*member.address)) as one_group:
            held[group] = one_group.held(ids)
    assert all(sum(held[g][n] is not None for g in held) == 1 for n in range(len(ids)))
    with delayd.Producer(cluster.address) as producer:
        assert producer.held(ids) == [first[i] for i in ids]
    time.sleep(max(0.0, (due_ms - now_ms() + 1500) / 1000))
    consume_all(cluster, history)
    check(history, due_by_ms=now_ms() - 1000).assert_clean()


RESEND_DELAY_MS = 7_500
# The ids cancelled at the end (ids[::2]) are due in a minute: still pending after the
# group changes before the cancel, however long a loaded machine takes to start d3 and
# run the commands (a cancel that found one delivered would fail the test).
CANCELLED_DELAY_MS = 60_000


def resent(ids: list[str], history: History) -> list[dict]:
    """``ids`` as one batch, recorded in ``history`` as sent (``answered`` records the
    receipts); ids[::2] are due in CANCELLED_DELAY_MS, the rest in RESEND_DELAY_MS."""
    batch = []
    for index, message_id in enumerate(ids):
        delay_ms = CANCELLED_DELAY_MS if index % 2 == 0 else RESEND_DELAY_MS
        history.sent(message_id, now_ms() + delay_ms)
        batch += messages([message_id], delay_ms)
    return batch


def answered(history: History, receipts: list) -> list:
    for receipt in receipts:
        duplicate = receipt.code is ResultCode.DUPLICATE
        history.acked(receipt.message_id, receipt.due_ms, duplicate=duplicate)
    return receipts


def test_a_group_that_is_down_keeps_its_ids(cluster: Cluster):
    cluster.env = member_env()  # d2 comes back as itself once its old leader key expired
    cluster.start("d1")
    d2 = cluster.start("d2")
    d2.kill()
    owners = DelayGroups(("d1", "d2"), ("d1", "d2"))
    ids = [f"k-{i}" for i in range(40)]
    on_d2 = [i for i in ids if owners.owner(i) == "d2"]
    with delayd.Producer(cluster.address, timeout_s=2) as producer:
        with pytest.raises(DelaydTimeout, match=f"{cluster.name}/d2"):
            producer.send_batch(messages(ids, 60_000))
        assert cluster.accepted("d1") == len(ids) - len(on_d2)  # d2's ids went nowhere else
        with pytest.raises(DelaydTimeout, match=f"{cluster.name}/d2"):
            producer.cancel(on_d2[0])  # never a false UNKNOWN: d2 could not be asked
    # The same batch again while d2 is down, and the registry changes under the call
    # (d2 drained): the call's route stays pinned, its d2 part waits for d2.
    with delayd.Producer(cluster.address, timeout_s=30) as producer:
        producer.delay_groups()  # read before the change
        result: list = []
        call = threading.Thread(target=lambda: result.append(producer.send_batch(messages(ids))))
        call.start()
        assert cluster.cli("drain", "d2").returncode == 0
        producer.view.stale()  # as if the refresh interval ran out during the call
        time.sleep(0.5)
        cluster.start("d2")
        call.join(30)
        (receipts,) = result
        assert all(r.ok for r in receipts)
        assert cluster.accepted("d2") == len(on_d2)  # its ids reached it, late
        assert cluster.accepted("d1") == len(ids) - len(on_d2)  # and only it
        assert producer.delay_groups().active == ("d1",)  # the next call sees the drain


def test_cluster_status_shows_every_group_with_its_kind_and_status(cluster: Cluster):
    cluster.env = member_env()  # the killed d2's keys expire within a second
    cluster.start("d1")
    cluster.start("d2")
    assert cluster.cli("drain", "d2").returncode == 0
    refused = cluster.cli("drain", "d1")
    assert refused.returncode == 1 and "last active delay group" in refused.stderr
    # the commands take the cluster's address too: d1 is the only active group now
    sent = cluster.command("send", "--subject", "orders", "--delay", "60s", "--id", "cli-1", "x")
    assert json.loads(sent)["code"] == "OK" and cluster.accepted("d1") == 1
    sent = cluster.command("send", "--subject", "orders", "--delay", "60s", "--id", "cli-2", "x")
    moved = json.loads(cluster.command("reschedule", "--delay", "90s", "cli-2"))
    assert moved["outcome"] == "RESCHEDULED"
    assert json.loads(cluster.command("cancel", "cli-1"))["outcome"] == "CANCELLED"
    cluster.members["d2"].kill()

    def shown() -> dict[str, tuple[str, str, int]]:
        groups = json.loads(cluster.cli("status", "--json").stdout)["groups"]
        return {g["group"]: (g["kind"], g["status"], len(g["members"])) for g in groups}

    # a group whose members are all gone (their keys expired with their leases) is shown
    wait_until(lambda: shown()["d2"][2] == 0, 10, "d2's member key expires")
    assert shown() == {"d1": ("delay", "active", 1), "d2": ("delay", "draining", 0)}
    text = cluster.cli("status").stdout
    not_drained = cluster.cli("retire", "d1")
    assert not_drained.returncode == 1 and "d1 is active, not draining" in not_drained.stderr
    cannot_tell = cluster.cli("retire", "d2", "--resend-window-s", "0")
    assert cannot_tell.returncode == 1
    assert "cannot tell whether d2 is empty: group d2 has no leader now" in cannot_tell.stderr
    forced = cluster.cli("retire", "d2", "--force")
    assert forced.returncode == 0 and "WARNING: cannot tell whether d2 is empty" in forced.stderr
    assert "WARNING: d2 has been draining for" in forced.stderr  # the resend window too
    assert "delay group, draining" in text and "delay group, active" in text
    assert "group d2: leader none (no member up)" in text
    assert shown()["d2"][1] == "retired"
    assert cluster.cli("activate", "d2").stdout == "group d2 (delay): active\n"
    assert shown()["d2"][1] == "active"
    unknown = cluster.cli("drain", "nope")
    assert unknown.returncode == 1 and "the cluster has no group 'nope'" in unknown.stderr
    counts = Counter(line.split()[1] for line in text.splitlines() if line.startswith("group "))
    assert counts == {"d1:": 1, "d2:": 1}
