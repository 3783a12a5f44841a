"""The delivery metrics of a live `delayd serve` under a known workload, and /readyz."""

from __future__ import annotations

import urllib.error
import urllib.request

from delayd.protocol import Message
from tests.delivery_support import poll
from tests.intake_support import RawClient, terminate


def test_delivery_metrics_follow_the_workload(procs, tmp_path):
    server = procs.serve(tmp_path / "data", "--metrics-listen", "127.0.0.1:0")
    url = "http://{}:{}/readyz".format(*server.metrics_address)

    def ready() -> bool:
        try:
            return urllib.request.urlopen(url, timeout=5).status == 200
        except urllib.error.HTTPError as not_ready:
            assert not_ready.code == 503
            return False

    poll(ready)
    client = RawClient(server.address)
    soon = [Message(f"soon-{i}", "orders", delay_ms=200) for i in range(5)]
    later = [Message(f"later-{i}", "orders", delay_ms=7_200_000) for i in range(3)]
    near = [Message(f"near-{i}", "orders", delay_ms=30_000) for i in range(4)]
    client.send_batch(soon + later + near)
    poll(lambda: server.metrics()['delayd_delivery_sent_messages_total{group="local"}'] == 5)
    values = server.metrics()
    assert values["delayd_delivery_lateness_seconds_count"] == 5
    assert values['delayd_delivery_lateness_seconds_bucket{le="+Inf"}'] == 5
    # The 30 s ones are within the 2-minute load window, in the wheel; the 2 h ones are
    # on disk only.
    assert values["delayd_wheel_entries"] == 4
    assert values["delayd_wheel_outstanding_messages"] == 4
    assert values['delayd_delivery_circuit_state{group="local"}'] == 0
    assert values['delayd_delivery_failed_messages_total{group="local"}'] == 0
    assert values["delayd_delivery_in_flight_messages"] == 0
    assert values["delayd_wheel_loaded_ahead_seconds"] > 0
    client.close()
    terminate(server)
