"""The fault checker on hand-made histories: each kind of violation is caught, and
what is allowed (a redelivery before its commit landed, a message in doubt) is not."""

from __future__ import annotations

import json

import pytest

from tests.fault_checker import History, Sighting, check

DUE = 10_000


def seen(message_id: str, at_ms: int, **fields) -> Sighting:
    fields.setdefault("dispatched_ms", at_ms)
    return Sighting(message_id, at_ms, **fields)


def acked(*ids: str, due_ms: int = DUE) -> History:
    history = History()
    for message_id in ids:
        history.sent(message_id, due_ms - 5)
        history.acked(message_id, due_ms)
    return history


def test_a_clean_history_counts_nothing():
    history = acked("m1", "m2")
    history.acked("m2", DUE, duplicate=True)  # a retry after a lost answer
    history.seen_all([seen("m1", DUE, committed_ms=DUE + 1), seen("m2", DUE + 3)])
    report = check(history, due_by_ms=DUE + 100)
    assert report.clean and (report.acked, report.duplicates, report.seen) == (2, 1, 2)
    assert report.summary().startswith("2 acknowledged (1 as DUPLICATE), 2 seen; lost 0")
    report.assert_clean()


def test_an_acknowledged_message_never_seen_is_lost():
    history = acked("m1", "m2", "m3")
    history.seen(seen("m1", DUE))
    report = check(history, due_by_ms=DUE)
    assert report.lost == ["m2", "m3"]
    with pytest.raises(AssertionError, match=r"lost 2.*\n.*lost: \['m2', 'm3'\]"):
        report.assert_clean()


def test_not_lost_when_not_due_yet_cancelled_or_in_doubt():
    history = acked("m1", "m2", "m3", "m4")
    history.acked("late", DUE + 1)
    history.cancel("m1", "CANCELLED")
    history.cancel("m2", None)  # no answer: it may have been cancelled
    history.reschedule("m3", None, DUE + 500)  # no answer: it may be due later
    history.reschedule("m4", "RESCHEDULED", DUE + 500)  # due later than due_by_ms
    history.sent("unanswered", DUE)  # never acknowledged: may not be stored
    assert check(history, due_by_ms=DUE).clean
    assert check(history, due_by_ms=DUE + 500).lost == ["late", "m4"]


def test_seen_or_dispatched_before_its_due_time_is_early():
    history = acked("m1", "m2", "m3", "m4")
    history.seen_all(
        [
            seen("m1", DUE - 1),
            seen("m2", DUE + 5, dispatched_ms=DUE - 1),  # the server sent it early
            seen("m3", DUE + 5, stored_ms=DUE - 1),  # the broker had it early
            seen("m4", DUE, stored_ms=DUE),
        ]
    )
    report = check(history, due_by_ms=DUE)
    assert report.early == ["m1", "m2", "m3"]
    with pytest.raises(AssertionError, match=r"early: \['m1', 'm2', 'm3'\]"):
        report.assert_clean()


def test_the_clock_skew_allowance():
    history = acked("m1")
    history.seen(seen("m1", DUE - 20))
    assert check(history, due_by_ms=DUE, skew_ms=20).clean
    assert check(history, due_by_ms=DUE, skew_ms=19).early == ["m1"]
    assert "skew allowance 19 ms" in check(history, due_by_ms=DUE, skew_ms=19).summary()


def test_the_due_time_follows_reschedules():
    history = acked("later", "sooner", "unsure", "refused", "resent", "too_soon")
    history.reschedule("later", "RESCHEDULED", DUE + 1000)
    history.reschedule("sooner", "RESCHEDULED", DUE - 1000)
    history.reschedule("unsure", None, DUE - 500)  # either time is possible
    history.reschedule("refused", "ALREADY_DELIVERED", DUE + 1000)  # stays where it was
    # ALREADY_DELIVERED may answer a resend whose first attempt moved the message
    # sooner (its answer lost in a crash): the moved time is possible too...
    history.reschedule("resent", "ALREADY_DELIVERED", DUE - 500)
    history.reschedule("too_soon", "ALREADY_DELIVERED", DUE - 500)
    history.seen_all(
        [
            seen("later", DUE + 10),  # at the old time: the reschedule was not honoured
            seen("sooner", DUE - 1000),
            seen("unsure", DUE - 500),
            seen("refused", DUE),
            seen("resent", DUE - 500),
            seen("too_soon", DUE - 501),  # ...but not anything sooner than both
        ]
    )
    assert check(history, due_by_ms=DUE + 1000).early == ["later", "too_soon"]


def test_a_copy_of_an_earlier_attempt_is_held_to_its_own_due_time():
    """A send resent after a failover is answered with the new leader's due time; the
    old leader's copy of the first attempt (cut from the group later) may have gone out
    at its own, between the send's earliest due time and the answered one."""
    history = History()
    for message_id in ("first", "too_soon", "moved"):
        history.sent(message_id, DUE)
        history.acked(message_id, DUE + 2000)
    history.reschedule("moved", "RESCHEDULED", DUE + 3000)
    history.seen_all(
        [
            seen("first", DUE + 1, due_ms=DUE),  # the first attempt's copy, on time
            seen("too_soon", DUE - 1, due_ms=DUE - 1),  # no attempt was due before DUE
            seen("moved", DUE + 1, due_ms=DUE),  # a reschedule answered since: too soon
        ]
    )
    assert check(history, due_by_ms=DUE).early == ["moved", "too_soon"]


def test_unanswered_sends_are_held_to_their_earliest_due_time():
    history = History()
    history.sent("m1", DUE)
    history.sent("m2", DUE)
    history.seen_all([seen("m1", DUE - 1), seen("m2", DUE)])
    # a message nobody recorded is held to the due time it carries
    history.seen(seen("stranger", DUE - 1, due_ms=DUE))
    assert check(history, due_by_ms=DUE).early == ["m1", "stranger"]


def test_seen_again_after_its_commit_landed_is_twice():
    history = acked("m1", "m2", "m3")
    history.seen_all(
        [
            seen("m1", DUE, committed_ms=DUE + 1),
            seen("m1", DUE + 2),  # the group's committed offset had passed it
            seen("m2", DUE),
            seen("m2", DUE + 2),  # its commit never landed: the at-least-once window
            seen("m3", DUE, committed_ms=DUE + 5),
            seen("m3", DUE + 1),  # came again before the commit landed
        ]
    )
    report = check(history, due_by_ms=DUE)
    assert report.twice == ["m1"]
    assert report.redelivered == ["m2", "m3"]
    with pytest.raises(AssertionError, match=r"twice 1.*\n.*twice: \['m1'\]"):
        report.assert_clean()


def test_a_commit_covers_every_earlier_offset_of_its_queue():
    history = acked("m5", "m6")
    history.seen_all(
        [
            seen("m5", DUE, position=(0, 5), group="g"),  # its own commit failed
            seen("m6", DUE + 1, position=(1, 5), group="g"),
            seen("m5", DUE + 3, position=(0, 5), group="g"),
            seen("m6", DUE + 3, position=(1, 5), group="g"),
        ]
    )
    history.committed("g", 0, 7, DUE + 2)  # a later message of queue 0: covers m5
    history.committed("g", 1, 4, DUE + 2)  # short of m6
    history.committed("other", 1, 9, DUE + 2)  # another group's
    report = check(history, due_by_ms=DUE)
    assert (report.twice, report.redelivered) == (["m5"], ["m6"])


def test_two_positions_at_a_broker_are_twice_whatever_was_committed():
    history = acked("m1")
    history.seen_all([seen("m1", DUE, position=(0, 1)), seen("m1", DUE + 1, position=(1, 7))])
    assert check(history, due_by_ms=DUE).twice == ["m1"]


def test_each_group_reads_every_message_once():
    history = acked("m1")
    history.seen_all(
        [
            seen("m1", DUE, group="billing", committed_ms=DUE),
            seen("m1", DUE + 1, group="audit", committed_ms=DUE + 1),
        ]
    )
    report = check(history, due_by_ms=DUE)
    assert report.clean and not report.redelivered


def test_a_cancelled_message_seen_violates_the_cancel():
    history = acked("m1", "m2", "m3")
    history.cancel("m1", "CANCELLED")
    history.cancel("m2", "ALREADY_DELIVERED")
    history.cancel("m3", "CANCELLED")
    history.seen_all([seen("m1", DUE + 1), seen("m2", DUE)])
    report = check(history, due_by_ms=DUE)
    assert report.cancel_violated == ["m1"]
    assert not report.lost  # m3 was cancelled: not expected
    with pytest.raises(AssertionError, match=r"cancel violated: \['m1'\]"):
        report.assert_clean()


def test_every_kind_in_one_failure_message():
    history = acked("lost", "early", "twice", "cancelled")
    history.cancel("cancelled", "CANCELLED")
    history.seen_all(
        [
            seen("early", DUE - 1),
            seen("twice", DUE, committed_ms=DUE),
            seen("twice", DUE + 1),
            seen("cancelled", DUE),
        ]
    )
    with pytest.raises(AssertionError) as info:
        check(history, due_by_ms=DUE).assert_clean()
    message = str(info.value)
    assert "lost 1, early 1 (skew allowance 0 ms), twice 1, cancel violated 1" in message
    for line in ("lost: ['lost']", "early: ['early']", "twice: ['twice']"):
        assert line in message
    assert "cancel violated: ['cancelled']" in message


def test_load_reads_the_load_processes_records(tmp_path):
    def lines(*events: dict) -> str:
        return "".join(json.dumps({"ms": 0, **e}) + "\n" for e in events)

    where = {"consumer": "c1", "group": "g", "queue": 0}
    (tmp_path / "producer.jsonl").write_text(
        lines(
            {"event": "sent", "id": "a", "earliest_due_ms": DUE},
            {"event": "acked", "id": "a", "due_ms": DUE, "duplicate": False},
            {"event": "sent", "id": "b", "earliest_due_ms": DUE},
            {"event": "acked", "id": "b", "due_ms": DUE, "duplicate": True},
            {"event": "cancel", "id": "b", "outcome": "CANCELLED"},
            {"event": "error", "call": "send", "error": "DelaydTimeout"},
        )
        + '{"event": "sent", "id": "c", "earlie'  # the line a kill -9 cut
    )
    seen_a = {"event": "seen", "id": "a", "dispatched_ms": DUE, "stored_ms": DUE, **where}
    seen_a["due_ms"] = DUE
    (tmp_path / "consumer.jsonl").write_text(
        lines(
            {**seen_a, "seen_ms": DUE, "offset": 0},
            {"event": "committed", **where, "offset": 0, "ms": DUE + 1},
            {**seen_a, "seen_ms": DUE + 2, "offset": 0},  # after its commit landed
            {"event": "committed", **where, "offset": 0, "ms": DUE + 3},
            {**seen_a, "id": "b", "seen_ms": DUE + 3, "offset": 1},
        )
    )
    history = History.load(sorted(tmp_path.glob("*.jsonl")))
    report = check(history, due_by_ms=DUE)
    assert (report.acked, report.seen) == (2, 2)
    assert report.twice == ["a"]
    assert report.cancel_violated == ["b"]
    assert "c" not in history.fates


def test_queues_and_commits_are_each_broker_groups_own():
    """Consumers over a whole cluster read several broker groups, each with its own
    queues and offsets: a commit at one covers nothing at another, and one id at the
    same (queue, offset) of two groups was stored twice."""
    history = acked("m1", "m2")
    history.seen_all(
        [
            seen("m1", DUE, position=(0, 5), group="g", broker="b2"),
            seen("m1", DUE + 3, position=(0, 5), group="g", broker="b2"),
            seen("m2", DUE, position=(1, 3), group="g", broker="b1"),
            seen("m2", DUE + 1, position=(1, 3), group="g", broker="b2"),
        ]
    )
    history.committed("g", 0, 9, DUE + 2, broker="b1")  # b1's queue 0, not b2's
    report = check(history, due_by_ms=DUE)
    assert (report.twice, report.redelivered) == (["m2"], ["m1"])
    history.committed("g", 0, 5, DUE + 2, broker="b2")
    assert check(history, due_by_ms=DUE).twice == ["m1", "m2"]
