"""The fault harness on today's single-node server, with real processes on real hosts:
``delayd serve`` on host a; producers and consumers (tests/fault_load.py, the public
blocking clients) on other hosts; faults are a kill -9, a pulled cable and a
partition. After each run the checker (tests/fault_checker.py) must count 0 lost,
0 early, 0 twice and every CANCELLED honoured.
"""

from __future__ import annotations

import itertools
import random
import time
from pathlib import Path

import pytest

from tests.delivery_support import now_ms
from tests.fault_load import Load, LoadProcess
from tests.netns_group import BROKER_PORT, PORT, serve_on
from tests.netns_support import (
    Network,
)

pytestmark = [pytest.mark.netns, pytest.mark.slow]

KILLS = 2
FAULT_S = 2.0  # how long a cut or a partition lasts: twice the clients' time-out


def outcomes(process: LoadProcess, kind: str) -> list[str | None]:
    return [e["outcome"] for e in process.events(kind)]


def test_kill_9_of_the_server_under_load(network: Network, tmp_path: Path) -> None:
    a, b = network.host("a"), network.host("b")
    server = serve_on(a, tmp_path / "data").start()
    load = Load(f"{a.address}:{PORT}", f"{a.address}:{BROKER_PORT}", tmp_path)
    consumer = load.consumer(b, "consumer")
    producer = load.producer(b, "producer", "--seed", "1")
    consumer.wait_for("seen", 20)
    rng = random.Random(20)
    kills_ms = []
    for _ in range(KILLS):
        producer.wait_for("acked", len(producer.events("acked")) + 100)
        time.sleep(rng.uniform(0, 0.2))  # the kill's moment, not a synchronisation
        server.kill()
        kills_ms.append(now_ms())
        server.start()
    producer.wait_for("acked", len(producer.events("acked")) + 100)
    report = load.finish()

    acked_ms = [e["ms"] for e in producer.events("acked")]
    seen_ms = [e["seen_ms"] for e in consumer.events("seen")]
    for start_ms, end_ms in itertools.pairwise([*kills_ms, max(acked_ms)]):
        assert any(start_ms < ms <= end_ms for ms in acked_ms), "acks after each restart"
    assert min(seen_ms) < kills_ms[0] and max(seen_ms) > kills_ms[-1]
    assert "CANCELLED" in outcomes(producer, "cancel")
    assert "RESCHEDULED" in outcomes(producer, "reschedule")
    assert report.acked >= 100 * (KILLS + 1)
    assert server.log_path.read_text().count("delivering: replay caught up") == KILLS + 1
    server.close()


def test_a_host_cut_from_the_network_under_load(network: Network, tmp_path) -> None:
    a, b = network.host("a"), network.host("b")
    server = serve_on(a, tmp_path / "data").start()
    load = Load(f"{a.address}:{PORT}", f"{a.address}:{BROKER_PORT}", tmp_path)
    consumer = load.consumer(b, "consumer")
    producer = load.producer(b, "producer", "--seed", "2", "--timeout-s", "1")
    producer.wait_for("acked", 100)
    a.cut()
    time.sleep(FAULT_S)
    a.restore()
    restored_ms = now_ms()
    producer.wait_for("acked", len(producer.events("acked")) + 150)
    report = load.finish()

    errors = producer.events("error") + consumer.events("error")
    assert any(e["error"] == "DelaydTimeout" for e in errors), "the clients saw the cut"
    assert any(e["ms"] > restored_ms for e in producer.events("acked"))
    assert any(e["seen_ms"] > restored_ms for e in consumer.events("seen"))
    assert report.acked >= 250
    server.close()


def test_a_partition_between_two_hosts_leaves_the_third(network, tmp_path) -> None:
    a, b, c = network.host("a"), network.host("b"), network.host("c")
    server = serve_on(a, tmp_path / "data").start()
    load = Load(f"{a.address}:{PORT}", f"{a.address}:{BROKER_PORT}", tmp_path)
    load.consumer(c, "consumer")
    cut_off = load.producer(b, "cut-off", "--seed", "3", "--timeout-s", "1")
    reaching = load.producer(c, "reaching", "--seed", "4", "--timeout-s", "1")
    cut_off.wait_for("acked", 100)
    reaching.wait_for("acked", 100)
    network.partition(a, b)
    partitioned_ms = now_ms()
    time.sleep(FAULT_S)
    healing_ms = now_ms()  # the partition holds until heal() begins
    network.heal()
    cut_off.wait_for("acked", len(cut_off.events("acked")) + 100)
    load.finish()

    def acked_between(process: LoadProcess, start_ms: int, end_ms: int) -> int:
        """Acks recorded in the partition, once what was in flight when it began had
        its 1 s time-out (and a slow machine its margin)."""
        return sum(start_ms + 1500 < e["ms"] < end_ms for e in process.events("acked"))

    # b's answers stopped within the timeout; c's went on all the while
    assert acked_between(cut_off, partitioned_ms, healing_ms) == 0
    assert acked_between(reaching, partitioned_ms, healing_ms) > 20
    assert any(e["error"] == "DelaydTimeout" for e in cut_off.events("error"))
    assert not reaching.events("error")
    server.close()
