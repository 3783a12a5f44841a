"""tools/bench_brokerdisc.py --embedded, end to end on a small burst: two real delay
groups in a real etcd, each delivering into its embedded broker. Figures are not judged
(timing is for docs/benchmarks.md); what is: every message is stored, half in each
group, and the logs read back after the run show each one dispatched once, none early."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_brokerdisc.py"


@pytest.mark.slow
def test_embedded_burst_reports_every_message_stored_and_none_early():
    done = subprocess.run(
        [sys.executable, str(TOOL), "--embedded", "--messages", "2000"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    figures = {
        row["metric"]: row for row in rows if row["metric"] != "cluster_burst_stored_in_group"
    }
    stored = {
        row["group"]: row["value"]
        for row in rows
        if row["metric"] == "cluster_burst_stored_in_group"
    }
    assert stored == {"d1": 1000, "d2": 1000}
    assert figures["cluster_burst_missing"]["value"] == 0
    assert figures["cluster_burst_dispatched"]["value"] == 2000  # read back from dispatch_log
    assert figures["cluster_burst_early"]["value"] == 0
    assert figures["cluster_burst_last_stored_after_due"]["delivery"] == "embedded"
    assert figures["cluster_burst_cpu_per_message"]["value"] > 0


def test_repo_that_is_not_a_checkout_is_refused(tmp_path):
    done = subprocess.run(
        [sys.executable, str(TOOL), "--embedded", "--repo", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert f"--repo {tmp_path}: not a delayd checkout (no delayd/__main__.py)" in done.stderr
