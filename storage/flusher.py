"""Flush policies for a SegmentedLog, usable from trio without blocking the event loop.

``sync``  — ``append_batch`` returns only once its records are durable. Every append
            waiting at the moment an fsync starts is covered by that one fsync (group
            commit), so N concurrent producers cost one fsync, not N.
``async`` — ``append_batch`` returns once the records are written to the OS; a
            background task fsyncs every ``interval_ms``. A crash of the machine may
            lose the last interval; ``kill -9`` of the process loses nothing.

fsync runs in a worker thread (``trio.to_thread``); the log's own locks make that safe
while the event loop keeps appending. Either policy keeps the unsynced bytes well under
the log's ``max_unsynced_bytes`` by flushing early, so the log never has to fsync on the
event loop itself.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio

from storage.errors import StorageError
from storage.framing import TYPE_DATA
from storage.segmented_log import SegmentedLog


class FlushMode(enum.StrEnum):
    SYNC = "sync"
    ASYNC = "async"


@dataclass(frozen=True, slots=True)
class FlushPolicy:
    mode: FlushMode = FlushMode.SYNC
    interval_ms: int = 100  # async only: time between fsyncs

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", FlushMode(self.mode))
        if self.interval_ms <= 0:
            raise ValueError(f"flush interval_ms must be positive, got {self.interval_ms}")


SYNC = FlushPolicy(FlushMode.SYNC)


class LogWriter:
    """Appends to a SegmentedLog under a flush policy.

    Start ``run`` in a nursery (``await nursery.start(writer.run)``) before appending;
    cancelling it stops the flusher (call ``log.close()`` afterwards to flush the rest).

    ``on_durable``, when given, is called on the event loop after every fsync, before
    the tasks waiting for it wake: work that follows durability (e.g. a broker's reput)
    runs in the flusher's scheduling step instead of a task of its own. If it raises,
    the writer stops with that error.
    """

    def __init__(
        self,
        log: SegmentedLog,
        policy: FlushPolicy = SYNC,
        *,
        on_durable: Callable[[], object] | None = None,
    ) -> None:
        self.log = log
        self.policy = policy
        self.on_durable = on_durable
        self._flush_wanted = trio.Event()
        self._flush_done = trio.Event()
        self._error: BaseException | None = None
        self._running = False
        self.fsyncs = 0  # flushes performed: with group commit, fewer than appends

    async def append_batch(self, payloads: Sequence[bytes], rtype: int = TYPE_DATA) -> list[int]:
        """Append records; returns their offsets once the policy allows the ack."""
        if not self._running:
            raise StorageError("LogWriter.run is not running; start it in a nursery first")
        # Back-pressure: never let the unsynced window reach the log's hard bound.
        while self.log.unsynced_bytes > self.log.max_unsynced_bytes // 2:
            await self._wait_for_flush()
        offsets = self.log.append_batch(payloads, rtype)
        if self.policy.mode is FlushMode.SYNC and offsets:
            end = self.log.end_offset
            while self.log.durable_offset < end:
                await self._wait_for_flush()
        return offsets

    async def append(self, payload: bytes, rtype: int = TYPE_DATA) -> int:
        return (await self.append_batch((payload,), rtype))[0]

    def request_flush(self) -> None:
        """Ask for an fsync soon, without waiting for it (``flush`` waits)."""
        self._flush_wanted.set()

    async def flush(self) -> int:
        """Make everything appended so far durable, whatever the policy."""
        end = self.log.end_offset
        while self.log.durable_offset < end:
            await self._wait_for_flush()
        return self.log.durable_offset

    async def _wait_for_flush(self) -> None:
        if self._error is not None:
            raise StorageError(f"flush failed: {self._error!r}") from self._error
        done = self._flush_done
        self._flush_wanted.set()
        await done.wait()
        if self._error is not None:
            raise StorageError(f"flush failed: {self._error!r}") from self._error

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The flusher task. Raises the log's error if an fsync fails."""
        self._running = True
        task_status.started()
        try:
            while True:
                if self.policy.mode is FlushMode.SYNC:
                    await self._flush_wanted.wait()
                else:
                    with trio.move_on_after(self.policy.interval_ms / 1000):
                        await self._flush_wanted.wait()
                await self._flush_once()
        finally:
            self._running = False
            # Wake anyone still waiting so they fail instead of hanging.
            if self._error is None:
                self._error = StorageError("the log writer stopped")
            self._flush_done.set()

    async def _flush_once(self) -> None:
        # Everyone who asked before this point is covered by this fsync; later askers
        # wait for the next one (group commit).
        self._flush_wanted = trio.Event()
        done, self._flush_done = self._flush_done, trio.Event()
        try:
            if self.log.durable_offset < self.log.end_offset:
                await trio.to_thread.run_sync(self.log.flush)
                self.fsyncs += 1
            if self.on_durable is not None:
                self.on_durable()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            done.set()
