"""ConnectionGate: one listener's door — the connection cap, the accept loop that
survives running out of descriptors, and the counts /metrics shows.

Shared by the delay server's intake listener and the broker's. A connection beyond
``max_connections`` is accepted and refused at once: one ERROR TOO_MANY_CONNECTIONS
frame (request id 0, closing), so the client knows why, then closed. Refusing costs a
descriptor for a moment; at most MAX_LINGERING refusals wait (REFUSE_LINGER_S) for the
client to read the frame before the socket closes — a close with unread input would
reset the connection, and the client would see a reset instead of the reason.

accept(2) failing with EMFILE or ENFILE (no descriptor left: the process's or the
system's) or ENOMEM/ENOBUFS is counted, logged at most once per LOG_INTERVAL_S, and
retried after ACCEPT_RETRY_S, as trio.serve_listeners does; the pending connection waits
in the kernel's backlog meanwhile. Any other error ends the server.

Protocol errors are counted by code, apart for connections that had not finished HELLO
(wrong token, garbage, timeouts: what a scanner or a misconfigured client produces),
and logged rate-limited: a flood of them costs a line per LOG_INTERVAL_S per reason.
Reasons never carry a token (delayd.protocol.connection leaves it out).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from delayd.protocol import Error, ErrorCode
from delayd.protocol.bodies import encode_event
from delayd.serving.connection_limits import ConnectionLimits, default_max_connections
from delayd.serving.frame_budget import FrameBudget
from storage.descriptor_limit import soft_descriptor_limit

log = logging.getLogger(__name__)

ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_RETRY_S = 0.1
LOG_INTERVAL_S = 10.0
MAX_LINGERING = 64
REFUSE_LINGER_S = 1.0
REFUSE_DRAIN_BYTES = 64 * 1024

# Bounded label values: why a connection was refused, and why one was closed.
REFUSED_REASONS = ("max_connections", "descriptors")
CLOSING_CODES = tuple(
    code
    for code in ErrorCode
    if code
    in (
        ErrorCode.MALFORMED,
        ErrorCode.UNSUPPORTED_VERSION,
        ErrorCode.UNAUTHORIZED,
        ErrorCode.HELLO_REQUIRED,
        ErrorCode.FRAME_TOO_LARGE,
        ErrorCode.UNKNOWN_COMMAND,
        ErrorCode.TIMEOUT,
    )
)


class RateLimitedLog:
    """Logs at most one line per ``interval_s`` per key, saying how many were not
    logged since the last line."""

    def __init__(self, logger: logging.Logger, interval_s: float = LOG_INTERVAL_S) -> None:
        self._log = logger
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._skipped: Counter[str] = Counter()

    def warning(self, key: str, message: str, *args: Any) -> None:
        now = trio.current_time()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            self._skipped[key] += 1
            return
        self._last[key] = now
        skipped = self._skipped.pop(key, 0)
        if skipped:
            message += f" (and {skipped} more like it in the last {self.interval_s:.0f} s)"
        self._log.warning(message, *args)


class ConnectionGate:
    """The cap, counts and frame budget of one listener named ``name``."""

    def __init__(self, name: str, limits: ConnectionLimits) -> None:
        self.name = name
        self.limits = limits
        self.max_connections = limits.connection_cap
        if self.max_connections > default_max_connections():
            log.warning(
                "%s listener: max_connections %d is more than the descriptor limit of %d "
                "leaves to it (%d): with every connection open, opening a log file may fail",
                name,
                self.max_connections,
                soft_descriptor_limit(),
                default_max_connections(),
            )
        self.budget = FrameBudget(limits.max_unfinished_frame_bytes)
        self.open = 0
        self.refused: Counter[str] = Counter({reason: 0 for reason in REFUSED_REASONS})
        self.hello_failures: Counter[ErrorCode] = Counter()  # closed before HELLO_OK
        self.protocol_errors: Counter[ErrorCode] = Counter()  # closed after it
        self._lingering = 0
        self._log = RateLimitedLog(log)
        refusal = Error(
            ErrorCode.TOO_MANY_CONNECTIONS,
            f"the {name} listener holds its max_connections ({self.max_connections}): "
            "connect again later",
            close=True,
        )
        self._refusal_frame = encode_event(refusal)

    async def serve(
        self,
        handler: Callable[[trio.SocketStream], Awaitable[object]],
        listeners: list[trio.SocketListener],
        *,
        handler_nursery: trio.Nursery | None = None,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept on every listener until cancelled, as trio.serve_listeners (same
        arguments): ``handler(stream)`` in ``handler_nursery`` for every admitted
        connection, a refusal for the others."""
        async with trio.open_nursery() as nursery:
            handlers = handler_nursery or nursery
            for listener in listeners:
                nursery.start_soon(self._accept_loop, listener, handler, handlers)
            task_status.started(listeners)

    async def _accept_loop(
        self,
        listener: trio.SocketListener,
        handler: Callable[[trio.SocketStream], Awaitable[object]],
        handlers: trio.Nursery,
    ) -> None:
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                        raise
                    self.refused["descriptors"] += 1
                    self._log.warning(
                        "accept:" + errno.errorcode[exc.errno],
                        "%s listener: accept failed with %s (%s); open connections %d; "
                        "retrying in %.1f s",
                        self.name,
                        errno.errorcode[exc.errno],
                        os.strerror(exc.errno),
                        self.open,
                        ACCEPT_RETRY_S,
                    )
                    await trio.sleep(ACCEPT_RETRY_S)
                    continue
                if self.open >= self.max_connections:
                    handlers.start_soon(self._refuse, stream)
                    continue
                self.open += 1
                handlers.start_soon(self._run, handler, stream)

    async def _run(
        self, handler: Callable[[trio.SocketStream], Awaitable[object]], stream: trio.SocketStream
    ) -> None:
        try:
            await handler(stream)
        finally:
            self.open -= 1
            await trio.aclose_forcefully(stream)

    async def _refuse(self, stream: trio.SocketStream) -> None:
        self.refused["max_connections"] += 1
        self._log.warning(
            "refused",
            "%s listener: refused a connection from %s: max_connections (%d) reached",
            self.name,
            _peer(stream),
            self.max_connections,
        )
        try:
            # A new socket's send buffer is empty: the frame fits without waiting.
            os.write(stream.socket.fileno(), self._refusal_frame)
            if self._lingering < MAX_LINGERING:
                self._lingering += 1
                try:
                    stream.socket.shutdown(socket.SHUT_WR)
                    with trio.move_on_after(REFUSE_LINGER_S):
                        drained = 0
                        while drained < REFUSE_DRAIN_BYTES:
                            chunk = await stream.receive_some(REFUSE_DRAIN_BYTES)
                            if not chunk:
                                break
                            drained += len(chunk)
                finally:
                    self._lingering -= 1
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client is gone already
        finally:
            await trio.aclose_forcefully(stream)

    def closed_by_protocol_error(
        self, code: ErrorCode, reason: str, *, after_hello: bool, peer: object
    ) -> None:
        """Count (and log, rate-limited) a connection closed for ``code``."""
        if after_hello:
            self.protocol_errors[code] += 1
        else:
            self.hello_failures[code] += 1
        phase = "after HELLO" if after_hello else "before HELLO"
        self._log.warning(
            f"{phase}:{code.name}",
            "%s listener: closing %s %s: %s: %s",
            self.name,
            peer,
            phase,
            code.name,
            reason,
        )


def _peer(stream: trio.SocketStream) -> str:
    try:
        return "{}:{}".format(*stream.socket.getpeername()[:2])
    except (OSError, TypeError):
        return "?"
