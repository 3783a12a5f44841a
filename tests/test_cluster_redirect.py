"""NOT_LEADER and the addresses of a group, without a cluster: the reason's leader field,
the error it becomes, the address forms, which member a client tries next, and clients
and the sender's broker targets following a scripted follower to its leader."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import pytest
import trio

import delayd
from delayd.client._async_link import AsyncLink
from delayd.client._backoff import Backoff
from delayd.client._blocking_cluster_producer import ClusterProducer
from delayd.client._blocking_session import BlockingSession
from delayd.client._leader import LeaderFinder
from delayd.cluster.config import ClusterConfig, cluster_from_environment
from delayd.cluster.members import cluster_prefix
from delayd.errors import NotLeaderError, RejectedError, UnreachableError
from delayd.group_address import GroupAddress, parse_group_address
from delayd.protocol import (
    PROTOCOL_VERSION,
    CancelOutcome,
    CancelResult,
    Error,
    ErrorCode,
    ResultCode,
    SendResult,
)
from delayd.protocol.answers import error_to_exception
from delayd.protocol.redirect import leader_in, not_leader_reason
from delayd.sender import RemoteTarget
from delayd.serving.membership import member_id_for
from tests.client_support import ScriptedServer, free_port
from tests.test_sender_targets import due, serve_scripted

# --------------------------------------------------------------------- the answer


def test_the_reason_names_the_leader_and_reads_back():
    reason = not_leader_reason("g1", "follower", 7, "10.0.0.2:20801")
    assert reason == "not the leader of group g1 (follower at epoch 7); leader=10.0.0.2:20801"
    assert leader_in(reason) == "10.0.0.2:20801"
    assert leader_in(not_leader_reason("g1", "follower", 7, "[::1]:20801")) == "[::1]:20801"
    unknown = not_leader_reason("g1", "candidate", None, None)
    assert unknown == "not the leader of group g1 (candidate); leader unknown"
    assert leader_in(unknown) is None
    assert leader_in("no field here") is None
    assert leader_in("x; leader=not-an-address") is None


def test_error_not_leader_becomes_a_not_leader_error():
    reason = not_leader_reason("g1", "follower", 3, "h2:1")
    exc = error_to_exception(
        Error(ErrorCode.NOT_LEADER, reason, request_id=4), "SEND_BATCH to h1:1"
    )
    assert isinstance(exc, NotLeaderError) and isinstance(exc, RejectedError)
    assert exc.leader == "h2:1" and exc.code is ErrorCode.NOT_LEADER
    assert not ErrorCode.NOT_LEADER.is_retryable  # followed, not retried in place
    assert ErrorCode.NOT_LEADER == 16


# --------------------------------------------------------------------- addresses


def test_address_forms():
    assert parse_group_address("h1:1").single == "h1:1"
    both = parse_group_address("h1:1, h2:2,h1:1")
    assert both == GroupAddress(members=("h1:1", "h2:2")) and both.single is None
    etcd = parse_group_address("etcd://10.0.0.9:2379,10.0.0.8:2379/orders")
    assert etcd.etcd == ("http://10.0.0.9:2379", "http://10.0.0.8:2379")
    assert etcd.group == "orders" and str(etcd) == "etcd://10.0.0.9:2379,10.0.0.8:2379/orders"
    assert etcd.cluster == "" and not etcd.whole_cluster


def test_cluster_address_forms():
    named = parse_group_address("etcd://10.0.0.9:2379/prod/orders")
    assert (named.cluster, named.group, named.whole_cluster) == ("prod", "orders", False)
    assert str(named) == "etcd://10.0.0.9:2379/prod/orders"
    every = parse_group_address("etcd://10.0.0.9:2379/*")
    assert (every.cluster, every.group, every.whole_cluster) == ("", "*", True)
    every_prod = parse_group_address("etcd://10.0.0.9:2379/prod/*")
    assert every_prod.whole_cluster and every_prod.cluster == "prod"
    assert str(every_prod) == "etcd://10.0.0.9:2379/prod/*"


def test_a_one_group_session_refuses_a_whole_cluster_address():
    with pytest.raises(ValueError, match="names every group of a cluster"):
        BlockingSession("etcd://10.0.0.9:2379/*", token=None, client_name="t")
    # a producer given one spreads its messages over the groups instead (docs/cluster.md)
    assert isinstance(delayd.Producer("etcd://10.0.0.9:2379/*"), ClusterProducer)


def test_cluster_names_map_to_key_prefixes():
    assert cluster_prefix("") == "/delayd"
    assert cluster_prefix("prod") == "/delayd/clusters/prod"
    with pytest.raises(ValueError, match="cluster name 'a/b'"):
        cluster_prefix("a/b")
    assert ClusterConfig(name="prod").prefix == "/delayd/clusters/prod"
    with pytest.raises(ValueError, match=r"cluster\.name"):
        ClusterConfig(name="*")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("h1:1,,h2:2", "empty member"),
        ("h1:1,h2", "has no port"),
        ("etcd://10.0.0.9:2379", "name the group"),
        ("etcd://10.0.0.9:2379/", "name the group"),
        ("etcd://10.0.0.9/g", "etcd endpoint"),
        ("etcd://10.0.0.9:2379/a/b/c", "name the group"),
        ("etcd://10.0.0.9:2379/*/g", "name the group"),
        ("etcd://10.0.0.9:2379/prod/", "name the group"),
        ("h1", "has no port"),
    ],
)
def test_bad_addresses_say_what_to_write(text, words):
    with pytest.raises(ValueError, match=words):
        parse_group_address(text)


def test_a_bad_member_list_is_refused_by_the_clients_at_once():
    with pytest.raises(ValueError, match="member list"):
        delayd.Producer("h1:1,nope")


# --------------------------------------------------------------------- who is tried next


def test_single_address_never_moves():
    finder = LeaderFinder(parse_group_address("h1:1"))
    assert finder.attempt() == "h1:1"
    finder.failed()
    finder.redirected(None)
    assert finder.current == "h1:1" and not finder.needs_lookup


def test_member_list_follows_the_named_leader_and_rotates_on_failure():
    finder = LeaderFinder(parse_group_address("h1:1,h2:2"))
    assert finder.attempt() == "h1:1"
    finder.redirected("h2:2")
    assert finder.attempt() == "h2:2"
    finder.redirected("h3:3")  # a leader the address did not list joins the candidates
    assert finder.candidates == ["h1:1", "h2:2", "h3:3"] and finder.attempt() == "h3:3"
    finder.failed()
    assert finder.current == "h1:1"
    assert finder.describe_tried() == "h1:1, h2:2, h3:3"
    finder.answered()
    assert finder.tried == []


def test_etcd_address_looks_up_again_when_a_member_fails():
    finder = LeaderFinder(parse_group_address("etcd://e:2379/g"))
    assert finder.needs_lookup and finder.current is None
    finder.learned(["h1:1", "h2:2"], "h2:2")
    assert not finder.needs_lookup and finder.attempt() == "h2:2"
    finder.redirected(None)
    assert finder.needs_lookup
    finder.learned([], None)
    assert finder.needs_lookup  # etcd named nobody: ask again


def test_redirects_wait_for_the_backoff_after_a_few_in_a_row():
    session = BlockingSession("h1:1,h2:2", token=None, client_name="t", backoff=Backoff())
    named = NotLeaderError(ErrorCode.NOT_LEADER, "x", "h2:2")
    session.redirect(named, 100.0)
    session.redirect(named, 100.0)
    assert session._backoff.wait_s(100.0) == 0  # followed at once
    session.redirect(named, 100.0)
    assert session._backoff.wait_s(100.0) > 0  # bouncing: the back-off spaces them
    session.succeeded()
    assert session._backoff.wait_s(100.0) == 0
    session.redirect(NotLeaderError(ErrorCode.NOT_LEADER, "x", None), 100.0)
    assert session._backoff.wait_s(100.0) > 0  # nobody named: wait before the next member


def test_member_id_is_the_address_in_key_form():
    assert member_id_for("127.0.0.1:20801") == "127.0.0.1-20801"
    assert member_id_for("[::1]:20801") == "1-20801"


# --------------------------------------------------------------------- [cluster]


def test_cluster_config_checks():
    assert not ClusterConfig().enabled
    with pytest.raises(ValueError, match=r"cluster\.group"):
        ClusterConfig(etcd=("http://e:2379",))
    with pytest.raises(ValueError, match=r"cluster\.etcd"):
        ClusterConfig(group="g")
    with pytest.raises(ValueError, match="not a URL"):
        ClusterConfig(etcd=("e:2379",), group="g")
    with pytest.raises(ValueError, match="whole number of seconds"):
        ClusterConfig(etcd=("http://e:2379",), group="g", lease_ttl_ms=1500)
    with pytest.raises(ValueError, match="advertise"):
        ClusterConfig(etcd=("http://e:2379",), group="g").advertised("0.0.0.0")
    config = ClusterConfig(etcd=("http://e:2379",), group="g", advertise="10.0.0.1")
    assert config.address_of("0.0.0.0", 20801) == "10.0.0.1:20801"


def test_cluster_keys_from_the_environment():
    config = cluster_from_environment(
        {
            "DELAYD_CLUSTER_ETCD": "http://a:2379,http://b:2379",
            "DELAYD_CLUSTER_GROUP": "g",
            "DELAYD_CLUSTER_LEASE_TTL_MS": "3000",
            "DELAYD_CLUSTER_ACK": "leader",
        }
    )
    assert config.etcd == ("http://a:2379", "http://b:2379") and config.lease_ttl_ms == 3000
    assert config.ack == "leader"
    with pytest.raises(ValueError, match="DELAYD_CLUSTER_ACK"):
        cluster_from_environment({"DELAYD_CLUSTER_ACK": "quorum"})
    with pytest.raises(ValueError, match=r"unknown key cluster\.grup"):
        cluster_from_environment({"DELAYD_CLUSTER_GRUP": "g"})


# --------------------------------------------------------------------- following NOT_LEADER


def _follower_of(leader: ScriptedServer):
    reason = not_leader_reason("g", "follower", 5, leader.addr)
    return lambda batch: Error(ErrorCode.NOT_LEADER, reason)


def test_blocking_producer_follows_the_named_leader_with_the_same_ids():
    with ScriptedServer() as leader, ScriptedServer(on_send=_follower_of(leader)) as follower:
        with delayd.Producer(f"{follower.addr},{leader.addr}", timeout_s=5) as producer:
            receipt = producer.send("s", b"x", message_id="m-1")
        assert receipt.code is ResultCode.OK
        assert [b.messages[0].message_id for b in follower.batches] == ["m-1"]
        assert list(leader.stored) == ["m-1"]


async def test_async_producer_follows_a_leader_the_address_did_not_list():
    with ScriptedServer() as leader, ScriptedServer(on_send=_follower_of(leader)) as follower:
        async with delayd.open_producer(follower.addr, timeout_s=5) as producer:
            receipts = await producer.send_batch([("s", b"a"), ("s", b"b")])
        assert [r.code for r in receipts] == [ResultCode.OK] * 2
        sent = [m.message_id for m in follower.batches[0].messages]
        assert list(leader.stored) == sent  # the same ids, at the leader


def test_the_time_out_names_every_member_tried():
    port = free_port()  # nobody listens: every member is tried, none answers
    unknown = not_leader_reason("g", "candidate", None, None)
    with ScriptedServer(on_send=lambda batch: Error(ErrorCode.NOT_LEADER, unknown)) as lost:
        producer = delayd.Producer(f"{lost.addr},127.0.0.1:{port}", timeout_s=1)
        with producer, pytest.raises(delayd.DelaydTimeout) as caught:
            producer.send("s", b"x")
    assert f"members tried: {lost.addr}, 127.0.0.1:{port}" in str(caught.value)


def test_a_command_line_client_tries_every_member_before_giving_up():
    ports = [free_port(), free_port()]
    addr = ",".join(f"127.0.0.1:{p}" for p in ports)
    with pytest.raises(UnreachableError, match=re.escape(addr.replace(",", ", "))):
        delayd.Producer(addr, timeout_s=5, retry_first_connect=False).connect()


async def test_sender_target_follows_not_leader_to_the_leader(nursery):
    serve = functools.partial(trio.serve_tcp, host="127.0.0.1")
    leader_answers = [[SendResult(ResultCode.OK)]]
    leader = await nursery.start(
        serve, functools.partial(serve_scripted, answers=leader_answers), 0
    )
    leader_addr = f"127.0.0.1:{leader[0].socket.getsockname()[1]}"
    refusal = Error(ErrorCode.NOT_LEADER, not_leader_reason("b", "follower", 2, leader_addr))
    follower = await nursery.start(serve, functools.partial(serve_scripted, answers=[refusal]), 0)
    follower_addr = f"127.0.0.1:{follower[0].socket.getsockname()[1]}"
    target = RemoteTarget("b", [follower_addr])
    assert [r.code for r in await target.send_batch(due("n", 1))] == [ResultCode.OK]
    assert target.address == leader_addr and target.addresses == (follower_addr, leader_addr)
    await target.aclose()


# --------------------------------------------------------------------- in virtual time


class FakeLink:
    """An AsyncLink stand-in: ``answer(addr)`` is what each request gets."""

    protocol_version = PROTOCOL_VERSION  # what a server of this version negotiates

    def __init__(self, addr: str, answer: Callable[[str], object]) -> None:
        self.addr = addr
        self.answer = answer
        self.failure: str | None = None

    @property
    def closed(self) -> bool:
        return self.failure is not None

    async def run(self) -> None:
        await trio.sleep_forever()

    async def request(self, build):
        await trio.sleep(0.001)  # a round trip
        answer = self.answer(self.addr)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def abort(self, reason: str) -> None:
        self.failure = reason


def fake_members(monkeypatch, answer: Callable[[str], object]) -> list[str]:
    """Make the async clients' links FakeLinks; returns the addresses connected to."""
    opened: list[str] = []

    async def open_link(address, **_):
        opened.append(str(address))
        await trio.sleep(0.001)
        return FakeLink(str(address), answer)

    monkeypatch.setattr(AsyncLink, "open", open_link)
    return opened


def refusal(leader: str | None) -> NotLeaderError:
    reason = not_leader_reason("g", "follower" if leader else "candidate", 3, leader)
    return NotLeaderError(ErrorCode.NOT_LEADER, reason, leader)


async def test_a_redirect_is_followed_at_once(monkeypatch, autojump_clock):
    answered = CancelResult(CancelOutcome.CANCELLED)
    opened = fake_members(monkeypatch, lambda a: answered if a == "h2:2" else refusal("h2:2"))
    async with delayd.open_producer("h1:1,h2:2", timeout_s=5) as producer:
        started = trio.current_time()
        receipt = await producer.cancel("m-1")
        took_s = trio.current_time() - started
    assert receipt.cancelled and opened == ["h1:1", "h2:2"]
    assert took_s < 0.01  # a round trip, a connection, a round trip: no back-off


async def test_no_leader_anywhere_backs_off_until_the_time_out(monkeypatch, autojump_clock):
    opened = fake_members(monkeypatch, lambda a: refusal(None))
    async with delayd.open_producer("h1:1,h2:2", timeout_s=3) as producer:
        started = trio.current_time()
        with pytest.raises(delayd.DelaydTimeout, match="members tried: h1:1, h2:2"):
            await producer.cancel("m-1")
        assert trio.current_time() - started == pytest.approx(3, abs=0.01)
    # Each member asked in turn, spaced by the back-off (50 ms doubling to 2 s), not spun.
    assert opened[:4] == ["h1:1", "h2:2", "h1:1", "h2:2"] and 5 <= len(opened) <= 9


def test_serve_reads_cluster_from_the_file_and_the_environment():
    from delayd.server.config import ConfigError, config_from_mapping
    from delayd.server.config_env import load_effective_config

    config = load_effective_config(
        None, {"DELAYD_CLUSTER_ETCD": "http://e:2379", "DELAYD_CLUSTER_GROUP": "g1"}
    )
    assert config.cluster.etcd == ("http://e:2379",) and config.cluster.group == "g1"
    wildcard = {"server": {"listen": "0.0.0.0:20801"}, "cluster": {"etcd": ["http://e:2379"]}}
    wildcard["cluster"]["group"] = "g1"
    with pytest.raises(ConfigError, match="--advertise HOST"):
        config_from_mapping(wildcard)
    wildcard["cluster"]["advertise"] = "10.0.0.1"
    assert config_from_mapping(wildcard).cluster.advertised("0.0.0.0") == "10.0.0.1"
    with pytest.raises(ConfigError, match=r"config: cluster\.ack must be sync or leader"):
        config_from_mapping({"cluster": {"ack": "all"}})
    with pytest.raises(ConfigError, match=r"unknown key; keys of \[cluster\]"):
        config_from_mapping({"cluster": {"acks": "sync"}})
