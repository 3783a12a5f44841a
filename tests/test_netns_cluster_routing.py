"""A cluster of single-member delay groups, each member on its own host, under a
producer over ``etcd://ETCD/CLUSTER/*`` (tests/fault_load.py, the public blocking
Producer) on another host, and a consumer of every group's broker: a third group added
mid-run takes new ids; a group drained takes none after the producer's next registry
read, still delivers and answers what it holds, and is retired once empty; a kill -9
of a group's member makes its ids wait (the producer's calls fail) and none of them goes
to another group. The checker over the whole run: 0 lost, 0 early, 0 twice, every
CANCELLED honoured.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from delayd.client._routing import REFRESH_S, owner
from tests.delivery_support import now_ms, poll
from tests.fault_load import LoadProcess
from tests.intake_support import ServeProcess
from tests.netns_support import EtcdHost, Host, Network
from tests.process_support import DELAYD, ROOT, child_env
from tests.test_netns_single_node import Load

pytestmark = [pytest.mark.netns, pytest.mark.slow]

PORT, BROKER_PORT, REPLICATION_PORT, METRICS_PORT = 7000, 7001, 7002, 7003
MAX_DELAY_MS = 1500  # fault_load's default: a drained group is empty this long after
SETTLED_S = REFRESH_S + 1.0  # a registry change reaches the producer within this
TIMEOUT_S = 2.0  # the producer's: a call to the killed group fails after this
DOWN_S = TIMEOUT_S + 1.5  # so at least one call fails while it is down


class ClusterLoad(Load):
    """Load over a cluster: the producers send to every delay group, one consumer per
    group's broker."""

    def __init__(self, tmp_path: Path, etcd: EtcdHost) -> None:
        self.cluster = f"c{uuid.uuid4().hex[:8]}"
        self.etcd = etcd
        every_delay_group = f"etcd://{etcd.url.removeprefix('http://')}/{self.cluster}/*"
        super().__init__(every_delay_group, "", tmp_path)  # consumers: one per group's broker
        self.members: dict[str, ServeProcess] = {}
        self.consumers_of: dict[str, LoadProcess] = {}

    def group(self, name: str, host: Host, consumer_host: Host) -> ServeProcess:
        """Start the single member of delay group ``name`` on ``host``, and a consumer of
        its broker on ``consumer_host``."""
        member = ServeProcess(
            self.tmp_path / name,
            "--etcd", self.etcd.url, "--group", name, "--cluster", self.cluster,
            "--listen", f"{host.address}:{PORT}",
            "--broker-listen", f"{host.address}:{BROKER_PORT}",
            metrics_listen=f"{host.address}:{METRICS_PORT}",
            env={
                "DELAYD_CLUSTER_REPLICATION_LISTEN": f"{host.address}:{REPLICATION_PORT}",
                "DELAYD_CLUSTER_LEASE_TTL_MS": "1000",
                "DELAYD_CLUSTER_ACK": "leader",  # one member: nobody to wait for
            },
            command_prefix=tuple(host.command_prefix),
        ).start()  # fmt: skip
        self.members[name] = member
        self.broker = f"{host.address}:{BROKER_PORT}"
        self.consumers_of[name] = self.consumer(consumer_host, f"consumer-{name}")
        return member

    def cli(self, host: Host, *args: str, check: bool = True) -> str:
        """``delayd cluster ARGS`` on ``host``; its stdout and stderr."""
        done = host.run(
            [*DELAYD, "cluster", *args, "--etcd", self.etcd.url, "--cluster", self.cluster],
            cwd=ROOT, env=child_env(), check=check,
        )  # fmt: skip
        return done.stdout + done.stderr

    def seen_by(self, group: str) -> dict[str, int]:
        """The ids the consumer of ``group``'s broker saw, with when they were sent."""
        sent = {e["id"]: e["ms"] for p in self.producers for e in p.events("sent")}
        return {e["id"]: sent[e["id"]] for e in self.consumers_of[group].events("seen")}


def test_groups_added_drained_retired_and_killed_under_load(
    network: Network, netns_etcd: EtcdHost, tmp_path: Path
) -> None:
    g1, g2, g3 = network.host("g1"), network.host("g2"), network.host("g3")
    p, c = network.host("p"), network.host("c")
    load = ClusterLoad(tmp_path, netns_etcd)
    load.group("d1", g1, c)
    load.group("d2", g2, c)
    producer = load.producer(p, "producer", "--seed", "7", "--timeout-s", str(TIMEOUT_S))
    producer.wait_for("acked", 300, timeout_s=30)

    load.group("d3", g3, c)  # added mid-run: registers when its member joins
    added_ms = now_ms()
    producer.wait_for("acked", len(producer.events("acked")) + 300, timeout_s=30)

    assert "draining" in load.cli(p, "drain", "d1")
    drained_ms = now_ms()
    time.sleep(SETTLED_S)  # the producer routes over d2 and d3 only from here on
    producer.wait_for("acked", len(producer.events("acked")) + 300, timeout_s=30)

    d2 = load.members["d2"]
    d2.kill()
    killed_ms = now_ms()
    time.sleep(DOWN_S)
    restarted_ms = now_ms()
    d2.start()
    producer.wait_for("acked", len(producer.events("acked")) + 300, timeout_s=30)
    assert any(killed_ms < e["ms"] < restarted_ms for e in producer.events("error"))

    def retired() -> bool:
        # The producers resend no id: the resend window need not pass first.
        return "retired" in load.cli(p, "retire", "d1", "--resend-window-s", "0", check=False)

    poll(retired, 20, "d1 retires once it holds nothing")
    load.finish()

    # New ids reached the added group; the drained one took none once the producer
    # had read the registry again; while d2 was down none of its ids went elsewhere.
    assert any(sent_ms > added_ms for sent_ms in load.seen_by("d3").values())
    settled_ms = drained_ms + SETTLED_S * 1000
    late = [i for i, sent_ms in load.seen_by("d1").items() if sent_ms > settled_ms]
    assert not late, late[:5]
    for other in ("d1", "d3"):
        strays = [
            i
            for i, sent_ms in load.seen_by(other).items()
            if killed_ms < sent_ms < restarted_ms and owner(i, ["d2", "d3"]) == "d2"
        ]
        assert not strays, (other, strays[:5])
    for member in load.members.values():
        member.close()
