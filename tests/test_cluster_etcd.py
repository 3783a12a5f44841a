"""delayd.cluster.etcd against a real etcd: every call the group members use, and how it
fails when etcd is gone."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
import trio

from delayd.cluster.etcd import (
    GRPC_NOT_FOUND,
    GRPC_OUT_OF_RANGE,
    Compare,
    Delete,
    EtcdClient,
    EventKind,
    Get,
    Put,
    RangeResult,
    prefix_range_end,
)
from delayd.errors import DelaydError, EtcdError, EtcdUnavailable
from tests.etcd_support import (
    EtcdServer,
    dead_url,
)


@pytest.fixture
async def etcd(etcd_server):
    async with EtcdClient([etcd_server.url]) as client:
        yield client


def test_prefix_range_end():
    assert prefix_range_end(b"/a/") == b"/a0"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"\xff\xff") == b"\0"


def test_endpoints_must_be_urls():
    with pytest.raises(ValueError, match=re.escape("write http://127.0.0.1:2379")):
        EtcdClient(["127.0.0.1:2379"])
    with pytest.raises(ValueError, match="at least one"):
        EtcdClient([])


async def test_put_get_range_delete(etcd, etcd_prefix):
    p = etcd_prefix
    first = await etcd.put(f"{p}/k/a", "1")
    second = await etcd.put(f"{p}/k/b", b"\x00\xff")
    await etcd.put(f"{p}/kz", "outside the prefix")
    assert second > first

    a = await etcd.get(f"{p}/k/a")
    assert a is not None
    assert (a.value, a.create_revision, a.mod_revision, a.version) == (b"1", first, first, 1)
    assert await etcd.get(f"{p}/nothing") is None

    found = await etcd.range(f"{p}/k/", prefix=True)
    assert [(kv.key, kv.value) for kv in found.kvs] == [
        (f"{p}/k/a".encode(), b"1"),
        (f"{p}/k/b".encode(), b"\x00\xff"),
    ]
    assert found.revision >= second

    assert await etcd.delete(f"{p}/k/", prefix=True) == 2
    assert (await etcd.range(f"{p}/k/", prefix=True)).kvs == ()
    assert await etcd.get(f"{p}/kz") is not None


async def test_txn_create_revision_is_a_compare_and_set(etcd, etcd_prefix):
    key = f"{etcd_prefix}/leader"
    take = ([Compare.create_revision(key, 0)], [Put(key, "a")], [Get(key)])

    won = await etcd.txn(*take)
    assert won.succeeded
    assert won.responses == (None,)

    lost = await etcd.txn(*take)
    assert not lost.succeeded
    (held,) = lost.responses
    assert isinstance(held, RangeResult)
    assert held.kvs[0].value == b"a"
    assert held.kvs[0].create_revision == won.revision  # the winner's epoch

    stale = await etcd.txn([Compare.mod_revision(key, won.revision - 1)], [Put(key, "b")])
    assert not stale.succeeded
    fresh = await etcd.txn(
        [Compare.mod_revision(key, won.revision), Compare.value(key, "a")],
        [Put(key, "b"), Get(key)],
    )
    assert fresh.succeeded
    assert fresh.responses[1].kvs[0].value == b"b"
    removed = await etcd.txn([Compare.value(key, "b")], [Delete(key)])
    assert removed.responses == (1,)
    assert await etcd.get(key) is None


async def test_leases(etcd, etcd_prefix):
    lease = await etcd.lease_grant(5)
    assert lease.ttl_s == 5
    await etcd.put(f"{etcd_prefix}/on-lease", "x", lease=lease.id)
    assert (await etcd.get(f"{etcd_prefix}/on-lease")).lease == lease.id
    assert await etcd.lease_keepalive(lease.id) == 5
    assert 4 <= await etcd.lease_time_to_live(lease.id) <= 5

    await etcd.lease_revoke(lease.id)
    assert await etcd.get(f"{etcd_prefix}/on-lease") is None  # revoking deletes its keys

    for gone in (
        etcd.lease_keepalive(lease.id),
        etcd.lease_time_to_live(lease.id),
        etcd.lease_revoke(lease.id),
        etcd.put(f"{etcd_prefix}/late", "x", lease=lease.id),
    ):
        with pytest.raises(EtcdError) as caught:
            await gone
        assert caught.value.code == GRPC_NOT_FOUND
        assert not isinstance(caught.value, EtcdUnavailable)
        assert etcd.endpoints[0] in str(caught.value)


async def test_a_lease_expires_after_its_ttl(etcd, etcd_prefix):
    lease = await etcd.lease_grant(1)
    await etcd.put(f"{etcd_prefix}/k", "x", lease=lease.id)
    # The ttl, plus etcd's expiry check every 0.5 s, both late on a loaded machine: a
    # lease that never expired fails however long this is.
    with trio.fail_after(10):
        while await etcd.get(f"{etcd_prefix}/k") is not None:
            await trio.sleep(0.05)


async def test_watch_sees_puts_and_deletes_in_order(etcd, etcd_prefix):
    start = await etcd.put(f"{etcd_prefix}/w/a", "1")
    await etcd.put(f"{etcd_prefix}/w/b", "2")
    await etcd.delete(f"{etcd_prefix}/w/a")
    await etcd.put(f"{etcd_prefix}/other", "not watched")
    seen = []
    with trio.fail_after(10):  # a new stream and its watch: slow on a loaded machine
        async with etcd.watch(f"{etcd_prefix}/w/", prefix=True, start_revision=start) as events:
            async for event in events:
                seen.append((event.kind, event.kv.key.rsplit(b"/", 1)[1], event.kv.value))
                if len(seen) == 3:
                    break
    assert seen == [
        (EventKind.PUT, b"a", b"1"),
        (EventKind.PUT, b"b", b"2"),
        (EventKind.DELETE, b"a", b""),
    ]


async def test_watch_from_now_sees_only_later_changes(etcd, etcd_prefix):
    key = f"{etcd_prefix}/now"
    await etcd.put(key, "before")

    async def put_after_until_seen() -> None:
        # The watch is created some time after it is entered (0.1 s was too short on a
        # loaded machine): a put before that is not seen, so put again until one is.
        while True:
            await etcd.put(key, "after")
            await trio.sleep(0.1)

    with trio.fail_after(10):
        async with etcd.watch(key) as events, trio.open_nursery() as nursery:
            nursery.start_soon(put_after_until_seen)
            event = await events.__anext__()
            nursery.cancel_scope.cancel()
    assert event.kv.value == b"after"  # the first event: never the put before the watch


async def test_watch_resumes_after_a_lost_connection_without_gaps_or_repeats(
    etcd_server, etcd_prefix, etcd_proxy
):
    async with EtcdClient([etcd_server.url]) as direct, EtcdClient([etcd_proxy.url]) as watched:
        key = f"{etcd_prefix}/resume"
        start = await direct.put(key, "1")
        values = []
        with trio.fail_after(4):
            async with watched.watch(key, start_revision=start) as events:
                async for event in events:
                    values.append(event.kv.value)
                    if event.kv.value == b"1":
                        etcd_proxy.reset()  # every connection through the proxy drops
                        await direct.put(key, "2")
                        await direct.put(key, "3")
                    if event.kv.value == b"3":
                        break
    assert values == [b"1", b"2", b"3"]


async def test_watch_survives_an_etcd_restart(tmp_path):
    server = EtcdServer(tmp_path / "etcd").start()  # its own: this one is stopped
    try:
        async with EtcdClient([server.url]) as etcd:
            start = await etcd.put("/r", "before")
            values = []
            with trio.fail_after(5):
                async with etcd.watch("/r", start_revision=start) as events:
                    async for event in events:
                        values.append(event.kv.value)
                        if event.kv.value == b"before":
                            # The stream ends with etcd's gateway error, grpc_code 14.
                            await trio.to_thread.run_sync(server.stop)
                            await trio.to_thread.run_sync(server.restart)
                            await etcd.put("/r", "after")
                        else:
                            break
        assert values == [b"before", b"after"]
    finally:
        server.stop()


async def test_watch_on_a_compacted_revision_raises(tmp_path):
    server = EtcdServer(tmp_path / "etcd").start()  # its own: compaction is for everyone
    try:
        async with EtcdClient([server.url]) as etcd:
            await etcd.put("/c", "1")
            latest = await etcd.put("/c", "2")
            body = json.dumps({"revision": str(latest)}).encode()
            urllib.request.urlopen(server.url + "/v3/kv/compaction", body, timeout=2).close()
            with trio.fail_after(2), pytest.raises(EtcdError) as caught:
                async with etcd.watch("/c", start_revision=1) as events:
                    async for _ in events:
                        pass
            assert caught.value.code == GRPC_OUT_OF_RANGE
            assert f"compacted up to revision {latest}" in str(caught.value)
    finally:
        server.stop()


async def test_a_stopped_etcd_is_unavailable_at_once_naming_the_endpoint(tmp_path):
    server = EtcdServer(tmp_path / "etcd").start()
    async with EtcdClient([server.url]) as etcd:
        await etcd.put("/k", "v")
        server.stop()
        started = time.monotonic()
        with pytest.raises(EtcdUnavailable) as caught:
            await etcd.get("/k")
        assert time.monotonic() - started < 0.5
    assert server.url in str(caught.value)
    assert "no endpoint reachable" in str(caught.value)
    assert isinstance(caught.value, DelaydError)


async def test_the_next_endpoint_takes_over_and_stays_preferred(etcd_server):
    dead = dead_url()
    async with EtcdClient([dead, etcd_server.url]) as etcd:
        await etcd.put("/endpoints", "v")
        assert etcd.current_endpoint == etcd_server.url
        assert (await etcd.get("/endpoints")).value == b"v"
    async with EtcdClient([dead, dead_url()]) as etcd:
        with pytest.raises(EtcdUnavailable) as caught:
            await etcd.get("/endpoints")
    assert dead in str(caught.value)


async def test_an_etcd_that_does_not_answer_times_out_as_unavailable(etcd_proxy):
    etcd_proxy.cut()
    async with EtcdClient([etcd_proxy.url], timeout_s=0.2) as etcd:
        started = trio.current_time()
        with pytest.raises(EtcdUnavailable) as caught:
            await etcd.put("/partitioned", "v")
        assert trio.current_time() - started < 1
    assert caught.value.outcome_unknown
    assert "may or may not have been applied" in str(caught.value)
    assert etcd_proxy.url in str(caught.value)
