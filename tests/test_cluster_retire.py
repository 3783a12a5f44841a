"""``delayd cluster retire`` waits out a group's window (docs/cluster.md, "Adding and
removing a delay group"): a delay group must have been draining for the producers'
resend window, a broker group for the delay servers' doubt hold, each plus 60 s, unless
``--force``. Against the session's real etcd; a drain long ago is written into the
registry entry (its ``changed_ms``) rather than waited for."""

from __future__ import annotations

import re

import pytest
import trio

from delayd.cli.main import main
from delayd.client._routing import CHANGE_MARGIN_MS, RESEND_WINDOW_S
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.registry import GroupKind, GroupStatus, read_registry, register, set_status
from delayd.timestamps import wall_ms
from tests.etcd_support import EtcdServer
from tests.process_support import ROOT

DAY_MS = round(RESEND_WINDOW_S * 1000)


class Registry:
    """Registry entries written straight into etcd under a prefix of the test's own."""

    def __init__(self, etcd: EtcdServer, prefix: str) -> None:
        self.url = etcd.url
        self.prefix = prefix

    def drained(self, group: str, kind: GroupKind, drained_ms: int) -> None:
        async def write() -> None:
            async with EtcdClient([self.url]) as etcd:
                await register(etcd, self.prefix, group, kind, drained_ms - 1000)
                await set_status(etcd, self.prefix, group, GroupStatus.DRAINING, drained_ms)

        trio.run(write)

    def status(self, group: str) -> GroupStatus:
        async def read() -> GroupStatus:
            async with EtcdClient([self.url]) as etcd:
                return (await read_registry(etcd, self.prefix))[group].status

        return trio.run(read)

    def retire(self, group: str, *flags: str) -> int:
        return main(
            ["cluster", "retire", group, "--etcd", self.url, "--prefix", self.prefix, *flags]
        )


@pytest.fixture
def registry(etcd_server: EtcdServer, etcd_prefix: str) -> Registry:
    return Registry(etcd_server, etcd_prefix)


def test_a_delay_group_drained_within_the_resend_window_is_not_retired(
    registry: Registry, capsys: pytest.CaptureFixture[str]
):
    registry.drained("d1", GroupKind.DELAY, wall_ms() - 3_600_000)  # an hour ago
    assert registry.retire("d1") == 1
    error = capsys.readouterr().err
    assert re.search(
        r"d1 has been draining for 1h(\d+s)?, less than the producers' resend window \(1d\)", error
    )
    assert "the id's new owner would store it a second time" in error
    assert re.search(r"wait 23h(1m|\d+s) more", error)  # 1d + 60 s - 1h: 23h1m, rounded up
    assert "or give --resend-window-s the producers' resend_window_s when it is shorter" in error
    assert registry.status("d1") is GroupStatus.DRAINING

    # A shorter window the producers use: past it, the next check (is it empty?) speaks.
    assert registry.retire("d1", "--resend-window-s", "3000") == 1
    assert "cannot tell whether d1 is empty: group d1 has no leader" in capsys.readouterr().err
    assert registry.retire("d1", "--resend-window-s", "0", "--force") == 0
    warned = capsys.readouterr().err
    assert "resend window" not in warned and "WARNING: cannot tell whether d1 is empty" in warned
    assert registry.status("d1") is GroupStatus.RETIRED


def test_a_delay_group_drained_before_the_window_passes_it(
    registry: Registry, capsys: pytest.CaptureFixture[str]
):
    registry.drained("old", GroupKind.DELAY, wall_ms() - DAY_MS - CHANGE_MARGIN_MS - 1000)
    registry.drained("edge", GroupKind.DELAY, wall_ms() - DAY_MS - CHANGE_MARGIN_MS + 60_000)
    assert registry.retire("old") == 1
    assert "resend window" not in (error := capsys.readouterr().err)
    assert "cannot tell whether old is empty" in error
    assert registry.retire("edge") == 1  # the 60 s margin is not yet over
    assert re.search(r"wait (1m|\d+s) more", capsys.readouterr().err)


def test_force_retires_within_the_window_saying_what_it_risks(
    registry: Registry, capsys: pytest.CaptureFixture[str]
):
    registry.drained("d1", GroupKind.DELAY, wall_ms())
    assert registry.retire("d1", "--force") == 0
    warned = capsys.readouterr().err
    assert "WARNING: d1 has been draining for" in warned
    assert "would store it a second time; going ahead (--force)" in warned
    assert registry.status("d1") is GroupStatus.RETIRED


def test_a_broker_group_waits_out_the_delay_servers_doubt_hold(
    registry: Registry, capsys: pytest.CaptureFixture[str]
):
    registry.drained("b1", GroupKind.BROKER, wall_ms() - 10_000)
    assert registry.retire("b1") == 1
    error = capsys.readouterr().err
    assert re.search(
        r"b1 has been draining for 1\ds, less than the delay servers' doubt hold \(30s\)", error
    )
    assert "consumers may see it a second time" in error
    assert "--doubt-hold-ms the delay servers' [delivery] doubt_hold_ms" in error
    # The resend window is the producers', about delay groups: it does not apply here.
    assert registry.retire("b1", "--resend-window-s", "0") == 1
    capsys.readouterr()
    assert registry.retire("b1", "--doubt-hold-ms", "0") == 0
    assert "group b1 (broker): retired" in capsys.readouterr().out

    registry.drained("b2", GroupKind.BROKER, wall_ms() - 30_000 - CHANGE_MARGIN_MS - 1000)
    assert registry.retire("b2") == 0


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--resend-window-s", "-1", "'-1' is not a number of seconds, 0 or more"),
        ("--resend-window-s", "a day", "'a day' is not a number of seconds"),
        ("--resend-window-s", "inf", "'inf' is not a number of seconds, 0 or more"),
        ("--doubt-hold-ms", "-5", "-5 is negative; give 0 or more"),
        ("--doubt-hold-ms", "30s", "'30s' is not a whole number"),
    ],
)
def test_a_bad_window_is_refused_saying_why(
    registry: Registry, capsys: pytest.CaptureFixture[str], flag: str, value: str, said: str
):
    with pytest.raises(SystemExit) as exited:
        registry.retire("d1", flag, value)
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {flag}: {said}" in error


def test_the_refusal_reads_as_docs_cluster_md_shows_it(
    registry: Registry, capsys: pytest.CaptureFixture[str]
):
    shown = next(
        line.strip()
        for line in (ROOT / "docs" / "cluster.md").read_text().splitlines()
        if line.strip().startswith("delayd cluster retire: d1 has been draining")
    )
    registry.drained("d1", GroupKind.DELAY, wall_ms() - 2 * 3_600_000)
    assert registry.retire("d1") == 1
    printed = capsys.readouterr().err.strip()
    # Only the wait and its end depend on when the test runs.
    when = re.compile(r"wait \S+ more \(until \S+\)")
    assert when.sub("WHEN", printed) == when.sub("WHEN", shown)
    assert re.search(r"wait 22h\d+[ms] more", printed)
