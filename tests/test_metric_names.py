"""Every metric a live ``delayd serve`` exports follows Prometheus' naming conventions
(https://prometheus.io/docs/practices/naming/), as docs/operations.md states them:
base units in the name, ``_total`` on counters, ``_timestamp_seconds`` on points in
time, bounded labels; and the process and build series an operator expects are there."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
import trio

import delayd
from tests.broker_support import BrokerProcess
from tests.exported_metrics import Family, exported_by_a_live_server, parse_exposition
from tests.process_support import ROOT
from tests.test_deploy import require

pytestmark = pytest.mark.slow

# The last word of a name (before ``_total`` on a counter): a base unit, or the thing
# counted (a plural noun, as ``http_requests_total``); ``info`` for a constant-1 series
# whose labels carry the value, ``state`` for an enumeration (documented values).
UNITS = {
    "seconds",
    "bytes",
    "ratio",
    "messages",
    "records",
    "entries",
    "files",
    "segments",
    "connections",
    "frames",
    "ids",
    "buckets",
    "passes",
    "lookups",
    "checkpoints",
    "writes",
    "failures",
    "errors",
    "requests",
    "fds",
    "info",
    "state",
    "revision",
    "elections",
    "members",
    "snapshots",
}
# 0/1 gauges: a flag has no unit, as Prometheus's own ``up``.
FLAGS = {"delayd_intake_id_filter_warm"}
# Label names with a bounded set of values: a listener, a reason or code from an enum,
# a log, a configured broker group, a horizon band, a broker subject and queue number,
# a histogram bound, the build, a member of the replicated group (as many as the group
# has). Never a message id, a peer or a connection.
LABELS = {
    "listener",
    "reason",
    "code",
    "outcome",
    "log",
    "group",
    "horizon",
    "subject",
    "queue",
    "le",
    "version",
    "member",
}
PREFIXES = ("delayd_", "process_")
# The standard process series every Prometheus client library exports under this name,
# older than the ``_timestamp_seconds`` rule.
STANDARD_TIMES = {"process_start_time_seconds"}


@pytest.fixture(scope="module")
def exported_page(tmp_path_factory) -> str:
    return exported_by_a_live_server(tmp_path_factory.mktemp("names") / "data")


@pytest.fixture(scope="module")
def exported(exported_page) -> dict[str, Family]:
    return parse_exposition(exported_page)


def naming_problems(families: dict[str, Family]) -> list[str]:
    """What breaks the rules in ``families``, one line per problem."""
    problems = []
    for name, family in sorted(families.items()):
        words = name.split("_")
        if not name.startswith(PREFIXES):
            problems.append(f"{name}: not under delayd_ or process_")
        if family.type == "counter":
            if words[-1] != "total":
                problems.append(f"{name}: a counter must end in _total")
            unit = words[-2]
        else:
            if words[-1] == "total":
                problems.append(f"{name}: a {family.type} must not end in _total")
            unit = words[-1]
        if unit not in UNITS and name not in FLAGS:
            problems.append(f"{name}: no unit ({unit!r} is not one of the units)")
        point_in_time = any(w in family.help.lower() for w in ("epoch", "unix time"))
        in_seconds = name.endswith("_timestamp_seconds") or name in STANDARD_TIMES
        if point_in_time and not in_seconds:
            problems.append(f"{name}: a point in time must end in _timestamp_seconds")
        if "timestamp" in words and not name.endswith("_timestamp_seconds"):
            problems.append(f"{name}: a timestamp must be in seconds")
        for _, labels, _ in family.samples:
            for label in set(labels) - LABELS:
                problems.append(f"{name}: label {label!r} is not a bounded one")
    return sorted(set(problems))


def test_every_exported_name_follows_the_rules(exported):
    assert naming_problems(exported) == []
    # The check saw the labelled families with their samples, not empty shells.
    for name in (
        "delayd_delivery_sent_messages_total",
        "delayd_broker_consumer_lag_messages",
        "delayd_pending_messages",
        "delayd_store_bytes",
        "delayd_delivery_lateness_seconds",
    ):
        assert exported[name].samples, name


def exported_by_a_group_member() -> dict[str, Family]:
    """The metrics only a member of a group exports (delayd.serving.membership_metrics),
    from its collector: a server running alone, as the live one above, has none."""
    from prometheus_client import CollectorRegistry, generate_latest

    from delayd.cluster.config import ClusterConfig
    from delayd.serving.membership import Membership
    from delayd.serving.membership_metrics import MembershipCollector

    registry = CollectorRegistry(auto_describe=False)
    config = ClusterConfig(etcd=("http://127.0.0.1:2379",), group="g")
    registry.register(MembershipCollector(Membership(config)))
    return parse_exposition(generate_latest(registry).decode())


def test_a_group_members_metrics_follow_them_too():
    families = exported_by_a_group_member()
    assert naming_problems(families) == []
    assert "delayd_cluster_not_leader_requests_total" in families


def exported_by_replication(data_dir: Path) -> dict[str, Family]:
    """The metrics of a replication Leader and of a Follower (delayd.replication.metrics),
    scraped from the collector on a fresh data directory: a server running alone has
    neither."""
    from prometheus_client import CollectorRegistry, generate_latest

    from delayd.replication import DelayStreams, EpochHistory, Follower, Leader
    from delayd.replication.metrics import ReplicationCollector

    async def scrape() -> dict[str, Family]:
        streams = DelayStreams(str(data_dir))
        history = EpochHistory.open_in(str(data_dir))
        try:
            leader = Leader(streams, history, 1, group="g")
            follower = Follower(streams, history, group="g", member="m", leader=("::1", 1))
            families = {}
            for role in (leader, follower):
                registry = CollectorRegistry(auto_describe=False)
                registry.register(ReplicationCollector(lambda role=role: role))
                families.update(parse_exposition(generate_latest(registry).decode()))
            return families
        finally:
            streams.close()
            history.close()

    return trio.run(scrape)


def test_replications_metrics_follow_them_too(tmp_path):
    families = exported_by_replication(tmp_path)
    assert naming_problems(families) == []
    assert "delayd_replication_follower_lag_bytes" in families
    assert "delayd_replication_received_bytes_total" in families


def renamed_in_the_docs() -> dict[str, str]:
    """old -> new, from the "Renamed metrics" table of docs/operations.md."""
    text = (ROOT / "docs" / "operations.md").read_text()
    table = text[text.index("### Renamed metrics") :]
    table = table[: table.index("\n#")]
    return dict(re.findall(r"^\| `(delayd_\w+)` \| `(delayd_\w+)`", table, re.M))


def test_the_docs_name_only_exported_metrics(exported, tmp_path):
    """Every ``delayd_…`` name in docs/ and the README is one the server exports, or
    an old name in the table of renames, whose new name it exports."""
    renamed = renamed_in_the_docs()
    assert len(renamed) >= 20
    exported = {**exported, **exported_by_a_group_member(), **exported_by_replication(tmp_path)}
    names = set(exported) | {n for family in exported.values() for n in family.sample_names()}
    assert set(renamed.values()) <= names
    documented = set()
    for path in [*(ROOT / "docs").glob("*.md"), ROOT / "README.md"]:
        documented |= set(re.findall(r"\bdelayd_[a-z0-9_]*[a-z0-9]", path.read_text()))
    assert documented - names - set(renamed) == set()


def test_a_standalone_broker_follows_them_too(tmp_path, procs):
    """``delayd broker`` registers its collectors its own way (from before recovery)."""
    broker = procs.start(BrokerProcess(tmp_path / "data"))
    families = parse_exposition(broker.metrics_page())
    assert naming_problems(families) == []
    assert "delayd_broker_stored_messages_total" in families
    assert families["delayd_build_info"].samples


def test_promtool_lints_the_page_clean(exported_page):
    """promtool's own linter (``promtool check metrics``) agrees."""
    promtool = require("promtool")
    done = subprocess.run(
        [promtool, "check", "metrics"], input=exported_page, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_rules_catch_what_they_are_for():
    page = "\n".join(
        [
            "# HELP delayd_sent Messages sent.",
            "# TYPE delayd_sent counter",
            "delayd_sent 1",
            "# HELP delayd_queue_depth Messages queued.",
            "# TYPE delayd_queue_depth gauge",
            "delayd_queue_depth 3",
            "# HELP delayd_last_pass_ms When (epoch ms) the last pass ended.",
            "# TYPE delayd_last_pass_ms gauge",
            "delayd_last_pass_ms 1",
            "# HELP delayd_open_connections Connections.",
            "# TYPE delayd_open_connections gauge",
            'delayd_open_connections{peer="10.0.0.1:5555"} 1',
            "# HELP delayd_done_messages_total Done.",
            "# TYPE delayd_done_messages_total counter",
            "delayd_done_messages_total 1",
        ]
    )
    problems = naming_problems(parse_exposition(page + "\n"))
    assert "delayd_sent: a counter must end in _total" in problems
    assert "delayd_queue_depth: no unit ('depth' is not one of the units)" in problems
    assert "delayd_last_pass_ms: a point in time must end in _timestamp_seconds" in problems
    assert "delayd_open_connections: label 'peer' is not a bounded one" in problems
    assert not any(p.startswith("delayd_done_messages_total") for p in problems)


def test_points_in_time_are_in_seconds(exported):
    """The pending message due in an hour makes the oldest undelivered bucket now-ish:
    a Unix time in seconds, not milliseconds."""
    (sample,) = exported["delayd_store_oldest_undelivered_bucket_start_timestamp_seconds"].samples
    assert abs(sample[2] - time.time()) < 2 * 3600
    (loading,) = exported["delayd_wheel_loading_bucket_start_timestamp_seconds"].samples
    assert abs(loading[2] - time.time()) < 2 * 3600


def test_process_and_build_series(exported):
    for name in (
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
    ):
        assert exported[name].samples, name
    (start,) = exported["process_start_time_seconds"].samples
    assert 0 < time.time() - start[2] < 600
    (build,) = exported["delayd_build_info"].samples
    assert build[1] == {"version": delayd.__version__} and build[2] == 1


def test_lateness_has_a_zero_bucket(exported):
    """Lateness is whole milliseconds; an on-time delivery must be counted at 0, so a
    quantile of on-time deliveries is 0, not half the first bound."""
    bounds = [
        float(labels["le"])
        for sample_name, labels, _ in exported["delayd_delivery_lateness_seconds"].samples
        if sample_name.endswith("_bucket")
    ]
    assert bounds[0] == 0.0 and bounds[1] < 0.001
