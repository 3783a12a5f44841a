"""Test helpers for the delay server's intake: a ``delayd serve`` child process on
loopback ports, a raw blocking protocol client (these tests must not depend on the
client library), and readers of the on-disk logs that check them against each other."""

from __future__ import annotations

import os
import re
import resource
import select
import signal
import socket
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from delayd.logs import layout, message_log, schedule_log
from delayd.logs.buckets import bucket_of, parse_bucket_name
from delayd.logs.message_log import MessageRecord
from delayd.protocol import (
    CLIENT,
    NEED_DATA,
    Connection,
    Event,
    FrameDecoder,
    Hello,
    Message,
    SendBatch,
    SendBatchResult,
    SendResult,
    decode_event,
)
from storage.fs import OsFileSystem
from storage.record_file import RecordFile
from storage.segmented_log import SegmentedLog
from tests.process_support import DELAYD, ROOT, ChildProcess, child_env

READY = re.compile(r"delayd serve listening on (\S+):(\d+)")
BROKER = re.compile(r"delayd serve broker listening on (\S+):(\d+)")
METRICS = re.compile(r"delayd serve metrics on https?://(\S+):(\d+)/metrics")
HTTP = re.compile(r"delayd serve http on https?://(\S+):(\d+)/v1")
START_TIMEOUT_S = 30.0


class ServeProcess(ChildProcess):
    """``delayd serve`` in a child process, every listener on a free loopback port;
    ``start()`` returns once the ready line is printed (or raises with the log)."""

    def __init__(
        self,
        data_dir: Path,
        *extra: str,
        log_path: Path | None = None,
        metrics_listen: str | None = "127.0.0.1:0",
        http_listen: str | None = "off",
        env: dict[str, str] | None = None,
        nofile: int | None = None,
        command_prefix: tuple[str, ...] = (),
    ) -> None:
        """``metrics_listen``: the flag's value; None passes no flag (the configured
        default applies); ``http_listen`` the same for the HTTP API (off unless asked:
        its default port would collide too). ``env``: variables added to the child's environment.
        ``nofile``: the child's RLIMIT_NOFILE, soft and hard (it cannot raise it).
        ``command_prefix``: put before the command (``ip netns exec NS``: on a host of
        tests/netns_support; its ``--listen``/``--broker-listen`` in ``extra`` then)."""
        self.command_prefix = list(command_prefix)
        self.data_dir = data_dir
        self.extra = list(extra)
        self.metrics_listen = metrics_listen
        self.http_listen = http_listen
        self.env = {**child_env(), **(env or {})}
        self.nofile = nofile
        self.log_path = log_path or data_dir.parent / f"{data_dir.name}-serve.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.address: tuple[str, int] | None = None
        self.broker_address: tuple[str, int] | None = None
        self.metrics_address: tuple[str, int] | None = None
        self.http_address: tuple[str, int] | None = None
        self.stdout = ""

    def start(self) -> ServeProcess:
        assert self.proc is None or self.proc.poll() is not None
        args = [
            *self.command_prefix,
            *DELAYD,
            "serve",
            "--data",
            str(self.data_dir),
            "--listen",
            "127.0.0.1:0",
            "--broker-listen",
            "127.0.0.1:0",
        ]
        if self.metrics_listen is not None:
            # Its own free port: the default (127.0.0.1:20880) would collide between
            # test servers. ``extra`` may name another (the last flag wins).
            args += ["--metrics-listen", self.metrics_listen]
        if self.http_listen is not None:
            args += ["--http-listen", self.http_listen]
        args += self.extra
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                args,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=log,
                env=self.env,
                preexec_fn=self._limit_descriptors if self.nofile else None,
            )
        self.stdout = ""
        deadline = time.monotonic() + START_TIMEOUT_S
        while (match := READY.search(self.stdout)) is None:
            chunk = self._read(deadline - time.monotonic())
            if not chunk:
                self.close()
                raise AssertionError(
                    f"delayd serve did not start:\n{self.stdout}\n{self.log_tail()}"
                )
            self.stdout += chunk
        self.address = (match.group(1), int(match.group(2)))
        if broker := BROKER.search(self.stdout):
            self.broker_address = (broker.group(1), int(broker.group(2)))
        if metrics := METRICS.search(self.stdout):
            self.metrics_address = (metrics.group(1), int(metrics.group(2)))
        if http := HTTP.search(self.stdout):
            self.http_address = (http.group(1), int(http.group(2)))
        return self

    def _limit_descriptors(self) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def _read(self, timeout_s: float) -> str:
        """What the child printed next ("" at EOF or after timeout_s). Unbuffered: the
        ready line may come in the same write as the lines before it."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], max(0.0, timeout_s))
        return os.read(fd, 65536).decode(errors="replace") if ready else ""

    def run_to_exit(self, timeout_s: float = 30.0) -> tuple[int, str]:
        """Start without waiting for readiness (for starts that must fail): the exit
        code and the log."""
        args = [*DELAYD, "serve", "--data", str(self.data_dir)]
        if self.metrics_listen is not None:
            args += ["--metrics-listen", "off"]
        if self.http_listen is not None:
            args += ["--http-listen", "off"]
        args += self.extra
        done = subprocess.run(
            args, cwd=ROOT, capture_output=True, env=self.env, timeout=timeout_s, check=False
        )
        return done.returncode, done.stderr.decode(errors="replace")


class RawClient:
    """A blocking protocol client over a plain socket: HELLO, then requests.

    ``send`` writes a request without waiting; ``receive`` returns the next event.
    """

    def __init__(self, address: tuple[str, int], *, token: str | None = None) -> None:
        self.sock = socket.create_connection(address, timeout=10)
        self.conn = Connection(CLIENT)
        self.request(lambda rid: Hello(token=token, client_name="intake-test", request_id=rid))

    def send(self, make: object) -> int:
        rid = self.conn.next_request_id()
        self.sock.sendall(self.conn.send(make(rid)))  # type: ignore[operator]
        return rid

    def receive(self) -> Event:
        while True:
            event = self.conn.next_event()
            if event is not NEED_DATA:
                return event
            data = self.sock.recv(1 << 20)
            self.conn.receive_data(data)

    def request(self, make: object) -> Event:
        self.send(make)
        return self.receive()

    def send_batch(self, messages: list[Message]) -> list[SendResult]:
        answer = self.request(lambda rid: SendBatch(messages, request_id=rid))
        assert isinstance(answer, SendBatchResult), answer
        return list(answer.results)

    def close(self) -> None:
        self.sock.close()


def raw_exchange(address: tuple[str, int], data: bytes) -> list[Event]:
    """Write ``data`` on a fresh socket, read until the server closes it, and decode
    the frames it sent (no Connection: ``data`` need not follow the protocol)."""
    decoder = FrameDecoder()
    out: list[Event] = []
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(data)
        while chunk := sock.recv(1 << 16):
            decoder.feed(chunk)
            while (frame := decoder.next_frame()) is not None:
                out.append(decode_event(frame.command, frame.flags, frame.request_id, frame.body))
    return out


class NoSyncFileSystem(OsFileSystem):
    """The real file system without fsync: for checking a recovered directory in
    crash tests, whose own durability is not what they test (and fsyncs cost time)."""

    def fsync(self, fd: int) -> None:
        pass

    def fdatasync(self, fd: int) -> None:
        pass

    def fsync_dir(self, path: str) -> None:
        pass


NO_SYNC_FS = NoSyncFileSystem()


# --------------------------------------------------------------------- reading the logs


@dataclass(frozen=True)
class Scheduled:
    bucket: int  # start ms
    offset: int  # in the bucket file
    message_log_offset: int
    message: MessageRecord


def read_message_log(data_dir: Path) -> list[tuple[int, MessageRecord]]:
    """(offset, record) of every message_log record, in order."""
    with SegmentedLog.open(layout.message_log_dir(str(data_dir)), fs=NO_SYNC_FS) as log:
        return [(r.offset, message_log.decode_message(r.payload)) for r in log.iter_from(0)]


def read_schedule_log(data_dir: Path) -> list[Scheduled]:
    """Every schedule_log record, bucket by bucket."""
    directory = Path(layout.schedule_log_dir(str(data_dir)))
    out: list[Scheduled] = []
    for path in sorted(directory.iterdir()):
        bucket = parse_bucket_name(path.name)
        with RecordFile.open(str(path), fs=NO_SYNC_FS, trusted_end=0) as rf:
            for r in rf.iter_from(0):
                assert r.type == schedule_log.TYPE_SCHEDULED
                s = schedule_log.decode_scheduled(r.payload)
                out.append(Scheduled(bucket, r.offset, s.message_log_offset, s.message))
    return out


def check_exactly_once(data_dir: Path, segment_scale: int) -> dict[str, Scheduled]:
    """Hold schedule_log to message_log (after a full replay): every message_log record
    is in schedule_log exactly once, in the bucket of its due time, byte for byte; every
    schedule record comes from message_log; sequences are dense and increasing.
    Returns the schedule records by message id."""
    logged = read_message_log(data_dir)
    scheduled = read_schedule_log(data_dir)
    copies = Counter(s.message_log_offset for s in scheduled)
    twice = sorted(o for o, n in copies.items() if n > 1)
    assert not twice, f"{len(twice)} message_log records scheduled more than once: {twice[:10]}"
    by_offset = {s.message_log_offset: s for s in scheduled}
    missing = [o for o, _ in logged if o not in by_offset]
    assert not missing, f"{len(missing)} message_log records not in schedule_log: {missing[:10]}"
    assert len(scheduled) == len(logged), "schedule records with no message_log record"
    for offset, record in logged:
        s = by_offset[offset]
        assert s.message == record, f"schedule record of message_log offset {offset} differs"
        assert s.bucket == bucket_of(record.due_ms, segment_scale)
    sequences = [r.sequence for _, r in logged]
    assert sequences == list(range(1, len(sequences) + 1)), "sequences not dense from 1"
    ids = Counter(s.message.message_id for s in scheduled)
    assert all(n == 1 for n in ids.values()), "a message id scheduled twice"
    return {s.message.message_id: s for s in scheduled}


def ok(results: list[SendResult]) -> list[SendResult]:
    """``results`` after asserting that all of them are OK."""
    assert all(r.code.name == "OK" for r in results), [(r.code, r.reason) for r in results]
    return results


def write_config(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def terminate(proc: ServeProcess) -> None:
    """Graceful stop that must succeed."""
    code = proc.stop()
    assert code == 0, f"delayd serve exited {code}\n{proc.log_tail()}"


def interrupt(proc: ServeProcess) -> int:
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGINT)
    return proc.proc.wait(30)
