"""The blocking producer over a cluster asks its groups at once (docs/cluster.md,
"Routing by message id"): a batch's parts, HELD_IDS asks and lookup rounds run in
parallel, each to its end, the first error raised as itself; one group costs no thread.
Over fake groups (tests/test_resend_check.py's); tests/test_cluster_routing.py runs the
same producer against real ``delayd serve`` groups."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from delayd.client._routing import DelayGroups
from delayd.client.cancel_receipt import CancelReceipt
from delayd.client.receipt import Receipt
from delayd.errors import ConnectionClosedError, DelaydTimeout
from delayd.protocol import CancelOutcome, Message
from tests.test_resend_check import IDS, BlockingFake, batch, blocking_producer, cluster

# Long enough never to break the barrier of parts that run at once, short enough that
# parts run one after another fail the test quickly rather than hang.
MEET_S = 10.0


class MeetingGroup(BlockingFake):
    """A group whose send answers only once every group of the call has started its
    own (a barrier they all wait on): parts run one after another never meet."""

    def __init__(self, name: str, meeting: threading.Barrier) -> None:
        super().__init__(name, {})
        self.meeting = meeting
        self.threads: list[threading.Thread] = []
        self.fail: Exception | None = None

    def send_batch(self, messages: Sequence[Message]) -> list[Receipt]:
        self.threads.append(threading.current_thread())
        self.meeting.wait()
        if self.fail is not None:
            raise self.fail
        return self.store(messages)

    def cancel_many(self, ids: Sequence[str]) -> list[CancelReceipt]:
        self.threads.append(threading.current_thread())
        self.meeting.wait()
        return [CancelReceipt(i, CancelOutcome.UNKNOWN) for i in ids]


def two_groups() -> tuple[dict[str, MeetingGroup], threading.Barrier]:
    meeting = threading.Barrier(2, timeout=MEET_S)
    return {name: MeetingGroup(name, meeting) for name in ("a", "b")}, meeting


def over(groups: dict[str, MeetingGroup]):
    producer = blocking_producer(groups, 0)  # type: ignore[arg-type]
    producer.view.read(cluster(**{g: ("active", 0, 0) for g in groups}), now_s=1e12)
    return producer


def test_a_batch_over_two_groups_sends_both_parts_at_once():
    groups, _ = two_groups()
    producer = over(groups)
    receipts = producer.send_batch(batch())  # a BrokenBarrierError if one waits for the other
    assert [r.message_id for r in receipts] == IDS and all(r.ok for r in receipts)
    assert sorted(groups["a"].sent + groups["b"].sent) == sorted(IDS)
    owners = DelayGroups(("a", "b"), ("a", "b"))
    assert all(owners.owner(i) == "a" for i in groups["a"].sent)
    # The first part runs in the caller's thread, the other in the producer's pool.
    threads = {groups["a"].threads[0], groups["b"].threads[0]}
    assert threading.current_thread() in threads and len(threads) == 2
    producer.close()
    pooled = (threads - {threading.current_thread()}).pop()
    assert not pooled.is_alive()  # close shut the pool down
    with pytest.raises(ConnectionClosedError):
        producer.send_batch(batch())


def test_a_lookup_round_asks_its_groups_at_once():
    groups, _ = two_groups()
    producer = over(groups)
    a_id = next(i for i in IDS if DelayGroups(("a", "b"), ()).owner(i) == "a")
    b_id = next(i for i in IDS if DelayGroups(("a", "b"), ()).owner(i) == "b")
    # Round 1 asks each id's owner (both at once), round 2 the other group (again both).
    receipts = producer.cancel_many([a_id, b_id])
    assert [r.outcome for r in receipts] == [CancelOutcome.UNKNOWN] * 2
    assert len(groups["a"].threads) == len(groups["b"].threads) == 2
    producer.close()


def test_a_failed_group_lets_the_other_finish_then_its_error_is_raised():
    groups, _ = two_groups()
    failure = DelaydTimeout("etcd://127.0.0.1:1/prod/b took over 1 s")
    groups["b"].fail = failure  # b fails only once a has started too
    producer = over(groups)
    with pytest.raises(DelaydTimeout) as raised:
        producer.send_batch(batch())
    assert raised.value is failure  # as itself, not wrapped
    assert groups["a"].sent and not groups["b"].sent  # a's part ran to its end
    assert producer.view.due(0)  # the registry is read again before the next call
    # Both fail: the error of the first group in the parts' order (its first id's owner).
    first = next(iter(DelayGroups(("a", "b"), ()).split(IDS)))
    for name, group in groups.items():
        group.fail = DelaydTimeout(f"{name} took over 1 s")
    producer.view.read(cluster(a=("active", 0, 0), b=("active", 0, 0)), now_s=1e12)
    with pytest.raises(DelaydTimeout, match=f"^{first} took over"):
        producer.send_batch(batch())
    producer.close()


def test_one_group_costs_no_thread():
    single = {"a": MeetingGroup("a", threading.Barrier(1))}
    producer = over(single)
    assert all(r.ok for r in producer.send_batch(batch()))
    assert single["a"].threads == [threading.current_thread()]
    assert producer._pool is None
    producer.close()
