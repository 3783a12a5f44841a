"""Which copy of a delay group's logs the audit reads (delayd.audit.groups), and where
it learns of them: repeated ``--data NAME=DIR``, or the members etcd lists — which a
real ``delayd serve`` in a group registers with its data directory. No Spark: the
audits themselves are in tests/test_audit.py."""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from pathlib import Path

import pytest
import trio

from delayd.audit import groups
from delayd.audit.groups import Copy, CopyMissingError
from delayd.cli.audit import add_arguments, config_from_args, etcd_copies
from delayd.cli.main import main
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.members import GroupKeys, MemberInfo
from tests.audit_support import group_copy
from tests.etcd_support import EtcdServer
from tests.intake_support import ServeProcess
from tests.process_support import ROOT
from tests.test_cluster_roles import member_env, member_id, state, steady, wait_until


def test_the_leaders_copy_is_read_when_it_is_readable(tmp_path):
    leader, follower = str(tmp_path / "a"), str(tmp_path / "b")
    group_copy(leader, "g1", 3)
    group_copy(follower, "g1", 5)  # holds more, but the leader is the authority
    chosen = groups.choose(
        [Copy("g1", follower, "m-b", "host-b"), Copy("g1", leader, "m-a", "host-a", leader=True)]
    )
    assert (chosen.name, chosen.data_dir) == ("g1", leader)
    assert (
        chosen.copy
        == f"member m-a on host-a (leader): {leader} (the leader's copy; 1 other copy not read)"
    )


def test_without_a_readable_leader_the_copy_that_holds_most_is_read(tmp_path):
    lagging, full = str(tmp_path / "lagging"), str(tmp_path / "full")
    group_copy(lagging, "g1", 4)
    group_copy(full, "g1", 6)
    assert groups.held_bytes(lagging) < groups.held_bytes(full)
    copies = [
        Copy("g1", str(tmp_path / "gone"), "m-l", "elsewhere", leader=True),
        Copy("g1", lagging, "m-1"),
        Copy("g1", full, "m-2"),
    ]
    chosen = groups.choose(copies)
    assert chosen.data_dir == full
    assert chosen.copy.endswith("(the copy that holds most; 2 other copies not read)")


def test_repeated_data_names_are_copies_of_one_group_read_once(tmp_path):
    one, other, lone = (str(tmp_path / name) for name in ("one", "other", "lone"))
    group_copy(one, "g1", 2)
    group_copy(other, "g1", 3)
    group_copy(lone, "g2", 1)
    servers = groups.servers([Copy("g1", one), Copy("g2", lone), Copy("g1", other)])
    assert [(s.name, s.data_dir) for s in servers] == [("g1", other), ("g2", lone)]
    assert servers[0].copy == f"{other} (the copy that holds most; 1 other copy not read)"
    assert servers[1].copy == ""  # a lone --data directory: nothing to say


def test_no_readable_copy_is_a_clear_error_naming_each(tmp_path):
    copies = [
        Copy("g1", "/mnt/nowhere/a", "m-a", "host-a", leader=True),
        Copy("g1", "", "m-old", "host-b"),
    ]
    with pytest.raises(CopyMissingError) as raised:
        groups.choose(copies)
    message = str(raised.value)
    assert message.startswith("group g1: no copy of its logs is readable here: ")
    assert "member m-a on host-a (leader): /mnt/nowhere/a (" in message
    assert "member m-old on host-b: no data_dir registered (an older delayd" in message
    assert "run the audit where the directories are mounted" in message
    assert message.endswith("or give one with --data g1=DIR")


def test_member_info_carries_the_data_dir_and_older_readers_ignore_it():
    info = MemberInfo("m1", intake="h:1", data_dir="/var/lib/delayd", hostname="h")
    assert MemberInfo.from_json(info.to_json()) == info
    older = b'{"member_id": "m1", "intake": "h:1"}'  # what an older member registers
    assert MemberInfo.from_json(older).data_dir == ""


def register(url: str, prefix: str, group: str, *members: MemberInfo, leader: str = "") -> None:
    """The keys a group's members write (without leases: the test's prefix is its own)."""
    keys = GroupKeys(prefix, group)

    async def put() -> None:
        async with EtcdClient([url]) as etcd:
            for info in members:
                await etcd.put(keys.member(info.member_id), info.to_json())
                if info.member_id == leader:
                    await etcd.put(keys.leader, info.to_json())

    trio.run(put)


def test_etcd_lists_the_delay_groups_members_as_copies(etcd_server, etcd_prefix, tmp_path):
    a, b = (
        MemberInfo("a", intake="h1:1", data_dir="/d/a", hostname="h1"),
        MemberInfo("b", intake="h2:1", data_dir="/d/b", hostname="h2"),
    )
    register(etcd_server.url, etcd_prefix, "delay-1", a, b, leader="b")
    broker = MemberInfo("x", broker="h3:1", data_dir="/d/x")  # a standalone broker group
    register(etcd_server.url, etcd_prefix, "brokers-1", broker)
    assert sorted(etcd_copies((etcd_server.url,), etcd_prefix), key=lambda c: c.member) == [
        Copy("delay-1", "/d/a", "a", "h1", leader=False),
        Copy("delay-1", "/d/b", "b", "h2", leader=True),
    ]


def test_audit_from_etcd_fails_before_spark_when_no_copy_is_here(etcd_server, etcd_prefix, capsys):
    away = MemberInfo("a", intake="h1:1", data_dir="/mnt/on-h1/delayd", hostname="h1")
    register(etcd_server.url, etcd_prefix, "delay-1", away, leader="a")
    argv = ["audit", "--etcd", etcd_server.url, "--cluster-prefix", etcd_prefix, "--out", "/tmp/x"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "group delay-1: no copy of its logs is readable here: member a on h1 (leader): " in err
    assert "/mnt/on-h1/delayd" in err


def test_audit_needs_data_or_etcd(capsys):
    assert main(["audit", "--out", "/tmp/x"]) == 2
    assert (
        "say what to audit: --data [NAME=]DIR (repeatable) or --etcd URL" in capsys.readouterr().err
    )


def test_audit_of_an_empty_cluster_prefix_says_so(etcd_server, etcd_prefix, capsys):
    argv = ["audit", "--etcd", etcd_server.url, "--cluster-prefix", etcd_prefix, "--out", "/x"]
    assert main(argv) == 2
    assert f"etcd lists no delay group under {etcd_prefix}/groups/" in capsys.readouterr().err


@pytest.mark.slow
def test_a_serving_member_registers_its_data_dir(tmp_path: Path, etcd_server: EtcdServer):
    name = f"audited-{uuid.uuid4().hex[:8]}"  # the default prefix is shared by the session
    process = ServeProcess(
        tmp_path / "member", "--etcd", etcd_server.url, "--group", name, env=steady(member_env())
    )
    try:
        process.start()
        # 20 s: an election right after a start may take seconds on a loaded machine.
        wait_until(lambda: state(etcd_server.url, name).leader is not None, 20, "it leads")
        (info,) = state(etcd_server.url, name).members
        assert info.data_dir == os.path.abspath(tmp_path / "member")
        assert info.hostname == socket.gethostname()
        copies = [c for c in etcd_copies((etcd_server.url,), "/delayd") if c.group == name]
        assert copies == [Copy(name, info.data_dir, member_id(process), info.hostname, True)]
    finally:
        process.close()


def test_data_replaces_what_etcd_says_of_a_group(etcd_server, etcd_prefix, tmp_path):
    mounted = str(tmp_path / "g1")
    group_copy(mounted, "g1", 2)
    elsewhere = MemberInfo("a", intake="h1:1", data_dir="/mnt/on-h1/delayd", hostname="h1")
    here = str(tmp_path / "g2")
    group_copy(here, "g2", 3)
    member = MemberInfo("b", intake="h2:1", data_dir=here, hostname="h2")
    register(etcd_server.url, etcd_prefix, "g1", elsewhere, leader="a")
    register(etcd_server.url, etcd_prefix, "g2", member)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--etcd", etcd_server.url, "--cluster-prefix", etcd_prefix, "--out", "/x"]

    config = config_from_args(parser.parse_args([*argv, "--data", f"g1={mounted}"]))

    assert [(s.name, s.data_dir) for s in config.servers] == [("g1", mounted), ("g2", here)]
    assert config.servers[1].copy == f"member b on h2: {here} (the only copy)"


def test_one_path_on_every_host_is_taken_only_for_this_hosts_member(tmp_path):
    """Members on hosts of their own all register /var/lib/delayd: here it is the
    directory of the member on this host only, never another group's logs."""
    path = str(tmp_path / "delayd")
    group_copy(path, "g1", 2)  # this host's member's directory
    g1 = [Copy("g1", path, "a", "other-host", leader=True), Copy("g1", path, "b", "this-host")]
    servers = groups.servers(g1, "this-host")
    assert [(s.name, s.data_dir) for s in servers] == [("g1", path)]
    assert servers[0].copy.startswith("member b on this-host: ")  # not the leader's path
    with pytest.raises(CopyMissingError, match="other members register the same path"):
        groups.servers([*g1, Copy("g2", path, "c", "third-host")], "this-host")


def test_two_groups_are_never_read_from_one_directory(tmp_path):
    path = str(tmp_path / "delayd")
    group_copy(path, "g1", 2)
    with pytest.raises(ValueError, match="groups g1 and g2 would both be read from"):
        groups.servers([Copy("g1", path), Copy("g2", path + "/")])


def test_the_documented_error_for_a_group_not_mounted_here(etcd_server, etcd_prefix, capsys):
    """docs/audit.md ("From etcd") shows what the audit says of group g2, whose members
    registered directories not mounted here: this is it."""
    text = (ROOT / "docs" / "audit.md").read_text(encoding="utf-8")
    shown = next(
        line for line in text.splitlines() if line.startswith("delayd audit: group g2: no copy")
    )
    b = MemberInfo("10.0.0.12-20801", intake="10.0.0.12:20801", data_dir="/mnt/delayd/g2-b",
                   hostname="delay-b")  # fmt: skip
    c = MemberInfo("10.0.0.13-20801", intake="10.0.0.13:20801", data_dir="/mnt/delayd/g2-c",
                   hostname="delay-c")  # fmt: skip
    register(etcd_server.url, etcd_prefix, "g2", b, c, leader=b.member_id)
    argv = ["audit", "--etcd", etcd_server.url, "--cluster-prefix", etcd_prefix, "--out", "/x"]

    assert main(argv) == 2
    assert capsys.readouterr().err == shown + "\n"
