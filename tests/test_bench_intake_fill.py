"""tools/bench_intake_fill.py end to end in its smallest size: a real ``delayd serve``
filled by two rounds of raw clients. Figures are not judged here (docs/benchmarks.md
holds them); what is: every round reports in the shape the docs quote, counted from
the messages the rounds before it left pending."""

from __future__ import annotations

import pytest

from tests.process_support import run_bench_tool

pytestmark = pytest.mark.slow


def test_each_round_reports_its_cpu_per_message_and_the_pending_it_began_with():
    rows = run_bench_tool("bench_intake_fill.py", "--rounds", "2", "--per-round", "20000")
    assert {row["bench"] for row in rows} == {"intake_fill"}
    assert rows[0]["metric"] == "host_reference_loop"
    cpu = [row for row in rows if row["metric"] == "fill_round_server_cpu_per_message"]
    # Each client also sends 20 warm-up frames of 100 before its timed ones.
    assert [(row["round"], row["pending_before"]) for row in cpu] == [(0, 0), (1, 22000)]
    for row in cpu:
        assert row["value"] > 0 and row["unit"] == "us" and row["delays"] == "far"
        assert row["value"] == pytest.approx(row["user_us"] + row["system_us"], abs=0.01)
        assert row["rss_mb"] > 0
    rss = next(row for row in rows if row["metric"] == "server_rss")
    assert rss["pending"] == 44000 and rss["value"] > 0
