"""The sender's ledger (delayd/sender/ledger.py), driven directly with ``now_ms``: what
is held, what a cancel may take back, what is in doubt, and when failed messages come
back or go to their dead-letter subject. No trio, no files."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest

import delayd.sender.ledger
import delayd.sender.wire
from delayd.logs import message_log, schedule_log
from delayd.logs.dispatch_log import EntryKind
from delayd.logs.message_log import MessageRecord
from delayd.protocol import ResultCode, SendResult
from delayd.sender.ledger import (
    DEAD_LETTER_REASON,
    ORIGINAL_SUBJECT,
    PARKED_RETRY_S,
    Item,
    Ledger,
    Withdrawal,
)
from delayd.sender.retry import RetryPolicy

BUCKET_ID, BUCKET_MS = 3, 1_795_341_600_000
NO_JITTER = RetryPolicy(max_attempts=3, base_ms=100, max_ms=1_000, jitter=0.0)


def item(offset: int, message_id: str = "m", properties: dict | None = None) -> Item:
    record = MessageRecord(
        due_ms=BUCKET_MS + offset,
        sequence=offset,
        receive_ms=BUCKET_MS - 1,
        message_id=message_id,
        subject="orders",
        properties=properties or {},
        body=b"body",
    )
    payload = schedule_log.encode_scheduled(offset, message_log.encode_record(record))
    return Item(BUCKET_ID, BUCKET_MS, offset, payload)


def ledger(max_in_flight: int = 10, policy: RetryPolicy = NO_JITTER) -> Ledger:
    return Ledger(policy, max_in_flight, random.Random(7))


def taken(book: Ledger, *items: Item) -> list[Item]:
    book.release(i.ref for i in items)
    return book.take(list(items))


class Fates:
    """A watcher that keeps what it is told."""

    def __init__(self) -> None:
        self.told: list[tuple[EntryKind, int]] = []

    def __call__(self, kind: EntryKind, at_ms: int) -> None:
        self.told.append((kind, at_ms))


def test_a_released_entry_is_held_until_settled_and_counts_against_room():
    book = ledger(max_in_flight=2)
    a, b = item(10), item(20)
    assert taken(book, a, b) == [a, b]
    assert book.holds(a.ref) and book.holds(b.ref)
    assert (book.in_flight, book.has_room) == (2, False)
    book.settle([a], at_ms=5)
    assert not book.holds(a.ref) and book.holds(b.ref)
    assert (book.in_flight, book.has_room) == (1, True)


def test_withdrawn_before_it_is_read_it_is_dropped_when_read():
    book = ledger()
    a, b = item(10), item(20)
    book.release([a.ref, b.ref])
    assert book.withdraw(a.ref) is Withdrawal.WITHDRAWN
    assert book.take([a, b]) == [b]
    assert not book.holds(a.ref) and book.in_flight == 1
    assert book.withdrawn_total == 1


def test_a_held_message_is_withdrawn_unless_a_broker_may_have_it():
    book = ledger()
    idle, sending, unanswered = item(10), item(20), item(30)
    taken(book, idle, sending, unanswered)
    sending.sending = True
    book.unanswered([unanswered], "a", 0)
    assert book.withdraw(idle.ref) is Withdrawal.WITHDRAWN
    assert idle.withdrawn and book.in_flight == 2
    assert book.withdraw(sending.ref) is Withdrawal.IN_DOUBT
    assert book.withdraw(unanswered.ref) is Withdrawal.IN_DOUBT
    assert book.holds(sending.ref) and book.holds(unanswered.ref)
    assert book.withdraw(idle.ref) is Withdrawal.NOT_HELD


def test_answers_sort_into_acked_withdrawn_refused_and_disk_full():
    book = ledger()
    ok, dup, cancelled, refused, full, once_unanswered = items = [item(o) for o in range(6)]
    taken(book, *items)
    for i in items:
        i.sending = True
    cancel = Fates()
    book.watch(cancelled.ref, cancel, withdraw_on_refusal=True)
    book.watch(once_unanswered.ref, Fates(), withdraw_on_refusal=True)
    once_unanswered.maybe_sent = True  # a refusal does not prove it is stored nowhere
    bad = SendResult(ResultCode.INVALID_SUBJECT, "no")
    answers = [
        SendResult(ResultCode.OK),
        SendResult(ResultCode.DUPLICATE),
        bad,
        bad,
        SendResult(ResultCode.DISK_FULL, "full"),
        bad,
    ]
    out = book.sort_answers(items, answers)
    assert (out.acked, out.withdrawn) == ([ok, dup], [cancelled])
    assert (out.refused, out.disk_full) == ([refused, once_unanswered], [full])
    # Acknowledged and withdrawn ones stay in doubt until their entries are written.
    assert ok.sending and cancelled.sending and not refused.sending
    assert refused.reason == "INVALID_SUBJECT: no"
    book.withdraw_refused(out.withdrawn, at_ms=42)
    assert cancel.told == [(EntryKind.CANCELLED, 42)]
    assert cancelled.withdrawn and not book.holds(cancelled.ref)
    with pytest.raises(ValueError):
        book.sort_answers(items, answers[:2])


def test_watchers_learn_the_kind_of_the_entry_written():
    book = ledger()
    sent, dead = item(1), item(2)
    taken(book, sent, dead)
    sent.sending = dead.sending = True
    fates = {i.ref: Fates() for i in (sent, dead)}
    for i in (sent, dead):
        book.watch(i.ref, fates[i.ref], withdraw_on_refusal=False)
    dead.dead = True
    book.settle([sent, dead], at_ms=99)
    assert fates[sent.ref].told == [(EntryKind.DISPATCHED, 99)]
    assert fates[dead.ref].told == [(EntryKind.DEAD_LETTERED, 99)]


def test_an_earlier_runs_message_is_in_doubt_held_or_once_read():
    book = ledger()
    held, unread = item(1), item(2)
    taken(book, held)
    book.watch_earlier(BUCKET_MS, held.offset, held.ref, Fates())
    assert held.maybe_sent
    book.watch_earlier(BUCKET_MS, unread.offset, None, Fates())  # not loaded yet
    taken(book, unread)
    assert unread.maybe_sent and unread.watchers
    assert book.withdraw(unread.ref) is Withdrawal.IN_DOUBT


def test_retries_come_back_after_their_back_off_in_order():
    book = ledger()
    a, b = item(1), item(2)
    taken(book, a, b)
    assert book.retry([a], "g1", "refused", now_ms=1_000) == []
    assert book.retry([b], "g2", "refused", now_ms=1_050) == []
    assert book.wait_s(1_000) == pytest.approx(0.1)  # base_ms, no jitter
    assert book.due_retries(1_099) == []
    assert book.due_retries(1_150) == [([a], "g1"), ([b], "g2")]
    assert book.wait_s(1_150) == float("inf")
    # The second attempt of a waits twice as long.
    book.retry([a], "g1", "refused", now_ms=2_000)
    assert book.due_retries(2_199) == [] and book.due_retries(2_200) == [([a], "g1")]


def test_past_max_attempts_a_message_goes_to_its_dead_letter_subject_and_stays():
    book = ledger()
    a = item(1, message_id="id-1", properties={"p": "v"})
    taken(book, a)
    for attempt in (1, 2):
        assert book.retry([a], "g", f"refused {attempt}", now_ms=0) == []
    assert book.retry([a], "g", "refused 3", now_ms=0) == [a]
    assert a.dead and a.reason == "refused 3" and a.entry_kind is EntryKind.DEAD_LETTERED
    message = a.message(dispatched_ms=5)
    assert message.subject == "DLQ.orders"
    assert message.properties == {
        "p": "v",
        DEAD_LETTER_REASON: "refused 3",
        ORIGINAL_SUBJECT: "orders",
    }
    # Dead-lettered, it is retried, never dropped, and not marked again.
    assert book.retry([a], "g", "refused 4", now_ms=0) == []
    assert book.due_retries(10**9) != []


def test_a_full_disk_counts_no_attempt():
    book = ledger(policy=RetryPolicy(max_attempts=1, base_ms=0, max_ms=0, jitter=0.0))
    a = item(1)
    taken(book, a)
    assert book.retry([a], "g", "DISK_FULL", now_ms=0, count_attempt=False) == []
    assert (a.attempts, a.dead) == (0, False)


def test_parked_items_look_again_every_parked_retry_s():
    book = ledger()
    a = item(1)
    taken(book, a)
    book.park(a)
    assert book.parked == 1 and book.wait_s(0) == PARKED_RETRY_S
    assert book.unpark() == [a]
    assert book.parked == 0 and book.wait_s(0) == float("inf")


@pytest.mark.parametrize("module", [delayd.sender.ledger, delayd.sender.wire])
def test_the_bookkeeping_neither_awaits_nor_reads_the_clock(module):
    tree = ast.parse(Path(module.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (
            node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
        )
    }
    assert not imported & {"trio", "time", "anyio", "asyncio", "socket"}
    assert not any(isinstance(node, ast.AsyncFunctionDef | ast.Await) for node in ast.walk(tree))
