"""Replication over TLS: a leader and its follower in one trio process over real TCP on
127.0.0.1 with certificates made by trustme (tests/tls_support.py), as the server's
other listeners are tested in tests/test_tls.py."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import trio

from delayd.replication import Follower, Leader
from delayd.replication.follower import member_client_tls
from delayd.serving.tls import ServerTls
from delayd.tls import TlsError
from tests.test_replication import BUCKETS, GROUP, caught_up, follower_of, log_files, members
from tests.tls_support import Pki, make_pki


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return make_pki(tmp_path / "pki")


async def refused(follower: Follower, failures: int = 2) -> TlsError:
    """Wait until ``follower`` failed its TLS handshake ``failures`` times (so it kept
    retrying after the first); the last TlsError."""
    with trio.fail_after(10):
        while follower.failures["tls"] < failures:
            await trio.sleep(0.005)
    assert isinstance(follower.last_error, TlsError)
    return follower.last_error


async def test_mutual_tls_copies_byte_identical_with_each_members_certificate(
    pki: Pki, tmp_path: Path
) -> None:
    """Members present the one certificate of their ``[tls]`` to each other: the
    server certificate is the follower's client certificate too."""
    with members(tmp_path, "a", "b") as (a, b):
        a.append_messages(40)
        a.append_dispatch(BUCKETS[0], 5)
        tls = ServerTls(pki.server(mutual=True))
        leader = Leader(a.streams, a.history, 3, group=GROUP, chunk_bytes=2048, tls=tls)
        member_tls = member_client_tls(pki.server(mutual=True))
        assert member_tls.cert_file == pki.server_cert and member_tls.ca_file == pki.ca_file
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            follower = follower_of(b, "b", leader, tls=member_tls)
            nursery.start_soon(follower.run)
            await caught_up(b, a)
            a.append_messages(25)  # streamed as appended, over TLS
            a.append_dispatch(BUCKETS[1], 3)
            await caught_up(b, a)
            assert leader.connected == {"b"}
            assert follower.failures["tls"] == 0 and leader.refused_handshakes == 0
            nursery.cancel_scope.cancel()
    copied = log_files(str(tmp_path / "b"))
    assert len(copied) > 3
    assert copied == log_files(str(tmp_path / "a"))


async def test_mutual_tls_refuses_a_follower_without_a_certificate(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with members(tmp_path, "a", "b") as (a, b):
        a.append_messages(10)
        leader = Leader(
            a.streams, a.history, 3, group=GROUP, tls=ServerTls(pki.server(mutual=True))
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            follower = follower_of(b, "b", leader, tls=pki.client())
            nursery.start_soon(follower.run)
            with caplog.at_level(logging.INFO):
                error = await refused(follower)
            assert "certificate required" in str(error)
            assert "cert_file and key_file" in str(error)  # what to give
            assert follower.sessions == 0 and leader.connected == set()
            assert b.streams.message_log.end_offset == 0  # nothing copied
            assert leader.refused_handshakes >= 2
            nursery.cancel_scope.cancel()
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "following" in r.getMessage() and "certificate required" in r.getMessage() for r in warned
    )
    assert any("TLS handshake with" in r.getMessage() for r in warned)  # the leader's side


async def test_a_leader_of_an_unknown_ca_is_refused_until_its_certificate_rotates(
    pki: Pki, tmp_path: Path
) -> None:
    """The follower trusts another CA: it says why it refuses, keeps retrying, and
    follows once the leader's files are replaced and reloaded (SIGHUP's work)."""
    trusted = make_pki(tmp_path / "trusted")
    with members(tmp_path, "a", "b") as (a, b):
        a.append_messages(20)
        tls = ServerTls(pki.server())
        leader = Leader(a.streams, a.history, 3, group=GROUP, tls=tls)
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            follower = follower_of(b, "b", leader, tls=trusted.client())
            nursery.start_soon(follower.run)
            error = await refused(follower)
            assert "certificate verify failed" in str(error)
            assert "give the CA that signed the server's certificate" in str(error)
            assert b.streams.message_log.end_offset == 0

            shutil.copy(trusted.server_cert, pki.server_cert)
            shutil.copy(trusted.server_key, pki.server_key)
            assert tls.reload()
            await caught_up(b, a)
            assert leader.connected == {"b"}
            nursery.cancel_scope.cancel()
    assert log_files(str(tmp_path / "b")) == log_files(str(tmp_path / "a"))


async def test_a_plain_follower_of_a_tls_leader_is_refused(pki: Pki, tmp_path: Path) -> None:
    """No TLS on the follower: the leader's handshake sees no ClientHello and closes;
    nothing is copied and the follower keeps trying."""
    with members(tmp_path, "a", "b") as (a, b):
        a.append_messages(5)
        leader = Leader(a.streams, a.history, 3, group=GROUP, tls=ServerTls(pki.server()))
        async with trio.open_nursery() as nursery:
            await nursery.start(leader.run, "127.0.0.1", 0)
            follower = follower_of(b, "b", leader)
            nursery.start_soon(follower.run)
            with trio.fail_after(10):
                while sum(follower.failures.values()) < 2:
                    await trio.sleep(0.005)
            assert follower.failures["network"] >= 2
            why = str(follower.last_error)
            assert "before answering FOLLOW: does it lead group g1, and does it serve TLS" in why
            assert follower.sessions == 0 and leader.refused_handshakes >= 1
            assert b.streams.message_log.end_offset == 0
            nursery.cancel_scope.cancel()
