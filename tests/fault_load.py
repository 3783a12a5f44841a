"""Producers and consumers for the fault tests, as processes of their own (run on a
host of tests/netns_support with ``host.popen(fault_load.command(...))``), using the
public blocking clients as an application would.

Each writes its history, one JSON object a line, flushed as it goes (a kill -9 loses
at most the line being written), for ``tests.fault_checker.History.load``:

- ``produce``: batches of messages due 0 to ``--max-delay-ms`` out (one in ten at
  once); among the messages acknowledged and due at least 0.5 s out, every third
  batch cancels one and every fifth reschedules one. Records ``sent`` (with the
  earliest due time the message can have), ``acked`` (OK or DUPLICATE, with the due
  time answered), ``cancel`` and ``reschedule`` (outcome None: no answer came), and
  ``error`` for a call that gave up (DelaydTimeout after ``--timeout-s``).
- ``consume``: receives in a group, records ``seen``, commits each message durably
  (``commit="sync"``) and records ``committed`` once the broker answered; both carry
  the message's position: broker group (of a consumer over a whole cluster), queue,
  offset.

SIGTERM ends either after the call in progress.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import delayd
from delayd.errors import DelaydError
from delayd.protocol import Message
from tests.delivery_support import SUBJECT, now_ms, poll
from tests.fault_checker import History, Report, check
from tests.process_support import ROOT, child_env

SOON_MS = 500  # a cancel or reschedule picks a message due at least this far out
SETTLE_S = 10.0  # after the last due time, for the consumers to see everything


def command(role: str, server: str, history: Path, *args: str) -> list[str]:
    """The command line of a load process (``role``: produce or consume)."""
    return [sys.executable, "-m", "tests.fault_load", role, server, str(history), *args]


class Recorder:
    """Writes one history event a line, with the time it happened (epoch ms)."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    def __call__(self, event: str, **fields: object) -> None:
        self.out.write(json.dumps({"event": event, "ms": now_ms(), **fields}) + "\n")
        self.out.flush()


def produce(args: argparse.Namespace, record: Recorder, stop: list[bool]) -> None:
    rng = random.Random(args.seed)
    pending: list[tuple[str, int]] = []  # (id, due_ms) acknowledged, not yet touched
    sent = 0
    with delayd.Producer(args.server, timeout_s=args.timeout_s) as producer:
        for batch_no in itertools.count():
            if stop:
                return
            batch = []
            for _ in range(args.batch):
                delay = 0 if rng.random() < 0.1 else rng.randint(0, args.max_delay_ms)
                message_id = f"{args.prefix}-{sent}"
                sent += 1
                record("sent", id=message_id, earliest_due_ms=now_ms() + delay)
                batch.append(Message(message_id, SUBJECT, body=b"x" * 20, delay_ms=delay))
            try:
                receipts = producer.send_batch(batch)
            except DelaydError as exc:
                record("error", call="send", error=type(exc).__name__, detail=str(exc))
                continue
            for receipt in receipts:
                if receipt.ok:
                    duplicate = receipt.code.name == "DUPLICATE"
                    record(
                        "acked", id=receipt.message_id, due_ms=receipt.due_ms, duplicate=duplicate
                    )
                    pending.append((receipt.message_id, receipt.due_ms))
            soon = [p for p in pending if p[1] > now_ms() + SOON_MS]
            if soon and batch_no % 3 == 0:
                cancel(producer, record, pick(rng, soon, pending))
            elif soon and batch_no % 5 == 0:
                reschedule(
                    producer, record, pick(rng, soon, pending), now_ms() + rng.randint(0, 1000)
                )
            time.sleep(args.pause_s)


def pick(rng: random.Random, choices: list[tuple[str, int]], pending: list) -> str:
    """One of ``choices`` (id, due_ms), taken out of ``pending``: its id."""
    choice = rng.choice(choices)
    pending.remove(choice)
    return choice[0]


def cancel(producer: delayd.Producer, record: Recorder, message_id: str) -> None:
    try:
        outcome = producer.cancel(message_id).outcome.name
    except DelaydError as exc:
        record("error", call="cancel", error=type(exc).__name__, detail=str(exc))
        outcome = None  # no answer: cancelled or not
    record("cancel", id=message_id, outcome=outcome)


def reschedule(producer: delayd.Producer, record: Recorder, message_id: str, at_ms: int) -> None:
    try:
        outcome = producer.reschedule(message_id, at_ms=at_ms).outcome.name
    except DelaydError as exc:
        record("error", call="reschedule", error=type(exc).__name__, detail=str(exc))
        outcome = None  # no answer: moved or not
    record("reschedule", id=message_id, outcome=outcome, due_ms=at_ms)


def consume(args: argparse.Namespace, record: Recorder, stop: list[bool]) -> None:
    with delayd.Consumer(
        args.server,
        subject=SUBJECT,
        group=args.group,
        auto_commit=False,
        commit="sync",
        timeout_s=args.timeout_s,
        pull_wait_ms=100,
    ) as consumer:
        where = {"consumer": args.prefix, "group": args.group}
        while not stop:
            try:
                message = consumer.receive(timeout_s=0.2)
            except DelaydError as exc:
                record("error", call="receive", error=type(exc).__name__, detail=str(exc))
                continue
            if message is None:
                continue
            position = {
                "broker": broker_group_of(consumer, message),
                "queue": message.queue,
                "offset": message.queue_offset,
            }
            record(
                "seen",
                id=message.message_id,
                seen_ms=now_ms(),
                dispatched_ms=message.dispatched_ms,
                stored_ms=message.store_ms,
                due_ms=message.due_ms,
                **where,
                **position,
            )
            try:
                consumer.commit(message)
            except DelaydError as exc:
                record("error", call="commit", error=type(exc).__name__, detail=str(exc))
                continue
            record("committed", **where, **position)


def broker_group_of(consumer: delayd.Consumer, message: Message) -> str:
    """The broker group ``message`` came from when ``consumer`` reads a whole cluster
    ("" for a consumer of one broker): queues and offsets are a group's own, so the
    checker tells two groups' commits apart by it. The client keeps it only to route
    the commit, so it is read from there."""
    origins = getattr(getattr(consumer, "_consumer", None), "_origins", {})
    found = origins.get(id(message))  # (message, group) for a BlockingClusterConsumer
    return found[1] if found is not None else ""


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.fault_load")
    parser.add_argument("role", choices=["produce", "consume"])
    parser.add_argument("server", help="HOST:PORT (the delay server, or the broker)")
    parser.add_argument("history", type=Path)
    parser.add_argument("--prefix", default="p", help="message ids (or the consumer's name)")
    parser.add_argument("--group", default="check")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--max-delay-ms", type=int, default=1500)
    parser.add_argument("--pause-s", type=float, default=0.02)
    parser.add_argument("--timeout-s", type=float, default=5.0)
    args = parser.parse_args()
    stop: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    with open(args.history, "a", encoding="utf-8") as out:
        (produce if args.role == "produce" else consume)(args, Recorder(out), stop)


class LoadProcess:
    """A load process on a host, and its history file."""

    def __init__(self, host, role: str, server: str, history: Path, *args: str) -> None:
        self.history = history
        self.process: subprocess.Popen = host.popen(
            command(role, server, history, *args),
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.DEVNULL,
            stderr=open(history.with_suffix(".log"), "ab"),  # noqa: SIM115 (the child owns it)
        )
        self._events: list[dict] = []
        self._read_to = 0  # bytes of the history read into _events

    def events(self, kind: str | None = None) -> list[dict]:
        """The events recorded so far (of ``kind``), read incrementally: polling a
        history of thousands of lines costs only what was added since."""
        if self.history.exists():
            with open(self.history, "rb") as f:
                f.seek(self._read_to)
                added = f.read()
            complete = added[: added.rfind(b"\n") + 1]  # a line being written waits
            self._read_to += len(complete)
            self._events += [json.loads(line) for line in complete.splitlines()]
        return [e for e in self._events if kind is None or e["event"] == kind]

    def wait_for(self, kind: str, count: int, timeout_s: float = 20.0) -> None:
        """Until the history holds ``count`` events of ``kind`` (raises with the
        process's log if it ends first)."""

        def done() -> bool:
            if self.process.poll() is not None:
                raise AssertionError(f"{self.history.stem} exited early:\n{self.log_tail()}")
            return len(self.events(kind)) >= count

        poll(done, timeout_s, f"{count} {kind} events in {self.history}")

    def log_tail(self) -> str:
        return self.history.with_suffix(".log").read_text(errors="replace")[-3000:]

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, and wait for a clean end."""
        self.process.terminate()
        code = self.process.wait(timeout_s)
        assert code == 0, f"{self.history.stem} exited {code}:\n{self.log_tail()}"


class Load:
    """Producers and consumers of one test, and the checker over their histories.
    ``delay_server``: the producers' address (one, or a group's member list);
    ``broker``: the consumers'."""

    def __init__(self, delay_server: str, broker: str, tmp_path: Path) -> None:
        self.delay_server = delay_server
        self.broker = broker
        self.tmp_path = tmp_path
        self.producers: list[LoadProcess] = []
        self.consumers: list[LoadProcess] = []

    def producer(self, host, name: str, *args: str) -> LoadProcess:
        path = self.tmp_path / f"{name}.jsonl"
        process = LoadProcess(host, "produce", self.delay_server, path, "--prefix", name, *args)
        self.producers.append(process)
        return process

    def consumer(self, host, name: str) -> LoadProcess:
        path = self.tmp_path / f"{name}.jsonl"
        process = LoadProcess(host, "consume", self.broker, path, "--prefix", name)
        self.consumers.append(process)
        return process

    def history(self) -> History:
        processes = [*self.producers, *self.consumers]
        return History.from_events(e for p in processes for e in p.events())

    def acked(self) -> int:
        """Messages acknowledged so far, over every producer."""
        return sum(len(p.events("acked")) for p in self.producers)

    def wait_acked(self, more: int, timeout_s: float = 30.0) -> None:
        """Until the producers together got ``more`` acks than now."""
        target = self.acked() + more
        poll(lambda: self.acked() >= target, timeout_s, f"{target} acks")

    def finish(self, settle_s: float = SETTLE_S) -> Report:
        """Stop the producers, wait until every acknowledged message fell due and was
        seen (at most ``settle_s`` after the last due time), stop the consumers, and
        check."""
        for producer in self.producers:
            producer.stop()
        dues = [e["due_ms"] for p in self.producers for e in p.events("acked")]
        dues += [e["due_ms"] for p in self.producers for e in p.events("reschedule")]
        last_due_ms = max(dues)
        time.sleep(max(0.0, (last_due_ms - now_ms()) / 1000))
        deadline = time.monotonic() + settle_s
        while check(self.history(), due_by_ms=last_due_ms).lost and time.monotonic() < deadline:
            time.sleep(0.1)  # the consumers are still catching up (if not, the check says who)
        time.sleep(0.3)  # a copy coming twice would come now
        for consumer in self.consumers:
            consumer.stop()
        report = check(self.history(), due_by_ms=last_due_ms)
        print(report.summary())
        if not report.clean:
            # The evidence, in the failure's output: the recorded events of each
            # offending id (the histories under tmp_path do not outlive a CI run).
            offenders = {*report.lost, *report.early, *report.twice, *report.cancel_violated}
            for process in [*self.producers, *self.consumers]:
                for event in process.events():
                    if event.get("id") in offenders:
                        print(process.history.stem, json.dumps(event))
        report.assert_clean()
        return report


if __name__ == "__main__":
    main()
