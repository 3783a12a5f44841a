"""`delayd bench`: the delivery benchmark against a real `delayd serve` process, one
JSON object per figure on stdout. Figures are not judged here (timing is for
docs/benchmarks.md); what is: the command runs the cases asked for, end to end
(a server started, filled, killed with kill -9 and started again), and reports them."""

from __future__ import annotations

import contextlib
import errno
import json
import socket
import subprocess
import sys

import pytest

# What `make run` listens on: intake, broker, metrics (docs/configuration.md).
DEFAULT_PORTS = (20801, 20811, 20880)


@pytest.fixture
def default_ports_taken():
    """The default ports held by listening sockets (the bench must not need them); a
    port another process already holds (a `make run`) is as good."""
    with contextlib.ExitStack() as stack:
        for port in DEFAULT_PORTS:
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("127.0.0.1", port))
                sock.listen()
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
        yield


@pytest.mark.slow
def test_bench_runs_a_real_server_kills_it_and_reports_every_figure(tmp_path, default_ports_taken):
    # The light cases (a few seconds, little CPU): the suite runs beside other tests
    # whose virtual clocks a CPU-heavy case would starve. With the default ports taken,
    # as by a `make run` beside it: the bench's servers listen on free ports only.
    done = subprocess.run(
        [sys.executable, "-m", "delayd", "bench", "--quick", "--only", "memory,restart",
         "--pending", "2000"],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
        cwd=tmp_path,
    )  # fmt: skip
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert rows and all({"bench", "metric", "value", "unit"} <= set(row) for row in rows)
    assert {row["bench"] for row in rows} == {"delivery"}
    figures = {row["metric"]: row for row in rows}
    assert set(figures) == {
        "host_reference_loop",
        "rss_with_pending",
        "send_rate",
        "restart_to_first_ack",
        "rss_after_restart",
    }  # only the cases asked for
    assert figures["rss_with_pending"]["pending"] == 2000
    assert figures["rss_with_pending"]["value"] > 10  # MB of a live server
    # kill -9, a new process, a send acknowledged: a positive time, in seconds
    assert 0 < figures["restart_to_first_ack"]["value"] < 60


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
