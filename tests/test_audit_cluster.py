"""The cluster audit on a real Spark standalone cluster: a master and two workers
started from pyspark's own scripts (tests/spark_standalone.py), and the job handed to
``spark-submit --master spark://…`` over two delay groups' data directories — one
group's two copies read once, another's planted fault found, the logs read on both
workers' executors; and the command docs/audit.md gives finds clean groups clean. Every
process of the cluster is killed at the end."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.audit_support import SPARK_TEST_CONF, group_copy, read_table
from tests.process_support import ROOT
from tests.spark_standalone import (
    SPARK_HOME,
    StandaloneCluster,
    event_log_conf,
    standalone_cluster,
    task_ends,
)

pytestmark = pytest.mark.slow

AS_OF = "2026-11-22T11:00:00Z"
JOB = str(ROOT / "delayd" / "cli" / "spark_submit" / "audit_job.py")
# spark-submit's defaults on the test cluster (its spark-defaults.conf, which the
# documented command reads too): one executor of 512 MiB per worker, and the tiny-input
# settings of the local session's tests (no code generation, C1 only), executors included.
DEFAULTS = {
    **SPARK_TEST_CONF,
    "spark.ui.enabled": "false",
    "spark.executor.memory": "512m",
    "spark.driver.memory": "1g",
    "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1",
}
# The master and the workers: C1 only and the serial collector start a daemon JVM in
# well under half the time on a busy 2-core machine (the cluster came up in ~11 s
# instead of ~25-36 s), and they only pass messages.
DAEMON_JAVA_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("spark-standalone")
    with standalone_cluster(root, defaults=DEFAULTS, daemon_java_opts=DAEMON_JAVA_OPTS) as started:
        yield started
    assert not started.processes(), "a process of the cluster outlived it"


def submit(cluster: StandaloneCluster, tmp_path: Path, *data: str) -> tuple[int, str, Path]:
    """The audit of ``data`` (``--data`` values) on the cluster: exit status, stdout and
    the directory of its event log."""
    events = tmp_path / "events"
    args = [arg for value in data for arg in ("--data", value)]
    # A task per bucket file, so that both executors read some.
    args += ["--out", str(tmp_path / "out"), "--as-of", AS_OF, "--partition-bytes", "0"]
    done: subprocess.CompletedProcess[str] = cluster.submit(
        JOB, *args, conf=event_log_conf(events), timeout_s=240
    )
    return done.returncode, done.stdout + done.stderr, events


def test_spark_submit_on_the_cluster_finds_the_planted_fault_once(cluster, tmp_path):
    g1 = [str(tmp_path / "g1-a"), str(tmp_path / "g1-b")]
    group_copy(g1[0], "g1", 40)
    group_copy(g1[1], "g1", 30)  # a follower that lags
    g2 = str(tmp_path / "g2")
    group_copy(g2, "g2", 50, undelivered=frozenset({7}))

    status, output, events = submit(cluster, tmp_path, f"g1={g1[0]}", f"g1={g1[1]}", f"g2={g2}")

    assert status == 1, output
    out = str(tmp_path / "out")
    found = {(r["kind"], r["server"], r["message_id"]) for r in read_table(out, "discrepancies")}
    assert found == {("overdue", "g2", "g2-7")}
    per_group = {r["server"]: r for r in read_table(out, "summary") if r["bucket"] is None}
    assert {g: (r["scheduled"], r["dispatched"]) for g, r in per_group.items()} == {
        "g1": (40, 40),
        "g2": (50, 49),
        None: (90, 89),  # not 120: g1's lagging copy is not read
    }
    assert f"g1: read {g1[0]} (the copy that holds most; 1 other copy not read)" in output
    # The logs were read on both workers' executors, not on the driver.
    executors = {end["Task Info"]["Executor ID"] for end in task_ends(events)}
    assert len(executors) == 2 and "driver" not in executors, executors


def docs_blocks() -> list[str]:
    """The sh blocks docs/audit.md gives under "On a standalone Spark cluster"."""
    text = (ROOT / "docs" / "audit.md").read_text(encoding="utf-8")
    section = text[text.index("### On a standalone Spark cluster") :]
    return re.findall(r"```sh\n(.*?)```", section, re.S)[:2]


def docs_submit() -> str:
    """The spark-submit command of docs/audit.md."""
    (line,) = [line for line in docs_blocks()[1].splitlines() if "spark-submit" in line]
    return line


def test_the_cluster_is_started_as_the_docs_say(cluster):
    """The daemons run pyspark's spark-class with the classes and options docs/audit.md
    gives (on free ports, with a web UI port and a work directory of their own)."""
    documented = [
        shlex.split(line.rstrip(" &"))[1:]
        for line in docs_blocks()[0].splitlines()
        if "spark-class" in line
    ]
    run = [command[1:] for command in cluster.commands]
    assert (
        [d[0] for d in documented]
        == [r[0] for r in run]
        == [
            "org.apache.spark.deploy.master.Master",
            "org.apache.spark.deploy.worker.Worker",
            "org.apache.spark.deploy.worker.Worker",
        ]
    )
    for doc, ran in zip(documented, run, strict=True):
        assert {a for a in doc if a.startswith("--")} <= {a for a in ran if a.startswith("--")}
        assert [a.startswith("spark://") for a in doc[1:2]] == [
            a.startswith("spark://") for a in ran[1:2]
        ]
    assert all(c[0] == os.path.join(SPARK_HOME, "bin", "spark-class") for c in cluster.commands)


def test_the_documented_spark_submit_audits_clean_groups_clean(cluster, tmp_path):
    dirs = {group: str(tmp_path / group) for group in ("g1", "g2")}
    for group, path in dirs.items():
        group_copy(path, group, 20)
    out = str(tmp_path / "out")
    command = docs_submit().replace("spark://127.0.0.1:7077", cluster.url)
    for group, path in dirs.items():
        command = command.replace(f"/var/lib/delayd/{group}", path)
    command = command.replace("/tmp/audit", out)
    env = {**cluster.env, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}

    done = subprocess.run(
        ["bash", "-c", command], env=env, capture_output=True, text=True, timeout=240, check=False
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert "RESULT: clean" in done.stdout
    assert read_table(out, "discrepancies") == []
    per_group = {
        r["server"]: r["dispatched"] for r in read_table(out, "summary") if r["bucket"] is None
    }
    assert per_group == {"g1": 20, "g2": 20, None: 40}
