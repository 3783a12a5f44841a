"""Operator metrics read from the logs, on a live `delayd serve` under a known workload:
pending messages by horizon (docs/operations.md), the oldest undelivered bucket, the
store's bytes and files — and the same numbers after a restart, which counts what the
logs hold instead of following the hook."""

from __future__ import annotations

import os
import time

from delayd.logs import layout
from delayd.logs.buckets import bucket_of
from delayd.protocol import Message
from tests.broker_support import BrokerProcess, messages
from tests.delivery_support import poll
from tests.intake_support import RawClient, ServeProcess, terminate

SECOND_MS = 1000
MINUTE_MS = 60 * SECOND_MS
HOUR_MS = 60 * MINUTE_MS
DAY_MS = 24 * HOUR_MS

# delay -> messages. Each delay sits well inside its band, so the band does not depend
# on when the test scrapes: 4 s is delivered during the test, 45 s is not (it would
# be, were the test ever 40 s slower).
WORKLOAD = {
    4 * SECOND_MS: 2,
    45 * SECOND_MS: 3,
    5 * MINUTE_MS: 4,
    30 * MINUTE_MS: 5,
    5 * HOUR_MS: 6,
    3 * DAY_MS: 7,
}
BANDS = {"1m": 2 + 3, "10m": 4, "1h": 5, "1d": 6, "later": 7}


def pending(server) -> dict[str, float]:
    values = server.metrics()
    return {
        band: values[f'delayd_pending_messages{{horizon="{band}"}}']
        for band in ("1m", "10m", "1h", "1d", "later")
        if f'delayd_pending_messages{{horizon="{band}"}}' in values
    }


def files_of(directory: str) -> tuple[int, int]:
    """(segments, bytes of all files) under a directory, as the store metrics count
    them: segments are the files named by digits."""
    segments = size = 0
    for root, _, names in os.walk(directory):
        for name in names:
            segments += name.isdigit()
            size += os.path.getsize(os.path.join(root, name))
    return segments, size


def test_pending_by_horizon_follows_schedule_and_dispatch_logs(procs, tmp_path):
    data = tmp_path / "data"
    server = procs.serve(data)
    client = RawClient(server.address)
    sent_at_ms = time.time_ns() // 1_000_000
    batch = [
        Message(f"d{delay}-{i}", "orders", delay_ms=delay)
        for delay, count in WORKLOAD.items()
        for i in range(count)
    ]
    results = client.send_batch(batch)
    assert all(r.code.is_success for r in results)
    # The counts follow the replayer and a pass over dispatch_log every second, both
    # late on a loaded machine: the waits return once the counts are there, so their
    # bounds are generous.
    poll(lambda: pending(server) == BANDS, 20, f"pending == {BANDS}")

    # The oldest undelivered bucket is that of the 4 s messages.
    first_due = min(r.due_ms for r in results)
    assert first_due >= sent_at_ms + 4 * SECOND_MS
    oldest = "delayd_store_oldest_undelivered_bucket_start_timestamp_seconds"
    assert server.metrics()[oldest] == bucket_of(first_due, 1) / 1000

    # Delivered: they leave the 1m band, nothing else moves.
    sent = 'delayd_delivery_sent_messages_total{group="local"}'
    poll(lambda: server.metrics()[sent] == 2, 20, "2 sent")
    after = {**BANDS, "1m": 3}
    poll(lambda: pending(server) == after, 20, f"pending == {after}")
    second_due = min(r.due_ms for r in results if r.due_ms > first_due + 10 * SECOND_MS)
    assert server.metrics()[oldest] == bucket_of(second_due, 1) / 1000

    # The store: what the files hold, once the walk after the workload has run.
    def store_matches() -> bool:
        values = server.metrics()
        for log, directory in (
            ("message_log", layout.message_log_dir(str(data))),
            ("schedule_log", layout.schedule_log_dir(str(data))),
            ("dispatch_log", layout.dispatch_log_dir(str(data))),
            ("broker_commitlog", str(data / "broker" / "commitlog")),
        ):
            files, size = files_of(directory)
            if values[f'delayd_store_segments{{log="{log}"}}'] != files:
                return False
            if values[f'delayd_store_bytes{{log="{log}"}}'] != size:
                return False
        return True

    poll(store_matches, 15, "store metrics equal to the files")
    buckets = {bucket_of(r.due_ms, 1) for r in results}
    assert server.metrics()['delayd_store_segments{log="schedule_log"}'] == len(buckets)
    assert server.metrics()['delayd_store_segments{log="dispatch_log"}'] >= 1
    client.close()
    terminate(server)

    # A restart counts the logs: same numbers, none of the hook's.
    assert time.time_ns() // 1_000_000 < sent_at_ms + 35 * SECOND_MS, "too slow for 45 s"
    server = procs.serve(data)
    poll(lambda: pending(server) == after, 20, f"pending == {after} after a restart")
    assert server.metrics()[oldest] == bucket_of(second_due, 1) / 1000
    terminate(server)


def test_metrics_listen_on_without_a_flag(tmp_path, procs):
    """No --metrics-listen: /metrics is served (by default on 127.0.0.1:20880; here
    the environment moves it to a free port, so that parallel tests cannot collide),
    with every pending band at 0 on an empty data directory."""
    server = procs.start(
        ServeProcess(
            tmp_path / "data",
            metrics_listen=None,
            env={"DELAYD_SERVER_METRICS_LISTEN": "127.0.0.1:0"},
        )
    )
    assert server.metrics_address is not None
    poll(lambda: bool(pending(server)), 20, "the start-up count")
    assert pending(server) == dict.fromkeys(BANDS, 0)
    oldest = "delayd_store_oldest_undelivered_bucket_start_timestamp_seconds"
    assert oldest not in server.metrics()
    assert server.stop() == 0


def test_broker_consumer_lag_per_group_and_subject_and_its_store(tmp_path, procs):
    """A `delayd broker` with 12 messages on "orders" (4 queues): group g consumed and
    committed the first 5 it pulled, group h joined and committed nothing (it would
    start from the earliest entry), group k committed on "audit" only."""
    broker = procs.start(BrokerProcess(tmp_path / "data"))
    with broker.client() as c:
        c.send_batch(messages("m", 12))
        c.send_batch([Message("a-0", "audit"), Message("a-1", "audit")])
        c.join("g", "orders", "g1")
        got = c.pull("orders", "g", "g1", 5, 0)
        assert len(got) == 5
        c.commit_all("g", got)
        c.join("h", "orders", "h1")
        c.join("k", "audit", "k1")
        c.commit_all("k", c.pull("audit", "k", "k1", 100, 0))
    assert broker.metrics_address is not None
    values = broker.metrics()
    lag = "delayd_broker_subject_consumer_lag_messages"
    assert values[f'{lag}{{group="g",subject="orders"}}'] == 12 - 5
    assert values[f'{lag}{{group="h",subject="orders"}}'] == 12
    assert values[f'{lag}{{group="k",subject="audit"}}'] == 0
    assert not any(k.startswith(f'{lag}{{group="k",subject="orders"') for k in values)
    # Its files, walked in the background (the first walk may predate the sends).
    files, size = files_of(str(tmp_path / "data" / "broker" / "commitlog"))
    assert files >= 1

    def walked() -> bool:
        now = broker.metrics()
        return (
            now['delayd_store_segments{log="broker_commitlog"}'] == files
            and now['delayd_store_bytes{log="broker_commitlog"}'] == size
        )

    poll(walked, 15, "the store walk")
    assert broker.stop() == 0
