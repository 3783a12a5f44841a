"""The operator's kit in deploy/, each piece checked against the real thing: the
dashboard's and the alert rules' queries name only metrics a live ``delayd serve``
exports and parse as PromQL; the rules pass ``promtool check rules`` and their unit
tests; the systemd unit passes ``systemd-analyze verify`` and outwaits the graceful
stop; the Dockerfile passes hadolint and runs a command the CLI accepts."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from delayd.server.app import SHUTDOWN_GRACE_S
from storage.descriptor_limit import MAX_DESCRIPTORS
from tests.exported_metrics import exported_by_a_live_server, parse_exposition
from tests.process_support import DELAYD, ROOT, child_env

DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "delayd-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "delayd-alerts.yml"
ALERT_TESTS = DEPLOY / "prometheus" / "delayd-alerts.test.yml"
UNIT = DEPLOY / "systemd" / "delayd.service"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
# Grafana's variables, as a query sees them once Grafana filled them in.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$instance": ".*"}
# After a SIGTERM the intake listener and then the embedded broker's each give their
# connections SHUTDOWN_GRACE_S; the flushes and checkpoints that follow take moments.
STOP_MARGIN_S = 10


def require(tool: str) -> str:
    """The path of ``tool``; skipped where it is not installed, except in CI (.ci/run
    installs it), where its absence fails the test."""
    path = shutil.which(tool) or shutil.which(tool, path=os.path.dirname(sys.executable))
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{tool} is not installed; .ci/run installs it")
        pytest.skip(f"{tool} is not installed")
    return path


# ---------------------------------------------------------------- PromQL names

_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
_TOKEN = re.compile(r"(?P<number>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)|(?P<word>[A-Za-z_:][\w:]*)")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers that are not functions or
    aggregations (followed by ``(``), keywords, or label names (in ``{...}``, in
    ``by``/``without``/``on``/``ignoring``/``group_*`` lists), strings or durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\boffset\s+-?\w+", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for token in _TOKEN.finditer(text):
        word = token.group("word")
        if word is None or word.lower() in _KEYWORDS:
            continue
        if text[token.end() :].lstrip().startswith("("):
            continue
        names.add(word)
    return names


def test_metric_names_of_an_expression():
    assert metric_names(
        'histogram_quantile(0.99, sum by (instance, le) (rate(a_bucket{x="y{}"}[5m])))'
    ) == {"a_bucket"}
    assert metric_names("sum(b) by (group) > 1e3 and on (instance) c offset 5m") == {"b", "c"}
    assert metric_names("deriv(sum by (i) (d)[6h:5m]) > 0 unless absent(e)") == {"d", "e"}
    assert metric_names("time() - f > 300") == {"f"}


def dashboard_queries() -> list[str]:
    """Every PromQL query of the dashboard: panel targets, nested rows included, and the
    metric of each ``label_values(metric, label)`` variable."""
    queries: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                queries.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    dashboard = json.loads(DASHBOARD.read_text())
    walk(dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((\w+),\s*\w+\)", variable["definition"])
            assert match, variable["definition"]
            queries.append(match.group(1))
    return [_filled(query) for query in queries]


def _filled(query: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        query = query.replace(variable, value)
    return query


def alert_rules() -> list[dict]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> set[str]:
    page = exported_by_a_live_server(tmp_path_factory.mktemp("deploy") / "data")
    return {name for family in parse_exposition(page).values() for name in family.sample_names()}


@pytest.mark.slow
def test_dashboard_and_alerts_name_only_exported_metrics(exported):
    queries = dashboard_queries()
    rules = alert_rules()
    assert len(queries) >= 30 and len(rules) >= 15
    used: dict[str, set[str]] = {}
    for where, expr in [("dashboard", q) for q in queries] + [
        (rule["alert"], rule["expr"]) for rule in rules
    ]:
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        for name in names:
            used.setdefault(name, set()).add(where)
    missing = {name: sorted(where) for name, where in used.items() if name not in exported}
    assert missing == {}
    # The kit covers the server: intake, delivery, pending, disk, broker, connections.
    for name in (
        "delayd_intake_accepted_messages_total",
        "delayd_delivery_lateness_seconds_bucket",
        "delayd_pending_messages",
        "delayd_store_free_bytes",
        "delayd_broker_subject_consumer_lag_messages",
        "delayd_open_connections",
    ):
        assert name in used, name


def test_dashboard_queries_parse_as_promql(tmp_path):
    """promtool parses every dashboard query (as a recording rule each)."""
    promtool = require("promtool")
    rules = [
        {"record": f"dashboard:query_{i}", "expr": query}
        for i, query in enumerate(dashboard_queries())
    ]
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(rules)} rules found" in done.stdout


def test_dashboard_panels_do_not_overlap():
    """Grafana places panels by gridPos: two on one cell hide each other; and tells
    them apart by id."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[x, y]}"
                cells[x, y] = panel["title"]


def test_alert_rules_pass_promtool_and_their_unit_tests():
    promtool = require("promtool")
    check = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in check.stdout
    unit = subprocess.run(
        [promtool, "test", "rules", ALERT_TESTS.name],
        cwd=ALERT_TESTS.parent,
        capture_output=True,
        text=True,
    )
    assert unit.returncode == 0, unit.stdout + unit.stderr
    tested = set(re.findall(r"alertname: (\w+)", ALERT_TESTS.read_text()))
    assert len(tested) >= 2 and tested <= {rule["alert"] for rule in alert_rules()}


# ---------------------------------------------------------------- systemd


def unit_settings() -> dict[str, str]:
    settings = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


def test_systemd_unit_outwaits_the_graceful_stop_and_lifts_the_descriptor_limit():
    settings = unit_settings()
    assert int(settings["TimeoutStopSec"]) >= 2 * SHUTDOWN_GRACE_S + STOP_MARGIN_S
    assert settings["KillSignal"] == "SIGTERM"
    # The most the server raises its soft limit to (storage/descriptor_limit.py).
    assert int(settings["LimitNOFILE"]) == MAX_DESCRIPTORS
    assert settings["Restart"] == "on-failure"


def test_systemd_unit_verifies_and_starts_a_real_command(tmp_path):
    analyze = require("systemd-analyze")
    settings = unit_settings()
    program, *args = shlex.split(settings["ExecStart"])
    assert Path(program).name == "delayd" and args[0] == "serve"
    # The flags are the CLI's: it accepts them.
    done = subprocess.run(
        [*DELAYD, *args, "--print-config"], capture_output=True, text=True, env=child_env()
    )
    assert done.returncode == 0, done.stderr
    # systemd-analyze checks that ExecStart is executable: point it at this venv's.
    here = shutil.which("delayd", path=os.path.dirname(sys.executable))
    if here is None:
        pytest.skip("no delayd script in this environment (pip install -e .)")
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(program, here))
    verify = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert verify.returncode == 0 and UNIT.name not in verify.stderr, verify.stderr


# ---------------------------------------------------------------- Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each instruction, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, arguments = line.partition(" ")
            out.append((instruction.upper(), arguments.strip()))
    return out


def test_dockerfile_passes_hadolint():
    hadolint = require("hadolint")
    done = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_copies_what_exists_and_runs_a_real_command():
    instructions = dockerfile_instructions()
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for instruction, arguments in instructions:
        if instruction == "COPY":
            *sources, _ = arguments.split()
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
                assert source in kept, f"COPY {source}: excluded by .dockerignore"
    entrypoint = next(json.loads(a) for i, a in instructions if i == "ENTRYPOINT")
    command = next(json.loads(a) for i, a in instructions if i == "CMD")
    assert entrypoint == ["delayd"]
    done = subprocess.run(
        [*DELAYD, *command, "--print-config"], capture_output=True, text=True, env=child_env()
    )
    assert done.returncode == 0, done.stderr
    # Every port it listens on is exposed, and the health check asks the metrics one.
    listens = re.findall(r'listen = "0\.0\.0\.0:(\d+)"', done.stdout)
    exposed = next(a for i, a in instructions if i == "EXPOSE").split()
    assert sorted(listens) == sorted(exposed) and len(listens) == 3
    metrics_port = re.search(r'metrics_listen = "0\.0\.0\.0:(\d+)"', done.stdout).group(1)
    health = next(a for i, a in instructions if i == "HEALTHCHECK")
    assert f"127.0.0.1:{metrics_port}/healthz" in health
