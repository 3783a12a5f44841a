"""Test helpers for delivery through real processes: ``delayd serve`` and ``delayd
broker`` children on loopback ports, consuming with the client library, and read-only
readers of dispatch_log that may look at a live server's files.

The checks are exact: every message a consumer sees is counted (the blocking consumer
drops only offsets it already handed out, never a second copy stored by the broker),
and what a broker holds is counted from its queue ends.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import delayd
from delayd.errors import DelaydError, ProtocolError
from delayd.logs import layout
from delayd.logs.buckets import parse_bucket_name
from delayd.logs.dispatch_log import FATES, DispatchEntry, EntryKind, decode_entry
from delayd.protocol import (
    ConnectionClosed,
    Message,
    ResultCode,
    SendBatch,
    SendBatchResult,
    Stats,
    StatsResult,
)
from storage.fs import O_READ, REAL_FS
from storage.scan import BadFrame, scan_frames
from tests.broker_support import BrokerProcess
from tests.broker_support import RawClient as BrokerClient
from tests.fault_checker import SHOWN_IDS, History, Sighting, check
from tests.intake_support import RawClient, Scheduled, ServeProcess, read_schedule_log

SUBJECT = "orders"
Child = TypeVar("Child", ServeProcess, BrokerProcess)


def hostport(address: tuple[str, int] | None) -> str:
    assert address is not None
    return "{}:{}".format(*address)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def poll(condition: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    """Ask until ``condition()`` holds: the state of another process, seen through
    requests or its files, has no event to wait for."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


class Processes:
    """Starts ``delayd serve`` and ``delayd broker`` children; ``close`` kills every one
    still running (the ``procs`` fixture calls it, so that none outlives its test)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[ServeProcess | BrokerProcess] = []

    def add(self, process: Child) -> Child:
        """Take ``process`` (made, not started) into the set that ``close`` kills."""
        self.started.append(process)
        return process

    def start(self, process: Child) -> Child:
        return self.add(process).start()

    def serve(self, data: Path, *extra: str) -> ServeProcess:
        return self.start(ServeProcess(data, *extra))

    def broker(self, name: str, port: int = 0) -> BrokerProcess:
        """A broker over ``tmp_path/<name>`` on ``port`` (0: a free one); started again
        with the same name it recovers the same data."""
        process = BrokerProcess(
            self.tmp_path / name,
            "--listen",
            f"127.0.0.1:{port}",
            "--metrics-listen",
            "off",
            log_path=self.tmp_path / f"{name}-broker.log",
        )
        return self.start(process)

    def close(self) -> None:
        with contextlib.ExitStack() as stack:  # every one, even when one fails to close
            for process in self.started:
                stack.callback(process.close)


def groups_toml(**groups: tuple[str, int]) -> str:
    """``[[broker_groups]]`` tables, one per ``name=(host, port)``."""
    return "".join(
        f'[[broker_groups]]\nname = "{name}"\naddresses = ["{hostport(address)}"]\n'
        for name, address in groups.items()
    )


# --------------------------------------------------------------------- STATS


def serve_stats(address: tuple[str, int]) -> dict:
    """The delay server's STATS (intake.last_sequence: messages in message_log)."""
    client = RawClient(address)
    try:
        answer = client.request(lambda rid: Stats(request_id=rid))
    finally:
        client.close()
    assert isinstance(answer, StatsResult), answer
    return dict(answer.stats)


def broker_stats(address: tuple[str, int]) -> dict:
    with BrokerClient(address) as client:
        return client.stats()


def stored_count(stats: dict, subject: str = SUBJECT) -> int:
    """Messages a broker holds for ``subject``: its queues are dense from 0, so the sum
    of their end offsets."""
    prefix = f"queue_end_offset/{subject}/"
    return sum(int(v) for k, v in stats.items() if k.startswith(prefix))


# --------------------------------------------------------------------- consuming


@dataclass(frozen=True)
class Received:
    message: Message
    received_ms: int  # the consumer's wall clock when receive() returned it

    @property
    def message_id(self) -> str:
        return self.message.message_id

    def sighting(self, group: str, *, committed: bool) -> Sighting:
        """For the fault checker. ``committed``: the group is done with the message once
        received (one uninterrupted pass, as ``consume`` reads), so a copy coming again
        counts twice; without, copies are the at-least-once window (a consumer that
        ran across kills, whose commits may not have landed)."""
        m = self.message
        position = None if m.queue is None else (m.queue, m.queue_offset)
        return Sighting(
            m.message_id,
            self.received_ms,
            dispatched_ms=m.dispatched_ms,
            due_ms=m.due_ms,
            position=position,
            group=group,
            committed_ms=self.received_ms if committed else None,
            stored_ms=m.store_ms,
        )


def consume(
    address: tuple[str, int],
    count: int,
    *,
    subject: str = SUBJECT,
    group: str = "check",
    timeout_s: float = 30.0,
) -> list[Received]:
    """Receive with one consumer of a new ``group`` until the broker's queues of
    ``subject`` are read to their ends and at least ``count`` messages came; returns
    every message received, copies included (the caller asserts exactly once).

    The broker's reput must have caught up with its commitlog before the queue ends
    are trusted: a message stored but not yet in a queue would otherwise be missed.
    """
    out: list[Received] = []
    deadline = time.monotonic() + timeout_s
    with delayd.Consumer(
        hostport(address), subject=subject, group=group, timeout_s=5.0, pull_wait_ms=200
    ) as consumer:
        while True:
            if len(out) >= count:
                stats = broker_stats(address)
                caught_up = stats["broker.reput_offset"] == stats["broker.commitlog_end_offset"]
                if caught_up and len(out) >= stored_count(stats, subject):
                    return out
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"{subject} at {hostport(address)}: received {len(out)} messages "
                    f"({len({r.message_id for r in out})} ids), expected at least {count}"
                )
            message = consumer.receive(timeout_s=min(0.5, remaining))
            if message is not None:
                out.append(Received(message, now_ms()))


def exactly_once(received: list[Received]) -> dict[str, Received]:
    """``received`` (one pass of one group) by message id, after the fault checker
    found no id twice in it."""
    history = History()
    history.seen_all(r.sighting("pass", committed=True) for r in received)
    report = check(history, due_by_ms=0)
    assert not report.twice, (
        f"{len(report.twice)} messages received more than once, e.g. {report.twice[:5]}"
    )
    return {r.message_id: r for r in received}


def assert_never_early(received: Collection[Received]) -> None:
    """No message left the delay server, reached the broker, or reached the consumer
    before the due time it carries (the fault checker's rule: one machine's clock, no
    skew allowed)."""
    for r in received:
        m = r.message
        assert None not in (m.due_ms, m.dispatched_ms, m.store_ms), f"times missing: {m}"
    history = History()
    history.seen_all(r.sighting("pass", committed=False) for r in received)
    report = check(history, due_by_ms=0)
    assert not report.early, report.summary() + f"\nearly: {report.early[:SHOWN_IDS]}"


# --------------------------------------------------------------------- dispatch_log


def read_dispatch_log(data_dir: Path) -> dict[int, list[DispatchEntry]]:
    """Every bucket's dispatch_log entries, read-only: safe while the server runs (an
    entry being written reads as the end of its file)."""
    directory = layout.dispatch_log_dir(str(data_dir))
    out: dict[int, list[DispatchEntry]] = {}
    if not os.path.isdir(directory):
        return out
    fs = REAL_FS
    for name in sorted(os.listdir(directory)):
        try:
            bucket = parse_bucket_name(name)
        except ValueError:
            continue
        path = f"{directory}/{name}"
        entries = out[bucket] = []
        fd = fs.open(path, O_READ)
        try:
            for record in scan_frames(fs, fd, path, 0, 0, fs.fsize(fd)):
                entries.append(decode_entry(record.type, record.payload, path, record.offset))
        except BadFrame:
            pass  # the tail being written
        finally:
            fs.close(fd)
    return out


def dispatched_count(data_dir: Path) -> int:
    """Records dispatch_log says what became of (COMPLETE marks left out), after
    asserting that none has two entries."""
    places = [
        (bucket, e.offset)
        for bucket, entries in read_dispatch_log(data_dir).items()
        for e in entries
        if e.kind in FATES
    ]
    twice = sorted(p for p, n in Counter(places).items() if n > 1)
    assert not twice, f"{len(twice)} records with two dispatch_log entries: {twice[:5]}"
    return len(places)


def check_dispatch_log(data_dir: Path) -> dict[str, tuple[Scheduled, DispatchEntry]]:
    """Hold dispatch_log to schedule_log (server stopped): every schedule_log record has
    exactly one fate (dispatched or dead-lettered), no entry names an offset that holds
    no record, and every COMPLETE mark covers only records that have their entry.
    Returns (schedule record, entry) by message id."""
    scheduled = read_schedule_log(data_dir)
    entries = read_dispatch_log(data_dir)
    by_place = {(s.bucket, s.offset): s for s in scheduled}
    out: dict[str, tuple[Scheduled, DispatchEntry]] = {}
    seen: Counter[tuple[int, int]] = Counter()
    for bucket, bucket_entries in entries.items():
        done = set()
        for entry in bucket_entries:
            if entry.kind is EntryKind.COMPLETE:
                below = [o for b, o in by_place if b == bucket and o < entry.offset]
                missing = [o for o in below if o not in done]
                assert not missing, f"bucket {bucket}: COMPLETE at {entry.offset} before {missing}"
                continue
            if entry.kind is EntryKind.ROUTE:  # the bucket's route set: no record's
                continue
            place = (bucket, entry.offset)
            if entry.kind is EntryKind.ROUTED:  # where a send went: not its fate
                assert place in by_place, f"ROUTED entry for no schedule record: {entry}"
                continue
            seen[place] += 1
            done.add(entry.offset)
            assert place in by_place, f"dispatch_log entry for no schedule record: {entry}"
            s = by_place[place]
            out[s.message.message_id] = (s, entry)
    twice = sorted(p for p, n in seen.items() if n > 1)
    assert not twice, f"{len(twice)} records dispatched more than once: {twice[:5]}"
    missing = sorted(p for p in by_place if p not in seen)
    assert not missing, f"{len(missing)} schedule records never dispatched: {missing[:5]}"
    return out


# --------------------------------------------------------------------- live traffic


@dataclass(frozen=True)
class Workload:
    """What a SteadySender sends: batches of ``batch`` messages due ``delay_ms`` (a
    range) after receipt — a share ``past_due`` of them due at once — with bodies of up
    to ``max_body`` bytes; ``in_flight`` requests pipelined, ``pause_s`` after each
    answer. Its sender starts acking once ``warm`` messages were acknowledged."""

    delay_ms: tuple[int, int] = (0, 1500)
    past_due: float = 0.1
    max_body: int = 100
    batch: int = 10
    in_flight: int = 2
    pause_s: float = 0.005
    warm: int = 20


class SteadySender(threading.Thread):
    """Sends ``load`` until ``stop`` is set or the connection breaks (the server was
    killed or stopped). ``acked`` maps the id of every acknowledged message to its
    due_ms; ``sent`` holds every id sent, acknowledged or not. ``started_acking`` is set
    once ``load.warm`` messages were acknowledged (or the sender ended)."""

    def __init__(
        self, address: tuple[str, int], prefix: str, seed: int, load: Workload = Workload()
    ) -> None:
        super().__init__(name=f"sender-{prefix}", daemon=True)
        self.address = address
        self.prefix = prefix
        self.rng = random.Random(seed)
        self.load = load
        self.sent: set[str] = set()
        self.acked: dict[str, int] = {}
        self.stop = threading.Event()
        self.started_acking = threading.Event()
        self.error: BaseException | None = None

    def _batch(self) -> list[Message]:
        out = []
        for _ in range(self.load.batch):
            message_id = f"{self.prefix}-{len(self.sent)}"
            self.sent.add(message_id)
            if self.rng.random() < self.load.past_due:
                delay = 0  # past-due handling under the same crashes
            else:
                delay = self.rng.randint(*self.load.delay_ms)
            body = self.rng.randbytes(self.rng.randrange(self.load.max_body))
            out.append(Message(message_id, SUBJECT, body=body, delay_ms=delay))
        return out

    def run(self) -> None:
        try:
            client = RawClient(self.address)
        except OSError as exc:
            self.error = exc
            self.started_acking.set()
            return
        pending: dict[int, list[Message]] = {}
        try:
            while pending or not self.stop.is_set():
                while len(pending) < self.load.in_flight and not self.stop.is_set():
                    batch = self._batch()
                    rid = client.send(lambda r, b=batch: SendBatch(b, request_id=r))
                    pending[rid] = batch
                answer = client.receive()
                if isinstance(answer, ConnectionClosed):
                    return  # killed or stopped between frames
                assert isinstance(answer, SendBatchResult), answer
                for m, result in zip(pending.pop(answer.request_id), answer.results, strict=True):
                    assert result.code is ResultCode.OK, result
                    self.acked[m.message_id] = result.due_ms
                if len(self.acked) >= self.load.warm:
                    self.started_acking.set()
                time.sleep(self.load.pause_s)  # pacing: a steady stream, not a flood
        except (OSError, ProtocolError):
            pass  # killed in the middle of a frame
        except BaseException as exc:
            self.error = exc
        finally:
            self.started_acking.set()
            client.close()


class LiveConsumer(threading.Thread):
    """Consumes ``subject`` in ``group`` while a server runs, until ``stop`` is set or
    the broker goes away; keeps everything received with the time it came. Copies are
    possible across restarts (committed offsets are saved every second), so only the
    times are for checking."""

    def __init__(self, address: tuple[str, int], group: str, subject: str = SUBJECT) -> None:
        super().__init__(name=f"consumer-{group}", daemon=True)
        self.address = address
        self.group = group
        self.subject = subject
        self.received: list[Received] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with delayd.Consumer(
                hostport(self.address),
                subject=self.subject,
                group=self.group,
                timeout_s=1.0,
                pull_wait_ms=100,
            ) as consumer:
                while not self.stop.is_set():
                    message = consumer.receive(timeout_s=0.2)
                    if message is not None:
                        self.received.append(Received(message, now_ms()))
        except DelaydError:
            pass  # the broker was killed
        except BaseException as exc:
            self.error = exc
