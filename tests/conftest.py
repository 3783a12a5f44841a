"""Fixtures every test module may ask for by name (pytest finds them here)."""

from __future__ import annotations

import pytest
import trio.testing

from tests.delivery_support import Processes


@pytest.fixture
def clock() -> trio.testing.MockClock:
    """Virtual time that jumps only after 50 ms of real idleness (pytest-trio runs a
    test on any Clock it is given). The store hops to worker threads — fsync, bucket
    loads, dispatch_log flushes — and a clock that jumped during such a hop, when every
    task looks blocked, would make the wheel look late when it is not."""
    return trio.testing.MockClock(autojump_threshold=0.05)


@pytest.fixture
def procs(tmp_path):
    """``delayd serve`` / ``delayd broker`` children under ``tmp_path``; every one still
    running is killed when the test ends, pass or fail."""
    processes = Processes(tmp_path)
    try:
        yield processes
    finally:
        processes.close()
