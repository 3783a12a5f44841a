"""Consumers joining and leaving a consumer group while messages flow, with real
processes: a delay server (its embedded broker), a producer at a steady rate that is
never paused, and consumer processes started and stopped (SIGTERM: a graceful leave)
one after another. A queue moves only once its old owner let go of it
(docs/broker.md, "Rebalancing"), so the checker counts 0 seen twice, as well as 0
lost and 0 early.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.delivery_support import now_ms, poll
from tests.fault_checker import History, check
from tests.fault_load import LoadProcess
from tests.intake_support import ServeProcess, write_config
from tests.test_broker_discovery import Loopback, cancelled

pytestmark = pytest.mark.slow

SETTLE_S = 10.0  # after the last due time, for the consumers to see everything
HANDOVERS = "delayd_broker_rebalance_handover_seconds_count"


def test_consumers_join_and_leave_under_load_and_see_nothing_twice(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "serve.toml",
        "[wheel]\nload_ahead_ms = 300\n"
        "[delivery]\nmax_batch = 32\ndispatch_flush_interval_ms = 50\n",
    )
    server = ServeProcess(tmp_path / "delay", "--config", config).start()
    assert server.address is not None and server.broker_address is not None
    intake = f"127.0.0.1:{server.address[1]}"
    broker = f"127.0.0.1:{server.broker_address[1]}"
    host = Loopback()
    processes: list[LoadProcess] = []

    def start(role: str, name: str, target: str, *args: str) -> LoadProcess:
        history = tmp_path / f"{name}.jsonl"
        process = LoadProcess(host, role, target, history, "--prefix", name, *args)
        processes.append(process)
        return process

    try:
        producer = start("produce", "p", intake, "--max-delay-ms", "300")
        c1 = start("consume", "c1", broker)
        c1.wait_for("seen", 100)
        # Each change while c1..c4 read and the producer goes on: a join moves queues
        # away from the members that read them, a leave moves the leaver's to the rest.
        c2 = start("consume", "c2", broker)
        c2.wait_for("seen", 50)
        c3 = start("consume", "c3", broker)
        c3.wait_for("seen", 50)
        seen_by_c2 = len(c2.events("seen"))
        c1.stop()
        c2.wait_for("seen", seen_by_c2 + 50)
        c4 = start("consume", "c4", broker)
        c4.wait_for("seen", 50)
        c2.stop()
        producer.wait_for("acked", len(producer.events("acked")) + 200)
        producer.stop()
        last_due = max(e["due_ms"] for e in producer.events("acked"))
        acked = {e["id"] for e in producer.events("acked")} - cancelled(producer)
        consumers = [c1, c2, c3, c4]
        seen = lambda: {e["id"] for c in consumers for e in c.events("seen")}  # noqa: E731
        wait_s = (last_due - now_ms()) / 1000 + SETTLE_S
        poll(lambda: acked <= seen(), wait_s, "every acknowledged message seen")
        c3.stop()
        c4.stop()
        history = History.from_events(e for p in processes for e in p.events())
        report = check(history, due_by_ms=last_due)
        report.assert_clean()
        assert not report.twice
        assert server.metrics()[HANDOVERS] >= 4, "queues moved between live consumers"
    finally:
        for process in processes:
            if process.process.poll() is None:
                process.process.kill()
        server.close()
