"""Unit tests of the clients' I/O-free state: addresses, ids, back-off, receipts,
message building and framing, ERROR mapping, and the consumer's bookkeeping."""

from __future__ import annotations

import dataclasses
import re

import pytest

from delayd.client._backoff import Backoff
from delayd.client._consumer_state import ConsumerState
from delayd.client._messages import build_message, coerce_batch, split_frames
from delayd.client.receipt import Receipt
from delayd.errors import BusyError, RejectedError, RemoteProtocolError
from delayd.message_ids import MessageIds, new_message_id
from delayd.protocol import Error, ErrorCode, Message, ResultCode, SendResult
from delayd.protocol.answers import error_to_exception

# --- addresses ----------------------------------------------------------------------------


def test_clients_refuse_bad_addresses_before_any_io() -> None:
    import delayd

    with pytest.raises(ValueError, match="'localhost' has no port"):
        delayd.Producer("localhost")
    with pytest.raises(ValueError, match="'::1:20811': put an IPv6 address in brackets"):
        delayd.Consumer("::1:20811", subject="s", group="g")


# --- message ids --------------------------------------------------------------------------


def test_ids_are_time_prefixed_hex_and_count_up_within_a_millisecond() -> None:
    clock = iter([1000, 1000, 1000, 1001])
    randoms = iter([5, 77])
    ids = MessageIds(clock_ms=lambda: next(clock), random_bits=lambda: next(randoms))
    made = [ids.new() for _ in range(4)]
    assert made == [
        f"{1000:012x}{5:020x}",
        f"{1000:012x}{6:020x}",
        f"{1000:012x}{7:020x}",
        f"{1001:012x}{77:020x}",  # a new millisecond draws fresh random bits
    ]
    assert made == sorted(made)


def test_ids_stay_ordered_when_the_clock_steps_back_and_on_counter_overflow() -> None:
    clock = iter([2000, 1999, 1999])
    ids = MessageIds(clock_ms=lambda: next(clock), random_bits=lambda: (1 << 80) - 1)
    first, second, third = ids.new(), ids.new(), ids.new()
    assert first < second < third
    assert second == f"{2001:012x}{0:020x}"  # the 80 bits overflowed: borrow the next ms


def test_ids_reset_draws_fresh_random_bits() -> None:
    randoms = iter([1, 2])
    ids = MessageIds(clock_ms=lambda: 5, random_bits=lambda: next(randoms))
    assert ids.new().endswith(f"{1:020x}")
    ids.reset()  # as in a forked child
    assert ids.new().endswith(f"{2:020x}")


def test_default_ids_are_unique() -> None:
    made = {new_message_id() for _ in range(20_000)}
    assert len(made) == 20_000
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in made)


# --- back-off -----------------------------------------------------------------------------


def test_backoff_doubles_with_jitter_up_to_the_cap() -> None:
    low = Backoff(initial_s=0.1, max_s=1.0, rand=lambda: 0.0)
    assert [round(low.next_delay(), 6) for _ in range(6)] == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]
    high = Backoff(initial_s=0.1, max_s=1.0, rand=lambda: 0.999999)
    delays = [high.next_delay() for _ in range(6)]
    assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0], rel=1e-5)


def test_backoff_reset_starts_over_and_never_overflows() -> None:
    b = Backoff(initial_s=0.05, max_s=2.0, rand=lambda: 0.5)
    for _ in range(10_000):
        b.next_delay()
    assert b.next_delay() == pytest.approx(2.0 * 0.75)
    b.reset()
    assert b.next_delay() == pytest.approx(0.05 * 0.75)


def test_backoff_runs_from_the_failure_not_from_the_caller() -> None:
    """Issue 18: time spent between calls counts towards the delay, so a caller whose
    own time-out is shorter than the delay still gets its next attempt."""
    b = Backoff(initial_s=1.0, max_s=2.0, rand=lambda: 0.999999)
    assert b.wait_s(100.0) == 0.0, "no failure yet: try at once"
    b.failed(100.0)
    assert b.wait_s(100.0) == pytest.approx(1.0)
    assert b.wait_s(100.4) == pytest.approx(0.6)
    assert b.wait_s(101.0) == pytest.approx(0.0, abs=1e-5)
    b.failed(101.0)
    assert b.wait_s(101.5) == pytest.approx(1.5)  # the next delay, from the new failure
    assert b.wait_s(200.0) == 0.0  # asking again much later never waits
    b.reset()
    assert b.wait_s(101.5) == 0.0


def test_backoff_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        Backoff(initial_s=0, max_s=1)
    with pytest.raises(ValueError):
        Backoff(initial_s=2, max_s=1)
    with pytest.raises(ValueError):
        Backoff(multiplier=0.5)


# --- receipts -----------------------------------------------------------------------------


def test_receipt_from_a_delay_server_result() -> None:
    # The delay server sends due_ms, and the sequence in the queue_offset slot.
    result = SendResult(ResultCode.OK, due_ms=1_700_000_000_123, queue_offset=41)
    receipt = Receipt.from_result("id-1", result)
    assert receipt.message_id == "id-1"
    assert receipt.due_ms == 1_700_000_000_123
    assert receipt.sequence == 41
    assert receipt.store_ms is None and receipt.queue is None
    assert receipt.ok


def test_receipt_from_a_broker_result_and_refusals() -> None:
    result = SendResult(
        ResultCode.DUPLICATE, commitlog_offset=99, queue=3, queue_offset=7, store_ms=11
    )
    receipt = Receipt.from_result("m", result)
    assert (receipt.queue, receipt.queue_offset, receipt.commitlog_offset) == (3, 7, 99)
    assert receipt.due_ms is None and receipt.sequence is None
    assert receipt.ok  # DUPLICATE: stored by an earlier send
    refused = Receipt.from_result("m", SendResult(ResultCode.BODY_TOO_LARGE, "too big"))
    assert not refused.ok and refused.reason == "too big"


def test_a_receipt_from_a_result_is_an_ordinary_receipt() -> None:
    # from_result builds it by plain stores (a producer makes one per message): it must
    # equal, print and stay frozen as one built by Receipt(...).
    receipt = Receipt.from_result("m", SendResult(ResultCode.OK, due_ms=5, queue_offset=2))
    expected = Receipt("m", ResultCode.OK, "", due_ms=5, sequence=2, queue_offset=2)
    assert type(receipt) is Receipt
    assert receipt == expected and repr(receipt) == repr(expected)
    assert hash(receipt) == hash(expected)
    with pytest.raises(dataclasses.FrozenInstanceError):
        receipt.code = ResultCode.BUSY  # type: ignore[misc]


# --- building messages --------------------------------------------------------------------


def test_build_message_fills_in_an_id_and_encodes_text() -> None:
    m = build_message("orders", "héllo", delay_ms=50, key="k", properties={"a": "b"})
    assert re.fullmatch(r"[0-9a-f]{32}", m.message_id)
    assert m.body == "héllo".encode()
    assert (m.delay_ms, m.at_ms, m.key, m.properties) == (50, None, "k", {"a": "b"})
    assert build_message("s", bytearray(b"x"), message_id="mine").message_id == "mine"


def test_build_message_refuses_both_times_and_odd_bodies() -> None:
    with pytest.raises(ValueError, match="not both"):
        build_message("s", b"", at_ms=1, delay_ms=1)
    with pytest.raises(ValueError, match="bytes or str"):
        build_message("s", 42)  # type: ignore[arg-type]


def test_coerce_batch_accepts_messages_dicts_and_pairs() -> None:
    given = Message("id", "s", body=b"1")
    batch = coerce_batch([given, {"subject": "t", "body": b"2", "at_ms": 9}, ("u", "3")])
    assert batch[0] is given
    assert (batch[1].subject, batch[1].body, batch[1].at_ms) == ("t", b"2", 9)
    assert (batch[2].subject, batch[2].body) == ("u", b"3")
    with pytest.raises(ValueError, match="item 1"):
        coerce_batch([given, 5])
    with pytest.raises(ValueError, match="item 0"):
        coerce_batch([{"subject": "s", "body": b"", "colour": "red"}])


def test_split_frames_by_count_and_size() -> None:
    small = [Message(str(i), "s", body=b"x" * 10) for i in range(25)]
    assert [len(f) for f in split_frames(small, max_messages=10)] == [10, 10, 5]
    big = [Message(str(i), "s", body=b"x" * 400) for i in range(10)]
    frames = split_frames(big, max_messages=100, max_bytes=1000)
    assert [len(f) for f in frames] == [2, 2, 2, 2, 2]
    assert [m for f in frames for m in f] == big
    huge = [Message("h", "s", body=b"x" * 5000)]
    assert split_frames(huge, max_bytes=1000) == [huge]


# --- ERROR frames -------------------------------------------------------------------------


def test_error_to_exception() -> None:
    busy = error_to_exception(Error(ErrorCode.BUSY, "slow down"), "SEND_BATCH to x")
    assert isinstance(busy, BusyError) and "slow down" in str(busy)
    assert isinstance(error_to_exception(Error(ErrorCode.SHUTTING_DOWN, "bye"), "x"), BusyError)
    auth = error_to_exception(Error(ErrorCode.UNAUTHORIZED, "wrong token"), "HELLO to x")
    assert isinstance(auth, RejectedError) and auth.code == ErrorCode.UNAUTHORIZED
    assert "token" in str(auth)
    bad = error_to_exception(Error(ErrorCode.MALFORMED, "bad crc"), "x")
    assert isinstance(bad, RemoteProtocolError) and bad.code == ErrorCode.MALFORMED
    invalid = error_to_exception(Error(ErrorCode.INVALID_REQUEST, "join first"), "PULL to x")
    assert isinstance(invalid, RejectedError) and invalid.reason == "PULL to x: join first"


# --- consumer bookkeeping -----------------------------------------------------------------


def msg(queue: int, offset: int) -> Message:
    return Message(f"{queue}-{offset}", "s", queue=queue, queue_offset=offset)


def test_auto_commit_commits_a_message_when_the_next_is_asked_for() -> None:
    state = ConsumerState()
    state.set_assignment([0, 1])
    state.add_pulled([msg(0, 0), msg(1, 5), msg(0, 1)])
    state.advance()
    assert state.pop() == msg(0, 0)
    assert state.commits_due() == []  # still being processed
    state.advance()
    assert state.commits_due() == [(0, 1)]
    assert state.pop() == msg(1, 5)
    state.advance()
    assert sorted(state.commits_due()) == [(0, 1), (1, 6)]
    state.committed(0, 1)
    state.committed(1, 6)
    assert state.commits_due() == []
    assert state.pop() == msg(0, 1)
    state.close(clean=True)  # a clean close commits the current message too
    assert state.commits_due() == [(0, 2)]


def test_a_message_whose_processing_failed_is_not_committed() -> None:
    state = ConsumerState()
    state.add_pulled([msg(0, 0), msg(0, 1)])
    state.advance()
    state.pop()
    state.advance()
    state.pop()
    state.close(clean=False)
    assert state.commits_due() == [(0, 1)]  # only the first one


def test_manual_commit_only_what_is_marked() -> None:
    state = ConsumerState(auto_commit=False)
    state.add_pulled([msg(0, 0), msg(0, 1), msg(0, 2)])
    for _ in range(3):
        state.advance()
        state.pop()
    state.close(clean=True)
    assert state.commits_due() == []
    state.mark_processed(msg(0, 1))
    state.mark_processed(msg(0, 0))  # offsets never move back
    assert state.commits_due() == [(0, 2)]


def test_replayed_messages_are_dropped() -> None:
    state = ConsumerState()
    state.set_assignment([0])
    assert state.add_pulled([msg(0, 0), msg(0, 1)]) == 2
    # After a reconnect the broker restarts the cursor at the committed offset.
    assert state.add_pulled([msg(0, 0), msg(0, 1), msg(0, 2)]) == 1
    assert [state.pop(), state.pop(), state.pop(), state.pop()] == [
        msg(0, 0),
        msg(0, 1),
        msg(0, 2),
        None,
    ]


def test_losing_a_queue_drops_its_prefetched_messages() -> None:
    state = ConsumerState()
    state.set_assignment([0, 1])
    state.add_pulled([msg(0, 0), msg(1, 0), msg(0, 1)])
    state.set_assignment([1])
    assert state.buffered == 1 and state.pop() == msg(1, 0)
    state.set_assignment([0, 1])  # back again: its messages may come again
    assert state.add_pulled([msg(0, 0)]) == 1


def test_a_lost_queue_is_held_until_the_message_in_hand_is_committed() -> None:
    state = ConsumerState()
    state.set_assignment([0, 1])
    state.add_pulled([msg(0, 0), msg(1, 0), msg(0, 1), msg(0, 2)])
    state.advance()
    assert state.pop() == msg(0, 0)  # the user handles it
    state.set_assignment([1])  # the broker took queue 0 away
    assert state.heartbeat_held() == (0, 1) and not state.letting_go()
    assert state.add_pulled([msg(0, 3)]) == 0  # lost: not handed out
    state.advance()  # msg(0, 0) done
    assert state.letting_go() and state.commits_due() == [(0, 1)]
    state.committed(0, 1)
    assert state.heartbeat_held() == (1,) and not state.letting_go()
    state.set_assignment([1])  # the answer: another's, and msg(0, 3) with it
    assert [state.pop(), state.pop()] == [msg(1, 0), None]  # 0-1, 0-2 were dropped
    # Given back: what was handed out is not handed out again, what was only
    # prefetched comes from the committed offset.
    state.set_assignment([0, 1])
    assert state.add_pulled([msg(0, 0), msg(0, 1), msg(0, 2)]) == 2


def test_a_lost_queue_of_which_nothing_was_handed_out_is_let_go_at_once() -> None:
    state = ConsumerState()
    state.set_assignment([0, 1])
    state.add_pulled([msg(0, 0), msg(0, 1)])
    state.set_assignment([1])
    assert state.heartbeat_held() == (1,)


def test_a_queue_given_back_before_the_consumer_heard_keeps_what_a_pull_brought() -> None:
    """The broker gave queue 0 back (its other reader let go) and a PULL brought its
    messages before this consumer's next HEARTBEAT answer said so. The broker's cursor
    moved past them: dropped when that HEARTBEAT was made, the group skipped them for
    good once a later offset was committed (CI: 373 messages of one queue never seen,
    test_rebalance_handover)."""
    state = ConsumerState()
    state.set_assignment([0, 1])
    state.set_assignment([1])  # queue 0 lost, nothing of it handed out
    assert state.heartbeat_held() == (1,)  # let go
    state.set_assignment([1])  # the answer: queue 0 is another's
    assert state.add_pulled([msg(0, 5), msg(0, 6)]) == 0  # given back meanwhile
    assert state.heartbeat_held() == (1,)  # the next HEARTBEAT drops nothing
    state.set_assignment([0, 1])  # its answer says queue 0 is back
    assert [state.pop(), state.pop(), state.pop()] == [msg(0, 5), msg(0, 6), None]


def test_what_a_pull_brought_of_a_lost_queue_goes_with_an_answer_that_says_it_is_not_ours() -> None:
    """Given back and taken away again before this consumer heard it had the queue: the
    member that reads it now starts from the committed offset."""
    state = ConsumerState()
    state.set_assignment([0, 1])
    state.set_assignment([1])
    assert state.add_pulled([msg(0, 1)]) == 0
    state.set_assignment([1])  # an answer after it: another's
    state.set_assignment([0, 1])  # back later: its cursor restarts at the committed offset
    assert state.buffered == 0
    assert state.add_pulled([msg(0, 0), msg(0, 1)]) == 2


def test_a_rejoin_forgets_what_pulls_brought_of_lost_queues() -> None:
    state = ConsumerState()
    state.set_assignment([0, 1])
    state.set_assignment([1])
    assert state.add_pulled([msg(0, 3)]) == 0
    state.rejoining()  # others may have read queue 0 since: its cursor restarts
    state.set_assignment([0, 1])
    assert state.buffered == 0


def test_a_handed_out_message_dropped_unseen_no_longer_holds_its_queue() -> None:
    state = ConsumerState(auto_commit=False)
    state.set_assignment([0])
    state.add_pulled([msg(0, 0), msg(0, 1)])
    state.advance()
    state.pop()
    state.mark_processed(msg(0, 0))
    state.committed(0, 1)
    state.advance()
    state.pop()  # waits in a cluster consumer's pump while the queue is lost
    state.set_assignment([])
    assert state.heartbeat_held() == (0,)
    state.dropped(msg(0, 1))
    assert state.heartbeat_held() == ()
    state.set_assignment([0])  # given back: the dropped message comes again
    assert state.add_pulled([msg(0, 1)]) == 1


def test_flush_due_after_the_commit_interval() -> None:
    state = ConsumerState(commit_interval_s=1.0)
    state.add_pulled([msg(0, 0), msg(0, 1)])
    assert not state.flush_due(100.0)  # starts the clock
    state.advance()
    state.pop()
    state.advance()
    assert not state.flush_due(100.5)
    assert state.flush_due(101.0)
    state.flushed(101.0)
    assert not state.flush_due(101.5)
