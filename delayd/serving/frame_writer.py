"""The write side of a server connection: frames out to a trio socket stream, in order.

Shared by the broker's and the delay server's connections. A frame is written to the
socket at once, by the task that has it, when nothing is queued before it and the
socket takes it whole — the common case of an answer to a request. Only what the socket
does not take waits in a queue for the writer task. On a busy event loop this saves a
scheduling step per answer: a long-poll PULL's answer, say, would otherwise wait for
the writer task's turn behind every other task woken by the same group commit.
"""

from __future__ import annotations

import os
from collections import deque

import trio

COALESCE_BYTES = 64 * 1024  # queued frames are joined up to this, one send
# Queued bytes beyond which ``send`` waits: a few PULL_RESULTs of the broker's
# max_pull_bytes (4 MiB) would otherwise wait 16 deep per connection that does not read.
MAX_QUEUED_BYTES = 1024 * 1024


class FrameWriter:
    """Writes frames to ``stream`` (a trio.SocketStream, or any SendStream, then always
    through the task) in the order ``send`` is called.

    Run ``run`` as a task; ``close`` lets it end once the queue is written. At most
    ``max_queued`` frames, or one frame beyond ``max_queued_bytes``, wait for it:
    ``send`` waits for room beyond that, so a peer
    that does not read slows its connection instead of growing memory. When the peer is
    gone, ``send`` raises BrokenResourceError (ClosedResourceError after ``close``) and
    ``run`` returns (it does not raise): the connection should stop then.
    """

    def __init__(
        self,
        stream: trio.abc.SendStream,
        max_queued: int = 16,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
    ) -> None:
        self._stream = stream
        # Written to directly only when it is a socket (other streams: by the task).
        self._socket = getattr(stream, "socket", None)
        self._max_queued = max_queued
        self._max_queued_bytes = max_queued_bytes
        self._queue: deque[bytes] = deque()
        self._queued_bytes = 0
        self._writing = False  # the writer task is in send_all
        self._closed = False
        self._broken = False
        self._more = trio.Event()  # the queue gained a frame, or close
        self._room = trio.Event()  # the queue lost some

    async def send(self, data: bytes) -> None:
        if self._broken:
            raise trio.BrokenResourceError("the peer is gone")
        if self._closed:
            raise trio.ClosedResourceError("the writer is closed")
        if not self._queue and not self._writing and self._socket is not None:
            written = self._write_now(data)
            if written < len(data):  # the rest first, before any later frame
                self._queue.append(data[written:])
                self._queued_bytes += len(data) - written
                self._more.set()
            return
        while self._queue and (
            len(self._queue) >= self._max_queued or self._queued_bytes >= self._max_queued_bytes
        ):
            self._room = trio.Event()
            await self._room.wait()
            if self._broken:
                raise trio.BrokenResourceError("the peer is gone")
        self._queue.append(data)
        self._queued_bytes += len(data)
        self._more.set()

    @property
    def queued_bytes(self) -> int:
        """Bytes waiting for the writer task."""
        return self._queued_bytes

    def _write_now(self, data: bytes) -> int:
        """As much of ``data`` as the socket takes without blocking (0 if none)."""
        fd = self._socket.fileno()
        if fd < 0:
            self._broken = True
            self._more.set()
            raise trio.BrokenResourceError("the socket is closed")
        try:
            return os.write(fd, data)  # a stream socket: write(2) is send(2) without flags
        except BlockingIOError:
            return 0
        except OSError as exc:  # EPIPE, ECONNRESET: Python ignores SIGPIPE
            self._broken = True
            self._more.set()  # the writer task returns, telling the connection
            raise trio.BrokenResourceError(f"the peer is gone: {exc}") from exc

    @property
    def broken(self) -> bool:
        """Whether the peer is gone (a write failed)."""
        return self._broken

    def close(self) -> None:
        """Send nothing more; ``run`` returns once the queue is written."""
        self._closed = True
        self._more.set()

    async def run(self) -> None:
        """Write what ``send`` queued until ``close`` (returns then) or until the peer is
        gone (returns at once, dropping the queue)."""
        queue = self._queue
        while not self._broken:
            if not queue:
                if self._closed:
                    return
                self._more = trio.Event()
                await self._more.wait()
                continue
            parts = [queue.popleft()]
            size = len(parts[0])
            while queue and size < COALESCE_BYTES:
                parts.append(queue.popleft())
                size += len(parts[-1])
            self._queued_bytes -= size
            self._room.set()
            self._writing = True
            try:
                await self._stream.send_all(parts[0] if len(parts) == 1 else b"".join(parts))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                self._broken = True
            finally:
                self._writing = False
        self._room.set()
