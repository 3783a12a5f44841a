"""Delivery to ``delayd broker`` processes as broker groups: one group killed mid-run
(delivery goes on through the other, nothing lost); the only group down for a while
(messages wait, also through a restart, are not dead-lettered before max_attempts, and
arrive once it is back; with max_attempts = 2 they go to the dead-letter subject
instead); and kill -9 of the delay server with two groups (a message sent again after
the restart goes to the group that may already hold it, so it is not stored twice)."""

from __future__ import annotations

import random
import re
import time

import pytest

import delayd
from delayd.logs.dispatch_log import DispatchEntry, EntryKind
from delayd.sender.ledger import DEAD_LETTER_REASON, ORIGINAL_SUBJECT
from tests.delivery_support import (
    SUBJECT,
    SteadySender,
    assert_never_early,
    broker_stats,
    check_dispatch_log,
    consume,
    dispatched_count,
    exactly_once,
    groups_toml,
    hostport,
    now_ms,
    poll,
    read_dispatch_log,
    serve_stats,
    stored_count,
)
from tests.intake_support import check_exactly_once, terminate, write_config
from tests.process_support import free_port

pytestmark = pytest.mark.slow
ROUNDS_WITH_GROUPS = 6
DEAD_LETTERED_LOG = re.compile(r"message (\S+): (\d+) attempts failed")

# Quick to give up on a dead group and to try again: a test of behaviour, not tuning.
FAST_FAILOVER = (
    "[delivery]\nfailure_threshold = 2\nopen_ms = 100\nmax_open_ms = 400\n"
    "retry_base_ms = 20\nretry_max_ms = 200\n"
)


def send(
    address: tuple[str, int], count: int, spread_ms: int, prefix: str = "m", after_ms: int = 0
) -> dict:
    """``count`` messages due evenly over ``spread_ms`` starting ``after_ms`` from now;
    their receipts by id."""
    receipts = {}
    with delayd.Producer(hostport(address)) as producer:
        for i in range(count):
            delay_ms = after_ms + i * spread_ms // count
            receipt = producer.send(
                SUBJECT, b"body %d" % i, delay_ms=delay_ms, message_id=f"{prefix}{i}"
            )
            receipts[receipt.message_id] = receipt
    return receipts


def test_a_broker_group_killed_mid_run(procs, tmp_path):
    a = procs.broker("a")
    b = procs.broker("b")
    config = write_config(
        tmp_path / "c.toml",
        groups_toml(a=a.address, b=b.address) + FAST_FAILOVER + "max_attempts = 50\n",
    )
    data = tmp_path / "data"
    server = procs.serve(data, "--config", config)
    receipts = send(server.address, 300, 3000)

    def entries() -> list[DispatchEntry]:
        return [e for es in read_dispatch_log(data).values() for e in es]

    # Kill a once it has taken a share; it stays dead for a second, then comes back on
    # its address, and more messages are sent.
    poll(lambda: sum(e.group == "a" for e in entries()) >= 20, 20, "deliveries to a")
    a.kill()
    killed_ms = now_ms()  # a is dead from here on: nothing it stores after this exists
    poll(lambda: now_ms() >= killed_ms + 1000, 5, "a second without a")
    restart_ms = now_ms()
    a = procs.broker("a", a.address[1])
    receipts |= send(server.address, 100, 1000, prefix="n", after_ms=1000)
    poll(lambda: dispatched_count(data) >= len(receipts), 30, "every message dispatched")
    terminate(server)

    dispatched = check_dispatch_log(data)
    assert set(dispatched) == set(check_exactly_once(data, 1)) == set(receipts)
    by_group: dict[str, set[str]] = {"a": set(), "b": set()}
    for message_id, (_, entry) in dispatched.items():
        assert entry.kind is EntryKind.DISPATCHED
        assert entry.at_ms >= receipts[message_id].due_ms
        by_group[entry.group].add(message_id)
    # While a was down, b took everything: nothing waited for a, nothing was lost.
    while_down = [e for _, e in dispatched.values() if killed_ms <= e.at_ms <= restart_ms]
    assert len(while_down) >= 20 and all(e.group == "b" for e in while_down)
    # Once a was back, it took its share again.
    later = {i for i in receipts if i.startswith("n")}
    assert later & by_group["a"] and later & by_group["b"]

    # What a stored survived its kill -9; b holds the rest; together every message.
    on_a = exactly_once(consume(a.address, len(by_group["a"]), group="audit"))
    on_b = exactly_once(consume(b.address, len(by_group["b"]), group="audit"))
    assert set(on_b) == by_group["b"]
    assert set(on_a) >= by_group["a"]
    # A batch a stored but whose acknowledgement the kill cut off was sent to b as
    # well (dedupe is per broker): such copies on a must be from the moment of the kill.
    for message_id in set(on_a) - by_group["a"]:
        assert message_id in by_group["b"] and receipts[message_id].due_ms <= killed_ms
        assert on_a[message_id].message.store_ms >= killed_ms - 1000, on_a[message_id]
    assert_never_early([*on_a.values(), *on_b.values()])
    for r in [*on_a.values(), *on_b.values()]:
        assert r.message.due_ms == receipts[r.message_id].due_ms


def test_the_only_group_down_then_back(procs, tmp_path):
    port = free_port()  # the broker comes up here only later
    config = write_config(
        tmp_path / "c.toml",
        groups_toml(solo=("127.0.0.1", port)) + FAST_FAILOVER + "max_attempts = 50\n",
    )
    data = tmp_path / "data"
    server = procs.serve(data, "--config", config)
    receipts = send(server.address, 100, 500)
    # Nothing can be delivered: every message stays pending, none dead-lettered...
    poll(lambda: now_ms() > max(r.due_ms for r in receipts.values()) + 1000, 10, "all due")
    assert dispatched_count(data) == 0
    # ... through a graceful stop and a restart, too.
    terminate(server)
    server = procs.serve(data, "--config", config)
    broker = procs.broker("solo", port)
    poll(lambda: dispatched_count(data) >= len(receipts), 30, "every message dispatched")
    received = exactly_once(consume(broker.address, len(receipts), group="g"))
    assert set(received) == set(receipts)
    assert_never_early(received.values())
    assert stored_count(broker_stats(broker.address), f"DLQ.{SUBJECT}") == 0
    terminate(server)
    assert "attempts failed" not in server.log_path.read_text()
    dispatched = check_dispatch_log(data)
    assert set(dispatched) == set(receipts)
    assert all(e.kind is EntryKind.DISPATCHED and e.group == "solo" for _, e in dispatched.values())


def test_max_attempts_spent_on_a_dead_group_dead_letters(procs, tmp_path):
    port = free_port()
    config = write_config(
        tmp_path / "c.toml",
        groups_toml(solo=("127.0.0.1", port))
        + "[delivery]\nfailure_threshold = 1000\nmax_attempts = 2\n"
        "retry_base_ms = 20\nretry_max_ms = 100\n",
    )
    data = tmp_path / "data"
    server = procs.serve(data, "--config", config)
    receipts = send(server.address, 20, 200)

    def dead_lettered() -> dict[str, int]:
        found = DEAD_LETTERED_LOG.findall(server.log_path.read_text())
        return {message_id: int(attempts) for message_id, attempts in found}

    poll(lambda: len(dead_lettered()) >= len(receipts), 20, "every message dead-lettered")
    # each after exactly max_attempts sends, none earlier
    assert dead_lettered() == dict.fromkeys(receipts, 2)
    broker = procs.broker("solo", port)
    poll(lambda: dispatched_count(data) >= len(receipts), 30, "every message dispatched")
    received = exactly_once(
        consume(broker.address, len(receipts), subject=f"DLQ.{SUBJECT}", group="g")
    )
    assert set(received) == set(receipts)
    for message_id, r in received.items():
        m = r.message
        assert m.subject == f"DLQ.{SUBJECT}"
        assert m.properties[ORIGINAL_SUBJECT] == SUBJECT
        assert "broker group solo" in m.properties[DEAD_LETTER_REASON], m.properties
        assert m.due_ms == receipts[message_id].due_ms
    assert_never_early(received.values())
    assert stored_count(broker_stats(broker.address), SUBJECT) == 0
    terminate(server)
    dispatched = check_dispatch_log(data)
    assert set(dispatched) == set(receipts)
    assert all(e.kind is EntryKind.DEAD_LETTERED for _, e in dispatched.values())
    assert all(e.group == "solo" for _, e in dispatched.values())


def test_kill_9_of_the_delay_server_with_two_groups(procs, tmp_path):
    """A message sent to a group but not yet in dispatch_log when the delay server is
    killed is sent again after the restart; it must go to the same group, whose broker
    drops it as a duplicate — dedupe is per broker, so a resend to the other group
    would reach consumers twice."""
    a = procs.broker("a")
    b = procs.broker("b")
    config = write_config(tmp_path / "c.toml", groups_toml(a=a.address, b=b.address))
    data = tmp_path / "data"
    rng = random.Random(11)
    acked: dict[str, int] = {}
    sent: set[str] = set()
    for round_no in range(ROUNDS_WITH_GROUPS):
        server = procs.serve(data, "--config", config)
        sender = SteadySender(server.address, f"r{round_no}", rng.randrange(2**32))
        sender.start()
        assert sender.started_acking.wait(20), server.log_tail()
        time.sleep(rng.uniform(0.05, 0.5))  # the kill's moment, not a synchronisation
        server.kill()
        sender.join(20)
        assert not sender.is_alive() and sender.error is None, sender.error
        acked.update(sender.acked)
        sent |= sender.sent
        server.close()
    server = procs.serve(data, "--config", config)
    total = serve_stats(server.address)["intake.last_sequence"]
    poll(lambda: dispatched_count(data) >= total, 30, f"{total} messages dispatched")
    terminate(server)
    dispatched = check_dispatch_log(data)
    on_a = exactly_once(consume(a.address, 0, group="audit"))
    on_b = exactly_once(consume(b.address, 0, group="audit"))
    both = sorted(set(on_a) & set(on_b))
    assert not both, f"{len(both)} messages on both groups, e.g. {both[:5]}"
    assert set(on_a) | set(on_b) == set(dispatched)
    assert set(acked) <= set(dispatched) <= sent
    for message_id, (_, entry) in dispatched.items():
        assert message_id in (on_a if entry.group == "a" else on_b)
    assert_never_early([*on_a.values(), *on_b.values()])
    assert min(len(on_a), len(on_b)) >= len(dispatched) // 4  # both groups took a share
    # Some kills came after a broker stored a batch and before dispatch_log said so:
    # those messages were sent again after the restart, to the same broker.
    resent = sum(broker_stats(x.address)["broker.duplicates_total"] for x in (a, b))
    assert resent > 0
