"""Helpers for the client tests: real broker processes, and small scripted servers.

``BrokerProcess`` runs ``delayd broker`` on a loopback port (kill -9 and restart on the
same port for the reconnect tests). ``ScriptedServer`` is an in-memory delayd server in a
thread, for what a real broker does only by chance: lose an acknowledgement, answer
BUSY. ``SilentServer`` accepts connections and never answers (time-outs).
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

from delayd.protocol import (
    NEED_DATA,
    SERVER,
    Connection,
    ConnectionClosed,
    Error,
    Hello,
    HelloOk,
    ResultCode,
    SendBatch,
    SendBatchResult,
    SendResult,
)
from tests.process_support import DELAYD, ROOT, child_env, free_port


class BrokerProcess:
    """``delayd broker --data DIR --listen 127.0.0.1:PORT`` as a child process."""

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        token: str | None = None,
        heartbeat_timeout_ms: int | None = None,
    ):
        self.data_dir = data_dir
        self.port = port or free_port()
        self.token = token
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.finished = False
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 15.0) -> BrokerProcess:
        """Start it and wait for its "listening" line (RuntimeError if it never comes).

        Refused once the ``with`` block has ended, so a restart scheduled by a test
        that failed meanwhile cannot leave a broker behind.
        """
        if self.finished:
            raise RuntimeError("this BrokerProcess is finished")
        # No metrics listener: its fixed default port would collide between test brokers.
        args = [*DELAYD, "broker", "--data", str(self.data_dir), "--listen", self.addr]
        args += ["--metrics-listen", "off"]
        if self.token is not None:
            args += ["--token", self.token]
        if self.heartbeat_timeout_ms is not None:
            args += ["--heartbeat-timeout-ms", str(self.heartbeat_timeout_ms)]
        self.proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**child_env(), "PYTHONUNBUFFERED": "1"},
        )
        ready = threading.Event()

        def pump(proc: subprocess.Popen[str] = self.proc) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.output.append(line)
                if "listening on" in line:
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError("broker did not start:\n" + "".join(self.output))
        return self

    def kill(self) -> None:
        """kill -9, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not stop within 5 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> BrokerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.finished = True
        self.kill()


class LoopbackListener:
    """Listens on a loopback port; a thread accepts and hands each connection to
    ``accepted``. ``close`` shuts the listener and every connection down."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.addr = f"127.0.0.1:{self._sock.getsockname()[1]}"
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def accepted(self, sock: socket.socket) -> None:
        """Called in the accept thread for every connection; it stays open until close."""

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            self._open.append(sock)
            self.accepted(sock)

    def close(self) -> None:
        # Closing alone leaves the port listening while the accept thread is blocked in
        # accept(); shutting it down wakes that thread, and connections are refused.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        for sock in self._open:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SilentServer(LoopbackListener):
    """Listens on a loopback port, accepts, and never says a word."""


# What a ScriptedServer does with a SEND_BATCH: None stores and answers as a broker
# would; DROP_ACK stores, then closes the connection without answering (a lost
# acknowledgement); HANG never answers; a list of results is the answer, and nothing
# is stored.
DROP_ACK = "drop-ack"
HANG = "hang"  # store nothing and never answer (the connection stays open)
SendHook = Callable[[SendBatch], list[SendResult] | Error | str | None]


class ScriptedServer(LoopbackListener):
    """A delayd server in a thread that stores SEND_BATCH messages in memory.

    ``stored`` maps message id to message (ids already there answer DUPLICATE, as a
    broker does); ``batches`` records every SEND_BATCH received, so a test can see what
    a client sent again. ``on_send`` may change the answer or drop the connection.
    """

    def __init__(self, *, token: str | None = None, on_send: SendHook | None = None) -> None:
        self.token = token
        self.on_send = on_send
        self.stored: dict[str, object] = {}
        self.batches: list[SendBatch] = []
        self.connections = 0  # accepted so far
        self.active = 0  # open now
        self._lock = threading.Lock()
        self._closed = threading.Event()
        super().__init__()

    def accepted(self, sock: socket.socket) -> None:
        with self._lock:
            self.connections += 1
            self.active += 1
        threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = Connection(SERVER, token=self.token)
        try:
            while True:
                try:
                    event = conn.next_event()
                except Exception as exc:  # a protocol error: answer it and close
                    sock.sendall(conn.send(Error.for_exception(exc)))  # type: ignore[arg-type]
                    return
                if event is NEED_DATA:
                    data = sock.recv(65536)
                    conn.receive_data(data)
                    continue
                if isinstance(event, ConnectionClosed):
                    return
                if isinstance(event, Hello):
                    answer = HelloOk(version=conn.protocol_version, request_id=event.request_id)
                elif isinstance(event, SendBatch):
                    with self._lock:
                        self.batches.append(event)
                    verdict = None if self.on_send is None else self.on_send(event)
                    if verdict == HANG:
                        self._closed.wait()
                        return
                    if verdict is None or verdict == DROP_ACK:
                        results = self._store(event)
                        if verdict == DROP_ACK:
                            return  # close without answering
                    else:
                        results = verdict
                    if isinstance(results, Error):  # the whole request refused
                        answer = Error(results.code, results.reason, request_id=event.request_id)
                    else:
                        answer = SendBatchResult(results, request_id=event.request_id)
                else:
                    answer = Error(7, "not implemented here", request_id=event.request_id)
                sock.sendall(conn.send(answer))
        except OSError:
            return
        finally:
            sock.close()
            with self._lock:
                self.active -= 1

    def _store(self, batch: SendBatch) -> list[SendResult]:
        with self._lock:
            results = []
            for m in batch.messages:
                if m.message_id in self.stored:
                    results.append(SendResult(ResultCode.DUPLICATE))
                else:
                    self.stored[m.message_id] = m
                    results.append(SendResult(ResultCode.OK, store_ms=int(time.time() * 1000)))
            return results

    def close(self) -> None:
        self._closed.set()  # wakes the connections told to HANG
        super().close()
