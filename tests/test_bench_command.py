"""`delayd bench`: the delivery benchmark against a real `delayd serve` process, one
JSON object per figure on stdout. Figures are not judged here (timing is for
docs/benchmarks.md); what is: the command runs, reports the cases, and loses nothing."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_quick_lateness_reports_every_figure_and_loses_nothing(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "delayd", "bench", "--quick", "--only", "lateness"],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
        cwd=tmp_path,
    )
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert rows and all({"bench", "metric", "value", "unit"} <= set(row) for row in rows)
    assert {row["bench"] for row in rows} == {"delivery"}
    figures = {row["metric"]: row["value"] for row in rows}
    assert figures["host_reference_loop"] > 0
    assert figures["lateness_missing"] == 0
    assert figures["lateness_early"] == 0
    assert 0 <= figures["lateness_p50"] <= figures["lateness_p99"] <= figures["lateness_max"]
    assert "burst_last_stored_after_due" not in figures  # only the case asked for


def test_an_unknown_case_is_refused_with_the_choices():
    done = subprocess.run(
        [sys.executable, "-m", "delayd", "bench", "--only", "lateness,latency"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert "unknown case(s) latency; choose from burst, lateness, memory, restart" in done.stderr
