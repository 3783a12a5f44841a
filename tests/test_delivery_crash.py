"""kill -9 of a real ``delayd serve`` at random moments while it accepts and delivers.

Each round starts the server on the same data directory, a producer sends messages
due 0 to 1.5 s out (one in ten at once) and a consumer pulls from the embedded broker;
after a random 0.05 to 0.5 s the process is killed (the embedded broker with it). The
messages sent in one round fall due during the next ones, so kills land in the middle
of loading, sending and recording. At the end every acknowledged message must reach a
consumer exactly once — those whose acknowledgement the kill cut off at most once —
none before its due time, and dispatch_log must name every schedule_log record once.
"""

from __future__ import annotations

import random
import time

import pytest

from delayd.logs.dispatch_log import EntryKind
from tests.delivery_support import (
    LiveConsumer,
    SteadySender,
    assert_never_early,
    broker_stats,
    check_dispatch_log,
    consume,
    dispatched_count,
    exactly_once,
    poll,
    serve_stats,
)
from tests.intake_support import check_exactly_once, terminate, write_config

pytestmark = pytest.mark.slow
ROUNDS = 22


def test_kill_9_while_accepting_and_delivering(procs, tmp_path):
    config = write_config(
        tmp_path / "c.toml",
        "[replay]\ncheckpoint_interval_ms = 100\n"
        # Buckets are a minute wide; with a short load-ahead a run that crosses a
        # minute begins the next bucket while records for it arrive (canAdd).
        "[wheel]\nload_ahead_ms = 300\n"
        "[delivery]\nmax_batch = 32\ndispatch_flush_interval_ms = 100\n",
    )
    data = tmp_path / "data"
    rng = random.Random(20261122)
    sent: set[str] = set()
    acked: dict[str, int] = {}
    live = []
    kills_ms = []
    duplicates = 0  # resends the broker dropped, summed over the runs
    for round_no in range(ROUNDS):
        server = procs.serve(data, "--config", config)
        consumer = LiveConsumer(server.broker_address, "live")
        sender = SteadySender(server.address, f"r{round_no}", rng.randrange(2**32))
        consumer.start()
        sender.start()
        assert sender.started_acking.wait(20), server.log_tail()
        time.sleep(rng.uniform(0.05, 0.5))  # the kill's moment, not a synchronisation
        duplicates += broker_stats(server.broker_address)["broker.duplicates_total"]
        kills_ms.append(time.time_ns() // 1_000_000)
        server.kill()
        sender.join(20)
        consumer.stop.set()
        consumer.join(20)
        assert not sender.is_alive() and not consumer.is_alive()
        assert sender.error is None, sender.error
        assert consumer.error is None, consumer.error
        sent |= sender.sent
        acked.update(sender.acked)
        live += consumer.received
        server.close()

    server = procs.serve(data, "--config", config)
    # Everything message_log holds (acknowledged or not) has been dispatched once the
    # dispatch_log entries reach its last sequence.
    total = serve_stats(server.address)["intake.last_sequence"]
    poll(lambda: dispatched_count(data) >= total, 30, f"{total} messages dispatched")
    received = exactly_once(consume(server.broker_address, total, group="final"))
    lost = set(acked) - set(received)
    assert not lost, f"{len(lost)} acknowledged messages never delivered, e.g. {sorted(lost)[:5]}"
    assert set(received) <= sent
    assert len(received) == total
    assert_never_early(received.values())
    assert all(received[i].message.due_ms == due for i, due in acked.items())
    # The consumer that ran during the rounds saw nothing early either, across kills.
    assert_never_early(live)
    assert len(live) >= len(acked) // 3
    terminate(server)

    scheduled = check_exactly_once(data, 1)
    dispatched = check_dispatch_log(data)
    assert set(dispatched) == set(scheduled) == set(received)
    assert all(entry.kind is EntryKind.DISPATCHED for _, entry in dispatched.values())
    assert len(acked) >= ROUNDS * 20

    # The kills hit delivery in progress: in most rounds messages acknowledged before
    # the kill were dispatched by a later run.
    carried = {
        k
        for k, kill_ms in enumerate(kills_ms)
        if any(
            message_id.startswith(f"r{k}-") and entry.at_ms > kill_ms
            for message_id, (_, entry) in dispatched.items()
        )
    }
    assert len(carried) >= ROUNDS // 2, carried
    log = server.log_path.read_text()
    assert log.count("delivering: replay caught up") == ROUNDS + 1
    # Some kills came between a broker storing a batch and dispatch_log recording it:
    # the restarted server sent those messages again, and the broker dropped them.
    assert duplicates > 0
    print(
        f"{len(acked)} acknowledged, {len(received)} delivered, {len(sent) - len(received)} "
        f"sent and lost unacknowledged, {duplicates} resends dropped as duplicates"
    )
