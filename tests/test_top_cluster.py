"""`delayd top --etcd`: the cluster view. The model (a group's figures are its leader's,
each follower's lag as the leader reports it, shares of the load against an even share
and the uneven flag), the frame at 80 columns and the docs' example of it, the watcher
re-reading a real etcd at each refresh (groups and members that appear and vanish), the
live view in a pseudo terminal, and `--once` against real delay groups registered in a
real etcd: both groups, their pending, the uneven flag, a member killed with kill -9
shown as unreachable."""

from __future__ import annotations

import io
import os
import re
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from rich.console import Console

import delayd
from delayd.cli.top_cluster import ClusterWatcher, read_cluster
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.members import GroupKeys, MemberInfo, cluster_prefix
from delayd.cluster.registry import GroupKind, GroupStatus, register, set_status
from delayd.top.cluster import (
    UNEVEN_MIN_PENDING,
    ClusterModel,
    GroupRow,
    GroupSeen,
    MemberSeen,
    cluster_rows,
)
from delayd.top.cluster_render import render_cluster
from delayd.top.model import ServerView
from tests.etcd_support import EtcdServer
from tests.intake_support import ServeProcess
from tests.process_support import DELAYD, ROOT, child_env
from tests.test_top import exit_status, screen_until, top_in_a_terminal
from tests.tls_support import make_pki

T = 1_795_341_600_000  # 2026-11-22T10:00:00Z


def leader_view(pending: float | None, in_per_s: float | None = 0.0, **more) -> ServerView:
    return ServerView(
        "m:1",
        pending={} if pending is None else {"1m": pending / 2, "1h": pending / 2},
        in_per_s=in_per_s,
        out_per_s=more.pop("out_per_s", 0.0),
        lateness_p50_s=0.001,
        lateness_p99_s=0.03,
        **more,
    )


def delay_group(name: str, status: str | None = "active", *members: MemberSeen) -> GroupSeen:
    return GroupSeen(name, "delay", status, members or (MemberSeen(f"{name}-1", "leader", "h:1"),))


def rows_of(*groups: tuple[GroupSeen, ServerView | None]) -> dict[str, GroupRow]:
    views = {
        (group.name, group.members[0].member_id): view for group, view in groups if view is not None
    }
    return {row.name: row for row in cluster_rows([g for g, _ in groups], views)}


# ---------------------------------------------------------------- the model


def test_a_groups_figures_are_its_leaders_and_followers_lag_as_the_leader_sees_it():
    members = (
        MemberSeen("b", "follower", "h:2"),
        MemberSeen("a", "leader", "h:1"),
        MemberSeen("c", "follower", "h:3"),
    )
    group = GroupSeen("orders", "delay", "active", members)
    lead = leader_view(
        1200, 500.0, out_per_s=450.0, follower_lag_bytes={"b": 3482.0}, follower_lag_s={"b": 0.2}
    )
    follower = leader_view(999_999, 7.0)  # a follower's own figures are not the group's
    views = {
        ("orders", "a"): lead,
        ("orders", "b"): follower,
        ("orders", "c"): ServerView("h:3", error="connection refused"),
    }
    (row,) = cluster_rows([group], views)
    assert (row.leader, row.pending, row.in_per_s, row.out_per_s) == ("a", 1200, 500.0, 450.0)
    assert (row.lateness_p50_s, row.lateness_p99_s) == (0.001, 0.03)
    assert [(m.member_id, m.role) for m in row.members] == [
        ("a", "leader"),
        ("b", "follower"),
        ("c", "follower"),
    ]
    leader, behind, down = row.members
    assert leader.error is None and leader.lag_bytes is None
    assert (behind.lag_bytes, behind.lag_s) == (3482.0, 0.2)
    assert down.error == "connection refused" and down.lag_bytes is None
    assert row.pending_share is None  # one group: nothing to compare with


def test_without_a_reachable_leader_the_figures_are_unknown():
    alone = GroupSeen("g", "delay", "active", (MemberSeen("a", "candidate", "h:1"),))
    (row,) = cluster_rows([alone], {("g", "a"): leader_view(100)})
    assert row.leader is None and row.pending is None and row.in_per_s is None
    down = delay_group("g")
    (row,) = cluster_rows([down], {("g", "g-1"): ServerView("h:1", error="timed out")})
    assert row.pending is None and row.members[0].error == "timed out"
    nothing = GroupSeen("g", "delay", "active", (MemberSeen("a", "leader", ""),))
    (row,) = cluster_rows([nothing], {})
    assert not row.members[0].watched and row.members[0].error is None
    (row,) = cluster_rows([GroupSeen("g", "delay", "active")], {})
    assert row.members == [] and row.pending is None


def test_shares_against_the_even_share_and_the_uneven_flag():
    rows = rows_of(
        (delay_group("a"), leader_view(900, 100.0)),
        (delay_group("b"), leader_view(100, 100.0)),
    )
    a, b = rows["a"], rows["b"]
    assert a.pending_share is not None and b.pending_share is not None
    assert (a.pending_share.of_total, a.pending_share.even) == (0.9, 0.5)
    assert a.pending_share.uneven and not b.pending_share.uneven  # 90 % > 1.5 x 50 %
    assert a.in_share is not None and not a.in_share.uneven  # 50 / 50
    assert a.uneven and not b.uneven
    # 70 % of two groups is within 1.5x the even share
    rows = rows_of((delay_group("a"), leader_view(700)), (delay_group("b"), leader_view(300)))
    assert not rows["a"].uneven
    # Three groups: the even share is a third, flagged above a half.
    rows = rows_of(
        (delay_group("a"), leader_view(550)),
        (delay_group("b"), leader_view(250)),
        (delay_group("c"), leader_view(200)),
    )
    assert rows["a"].pending_share.even == pytest.approx(1 / 3) and rows["a"].uneven


def test_no_flag_below_the_minimum_nor_for_groups_that_take_no_work():
    few = UNEVEN_MIN_PENDING - 1
    rows = rows_of((delay_group("a"), leader_view(few)), (delay_group("b"), leader_view(0)))
    assert rows["a"].pending_share.of_total == 1.0 and not rows["a"].uneven
    # A draining group still holds messages and takes none: it is not in the comparison,
    # and neither is a broker group (a kind of its own).
    rows = rows_of(
        (delay_group("a"), leader_view(500)),
        (delay_group("b"), leader_view(500)),
        (delay_group("old", "draining"), leader_view(9000)),
        (GroupSeen("br", "broker", "active", (MemberSeen("br-1", "leader", "h:9"),)), None),
    )
    assert rows["old"].pending_share is None and not rows["old"].uneven
    assert rows["a"].pending_share.of_total == 0.5 and not rows["a"].uneven
    assert rows["br"].pending_share is None
    # An unknown figure (the leader down) leaves the group out of the even share.
    rows = rows_of(
        (delay_group("a"), leader_view(500)),
        (delay_group("b"), ServerView("h:1", error="refused")),
    )
    assert rows["a"].pending_share is None


def test_a_broker_groups_intake_is_what_it_stored():
    group = GroupSeen("br", "broker", "active", (MemberSeen("m", "leader", "h:1"),))
    (row,) = cluster_rows([group], {("br", "m"): ServerView("h:1", stored_per_s=42.0)})
    assert row.in_per_s == 42.0 and row.pending is None


# ---------------------------------------------------------------- the frame


def frame(model: ClusterModel, width: int = 80, height: int | None = None) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(render_cluster(model, width, height))
    lines = console.export_text().splitlines()
    assert all(len(line) <= width for line in lines), "\n".join(lines)
    assert height is None or len(lines) <= height
    return lines


def line_with(lines: list[str], *words: str) -> str:
    (found,) = [line for line in lines if all(w in line for w in words)]
    return found


def group_line(lines: list[str], group: str) -> int:
    """The index of the group's own line (its members follow it)."""
    (found,) = [i for i, line in enumerate(lines) if line.startswith(f"{group} ")]
    return found


def group_cells(lines: list[str], group: str) -> list[str]:
    return lines[group_line(lines, group)].split()


def sample_cluster() -> ClusterModel:
    orders = GroupSeen(
        "orders",
        "delay",
        "active",
        (MemberSeen("o-1", "leader", "h:1"), MemberSeen("o-2", "follower", "h:2")),
    )
    billing = delay_group("billing", "active", MemberSeen("b-1", "leader", "h:3"))
    old = GroupSeen("old", "delay", "draining")
    views = {
        ("orders", "o-1"): leader_view(
            12_000, 900.0, out_per_s=600.0, follower_lag_bytes={"o-2": 3482}, follower_lag_s={}
        ),
        ("orders", "o-2"): leader_view(12_000),
        ("billing", "b-1"): ServerView("h:3", error="[Errno 111] Connection refused"),
    }
    rows = cluster_rows([orders, billing, old], views)
    return ClusterModel("prod", rows, now_ms=T, interval_s=1.0)


def test_the_frame_a_line_per_group_and_per_member():
    lines = frame(sample_cluster())
    assert lines[0].startswith("delayd top  cluster prod  2026-11-22 10:00:00Z  1 s  3 groups")
    header = line_with(lines, "group", "kind", "status", "pending", "in/s", "p99")
    assert header.split() == [
        "group", "kind", "status", "pending", "share", "in/s", "share", "out/s", "p50", "p99"
    ]  # fmt: skip
    assert group_cells(lines, "orders") == [
        "orders", "delay", "active", "12,000", "—", "900.0", "—", "600.0", "1.0", "ms", "30", "ms"
    ]  # fmt: skip
    assert "leader" in line_with(lines, "o-1") and "up" in line_with(lines, "o-1")
    follower = line_with(lines, "o-2").split()[1:]
    assert follower == ["follower", "up", "·", "lag", "3.4", "KiB", "·", "—"]
    billing = group_line(lines, "billing")
    assert group_cells(lines, "billing")[3] == "—"  # its leader could not be scraped
    assert "unreachable — [Errno 111] Connection refused" in lines[billing + 1]
    old = group_line(lines, "old")
    assert "draining" in lines[old] and "no live member" in lines[old + 1]


def test_the_frame_names_the_uneven_group_and_cuts_to_the_height():
    rows = rows_of(
        (delay_group("hot"), leader_view(9_000, 50.0)),
        (delay_group("cold"), leader_view(1_000, 50.0)),
    )
    model = ClusterModel("default", [rows["cold"], rows["hot"]], now_ms=T)
    lines = frame(model)
    assert line_with(lines, "uneven") == ("▲ uneven: delay group hot has 90% of pending (even 50%)")
    assert group_cells(lines, "hot")[3:6] == ["9,000", "90%▲", "50.0"]
    assert group_cells(lines, "cold")[3:5] == ["1,000", "10%"]
    even = rows_of(
        (delay_group("a"), leader_view(500)), (delay_group("b"), leader_view(500))
    ).values()
    assert "load even: no group past 1.5x its even share" in frame(
        ClusterModel("c", list(even), now_ms=T)
    )
    many = [row for i in range(20) for row in rows_of((delay_group(f"g{i:02d}"), None)).values()]
    lines = frame(ClusterModel("c", many, now_ms=T, etcd_error="etcd range: no answer"), 80, 24)
    assert len(lines) == 24
    assert "etcd: etcd range: no answer — showing the groups last read" in lines[1]
    assert re.match(r"… \d+ more lines", lines[-1])
    assert len(frame(ClusterModel("c", many, now_ms=T, etcd_error="down"), 80, 2)) == 2
    assert "  1 group  " in frame(ClusterModel("c", many[:1], now_ms=T))[0]
    reason = "no endpoint reachable: " + "http://10.0.0.9:2379 (timed out), " * 4
    lines = frame(ClusterModel("c", [], now_ms=T, etcd_error=reason))  # --once: all of it
    assert reason.strip() in " ".join(line.strip() for line in lines[1:4])
    assert "no groups read yet" in lines
    wide = frame(sample_cluster(), 120)
    assert max(len(line) for line in wide) > 80 and group_cells(wide, "orders")


def docs_example() -> ClusterModel:
    """The cluster of the example in docs/operations.md ("The cluster view")."""

    def leader(pending: float, in_per_s: float, out_per_s: float, **lag) -> ServerView:
        return ServerView(
            "h:1",
            pending={"1m": pending},
            in_per_s=in_per_s,
            out_per_s=out_per_s,
            lateness_p50_s=0.0012,
            lateness_p99_s=0.034,
            **lag,
        )

    def members(group: str, *roles: str, metrics: bool = True) -> tuple[MemberSeen, ...]:
        return tuple(
            MemberSeen(f"{group}-{i}", role, f"10.0.0.{i}:20880" if metrics else "")
            for i, role in enumerate(roles, 1)
        )

    groups = [
        GroupSeen("orders", "delay", "active", members("orders", "leader", *["follower"] * 2)),
        GroupSeen("billing", "delay", "active", members("billing", "leader", "follower")),
        GroupSeen("legacy", "delay", "draining", members("legacy", "leader")),
        GroupSeen("brokers-a", "broker", "active", members("brokers-a", "leader", metrics=False)),
    ]
    views = {
        ("orders", "orders-1"): leader(
            48_210,
            2400.0,
            2310.5,
            follower_lag_bytes={"orders-2": 0, "orders-3": 1_900_000},
            follower_lag_s={"orders-2": 0, "orders-3": 2.4},
        ),
        ("orders", "orders-2"): leader(0, 0, 0),
        ("orders", "orders-3"): leader(0, 0, 0),
        ("billing", "billing-1"): leader(9_870, 610.0, 598.0, follower_lag_bytes={"billing-2": 0}),
        ("billing", "billing-2"): ServerView("h:2", error="timed out"),
        ("legacy", "legacy-1"): leader(1_204, 0.0, 12.0),
    }
    return ClusterModel("prod", cluster_rows(groups, views), now_ms=T, interval_s=1.0)


def test_the_docs_example_is_what_top_draws():
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text[text.index("### The cluster view") :]
    block = section[section.index("```\ndelayd top  cluster") + 4 :]
    shown = block[: block.index("```")].rstrip("\n").splitlines()
    assert shown == [line.rstrip() for line in frame(docs_example())]


# ---------------------------------------------------------------- etcd, re-read


async def put_member(etcd: EtcdClient, prefix: str, group: str, info: MemberInfo) -> None:
    await etcd.put(GroupKeys(prefix, group).members + info.member_id, info.to_json())


async def test_each_refresh_reads_etcd_again(etcd_server: EtcdServer, etcd_prefix: str):
    async with EtcdClient([etcd_server.url]) as etcd:
        await register(etcd, etcd_prefix, "g1", GroupKind.DELAY, 1)
        await put_member(etcd, etcd_prefix, "g1", MemberInfo("m1", intake="h:1"))
        watcher = ClusterWatcher(etcd, etcd_prefix, "test", 0.5)
        (row,) = await watcher.refresh()
        assert (row.name, row.kind, row.status) == ("g1", "delay", "active")
        assert not row.members[0].watched
        # A group appears (with a member whose metrics listener is down); one drains.
        dead = "127.0.0.1:1"
        await put_member(etcd, etcd_prefix, "g2", MemberInfo("m2", broker="h:2", metrics=dead))
        await set_status(etcd, etcd_prefix, "g1", GroupStatus.DRAINING, 2)
        rows = {row.name: row for row in await watcher.refresh()}
        assert rows["g1"].status == "draining"
        assert (rows["g2"].kind, rows["g2"].status) == ("broker", None)  # not registered
        assert rows["g2"].members[0].role == "candidate"  # nobody leads
        assert "refused" in (rows["g2"].members[0].error or "")
        # Its only member goes: a group neither registered nor with keys is gone.
        await etcd.delete(GroupKeys(etcd_prefix, "g2").members, prefix=True)
        rows = {row.name: row for row in await watcher.refresh()}
        assert sorted(rows) == ["g1"]
        # A damaged registry entry: said, and the groups last read stay shown.
        await etcd.put(f"{etcd_prefix}/registry/g3", b"{}")
        rows = await watcher.refresh()
        assert [row.name for row in rows] == ["g1"]
        assert watcher.etcd_error is not None and "registry entry" in watcher.etcd_error
        assert [g.name for g in watcher.groups] == ["g1"]
        with pytest.raises(ValueError, match="registry entry"):
            await read_cluster(etcd, etcd_prefix)


@pytest.mark.slow
async def test_the_live_view_follows_the_cluster_and_quits_on_q(etcd_server: EtcdServer):
    """The live view in a terminal: a group registered while it runs appears."""
    cluster = f"c{uuid.uuid4().hex[:10]}"
    prefix = cluster_prefix(cluster)
    async with EtcdClient([etcd_server.url]) as etcd:
        await register(etcd, prefix, "first", GroupKind.DELAY, 1)
        with top_in_a_terminal("--etcd", etcd_server.url, "--cluster", cluster) as (proc, fd):
            screen_until(fd, r"first\s+delay\s+active")
            await register(etcd, prefix, "second", GroupKind.BROKER, 2)
            screen_until(fd, r"second\s+broker\s+active")
            os.write(fd, b"q")
            assert exit_status(proc, fd) == 0
        await etcd.delete(prefix + "/", prefix=True)


# ---------------------------------------------------------------- real groups


def member_env() -> dict[str, str]:
    return {
        "DELAYD_CLUSTER_REPLICATION_LISTEN": "127.0.0.1:0",  # the default port would collide
        # Long enough that a member killed with kill -9 is still listed when top looks.
        "DELAYD_CLUSTER_LEASE_TTL_MS": "60000",
        "DELAYD_CLUSTER_ACK": "leader",  # a lone member acknowledges alone
    }


def top_once(etcd_url: str, cluster: str, *extra: str) -> list[str]:
    # Each scrape may take 5 s, not the interval (0.3 s, the default): a member's
    # /metrics answers late on a loaded machine, and would be shown timed out.
    done = subprocess.run(
        [
            *DELAYD, "top", "--etcd", etcd_url, "--cluster", cluster, "--once",
            "--interval", "0.3", "--timeout", "5", *extra,
        ],
        cwd=ROOT, env={**child_env(), "COLUMNS": "80", "LINES": "24"},
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), done.stdout
    return lines


def pending_of(server: ServeProcess) -> float | None:
    samples = {k: v for k, v in server.metrics().items() if k.startswith("delayd_pending_messages")}
    return sum(samples.values()) if samples else None


def wait_for(check, what: str, timeout_s: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_once_shows_every_group_of_a_real_cluster(tmp_path: Path, etcd_server: EtcdServer):
    """Two delay groups, busy (a leader and a follower) and quiet (one member), 300
    and 20 messages pending."""
    cluster = f"c{uuid.uuid4().hex[:10]}"
    endpoint = etcd_server.url.removeprefix("http://")

    def member(group: str, name: str) -> ServeProcess:
        return ServeProcess(
            tmp_path / name, "--etcd", etcd_server.url, "--group", group,
            "--cluster", cluster, env=member_env(),
        )  # fmt: skip

    def fill(group: str, count: int) -> None:
        with delayd.Producer(f"etcd://{endpoint}/{cluster}/{group}", timeout_s=20) as producer:
            batch = [
                {"subject": "t", "body": b"x", "delay_ms": 3_600_000, "message_id": f"m{i}"}
                for i in range(count)
            ]
            assert all(receipt.ok for receipt in producer.send_batch(batch))

    busy, quiet = member("busy", "busy-1"), member("quiet", "quiet-1")
    follower = member("busy", "busy-2")
    servers = [busy, quiet, follower]
    try:
        # In parallel, as far as roles allow (busy's first member leads): starts cost
        # seconds each on a loaded machine.
        with ThreadPoolExecutor(3) as pool:
            for started in [pool.submit(busy.start), pool.submit(quiet.start)]:
                started.result()
            leads = "delayd_cluster_role_state"
            wait_for(lambda: busy.metrics().get(leads) == 2, "busy's first member leads")
            for done in [
                pool.submit(follower.start),
                pool.submit(fill, "busy", 300),
                pool.submit(fill, "quiet", 20),
            ]:
                done.result()
        wait_for(lambda: pending_of(busy) == 300 and pending_of(quiet) == 20, "pending")
        # busy's leader reports its follower caught up (lag by member id)
        follower_id = "{}-{}".format(*follower.address)
        caught_up = f'delayd_replication_follower_lag_bytes{{member="{follower_id}"}}'
        wait_for(lambda: busy.metrics().get(caught_up) == 0, "the follower caught up")

        lines = top_once(etcd_server.url, cluster)
        assert f"cluster {cluster}" in lines[0] and "2 groups" in lines[0]
        assert group_cells(lines, "busy")[:5] == ["busy", "delay", "active", "300", "94%▲"]
        assert group_cells(lines, "quiet")[:5] == ["quiet", "delay", "active", "20", "6%"]
        assert "uneven: delay group busy has 94% of pending (even 50%)" in "\n".join(lines)
        for group in ("busy", "quiet"):
            assert lines[group_line(lines, group) + 1].split()[1:] == ["leader", "up"]
        second = lines[group_line(lines, "busy") + 2].split()
        assert second == [follower_id, "follower", "up", "·", "caught", "up"]

        quiet.kill()
        lines = top_once(etcd_server.url, cluster)
        quiet_at = group_line(lines, "quiet")
        assert lines[quiet_at].split()[3] == "—"  # its pending is unknown now
        assert re.search(r"leader\s+unreachable — .*refused", lines[quiet_at + 1])
        assert group_cells(lines, "busy")[3] == "300"
        assert "uneven" not in "\n".join(lines)  # one group left to compare: no share
    finally:
        for server in servers:
            server.close()


@pytest.mark.slow
def test_members_serving_tls_are_scraped_with_tls_ca(tmp_path: Path, etcd_server: EtcdServer):
    pki = make_pki(tmp_path / "pki")
    cluster = f"c{uuid.uuid4().hex[:10]}"
    server = ServeProcess(
        tmp_path / "secure", "--etcd", etcd_server.url, "--group", "secure",
        "--cluster", cluster, "--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
        env=member_env(),
    )  # fmt: skip
    try:
        server.start()
        assert "metrics on https://" in server.stdout

        # The member is up before it has won its election (a loaded machine shows it
        # as candidate for a while): scraped over TLS, it must come to show leader.
        def role_over_tls() -> list[str]:
            lines = top_once(etcd_server.url, cluster, "--tls-ca", pki.ca_file)
            return lines[group_line(lines, "secure") + 1].split()[1:]

        wait_for(lambda: role_over_tls() == ["leader", "up"], "leader, up, scraped over TLS")
        lines = top_once(etcd_server.url, cluster)  # plain http to a TLS listener
        assert "unreachable — " in lines[group_line(lines, "secure") + 1]
    finally:
        server.close()


def test_bad_arguments_say_what_to_do(capsys):
    from delayd.cli.main import main

    assert main(["top", "--etcd", "http://127.0.0.1:1", "127.0.0.1:20880"]) == 2
    assert "either HOST:PORT (servers) or --etcd" in capsys.readouterr().err
    assert main(["top", "--cluster", "prod", "--once"]) == 2
    assert "--cluster needs --etcd" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["top", "--etcd", "http://127.0.0.1:1", "--cluster", "no/slash"])
    assert "cluster name 'no/slash' must be" in capsys.readouterr().err
    assert main(["top", "--etcd", "127.0.0.1:2379"]) == 2
    assert "write http://127.0.0.1:2379" in capsys.readouterr().err
    assert main(["top", "--tls-ca", "/nonexistent/ca.pem", "--once"]) == 2
    assert "CA file /nonexistent/ca.pem: cannot be read" in capsys.readouterr().err
