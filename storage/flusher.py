"""Flush policies for a SegmentedLog, usable from trio without blocking the event loop.

``sync``  — ``append_batch`` returns only once its records are durable. Every append
            waiting at the moment an fsync starts is covered by that one fsync (group
            commit), so N concurrent producers cost one fsync, not N.
``async`` — ``append_batch`` returns once the records are written to the OS; a
            background task fsyncs every ``interval_ms``. A crash of the machine may
            lose the last interval; ``kill -9`` of the process loses nothing.

fsync runs in a worker thread (``trio.lowlevel.start_thread_soon``); the log's own locks
make that safe while the event loop keeps appending. Either policy keeps the unsynced
bytes well under the log's ``max_unsynced_bytes`` by flushing early, so the log never
has to fsync on the event loop itself.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from storage.errors import StorageError
from storage.framing import TYPE_DATA
from storage.segmented_log import SegmentedLog

if TYPE_CHECKING:
    import outcome

log = logging.getLogger(__name__)


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
        self._wanted = False  # an fsync was asked for since the last one started
        self._syncing = False  # an fsync runs in a worker thread
        self._synced = trio.Event()  # set when an fsync ends (run waits for it to stop)
        self._flush_done = trio.Event()  # set when the next fsync to start has ended
        self._failed = trio.Event()
        self._error: BaseException | None = None
        self._running = False
        self._token: trio.lowlevel.TrioToken | None = None
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
        """Ask for an fsync soon, without waiting for it (``flush`` waits). It starts at
        once when none is running, else right after the running one."""
        self._wanted = True
        self._start_fsync()

    async def flush(self) -> int:
        """Make everything appended so far durable, whatever the policy."""
        end = self.log.end_offset
        while self.log.durable_offset < end:
            await self._wait_for_flush()
        return self.log.durable_offset

    async def _wait_for_flush(self) -> None:
        if self._error is not None:
            raise StorageError(f"flush failed: {self._error!r}") from self._error
        # Everyone who asked before an fsync starts is covered by it; later askers wait
        # for the next one (group commit).
        done = self._flush_done
        self.request_flush()
        await done.wait()
        if self._error is not None:
            raise StorageError(f"flush failed: {self._error!r}") from self._error

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the flusher until cancelled. Raises the log's error if an fsync fails.

        The fsyncs themselves are not steps of this task: a request starts one in a
        worker thread, and its end is handled in the event loop's next step (waiters
        woken, ``on_durable`` called, the next fsync started if one was asked for
        meanwhile). A task that woke for every fsync would cost two more scheduling
        steps each; with group commit under load they are most of its cost.
        """
        self._token = trio.lowlevel.current_trio_token()
        self._running = True
        task_status.started()
        try:
            self._start_fsync()  # asked for before run started
            if self.policy.mode is FlushMode.SYNC:
                await self._failed.wait()
            else:
                while not self._failed.is_set():
                    with trio.move_on_after(self.policy.interval_ms / 1000):
                        await self._failed.wait()
                    self.request_flush()
            assert self._error is not None
            raise self._error
        finally:
            self._running = False
            with trio.CancelScope(shield=True):
                while self._syncing:  # never leave an fsync running under a closing log
                    self._synced = trio.Event()
                    await self._synced.wait()
            # Wake anyone still waiting so they fail instead of hanging.
            if self._error is None:
                self._error = StorageError("the log writer stopped")
            self._flush_done.set()

    def _start_fsync(self) -> None:
        """Start the fsync asked for, in a worker thread, unless one runs already."""
        if self._syncing or not self._wanted or not self._running or self._error is not None:
            return
        self._wanted = False
        done, self._flush_done = self._flush_done, trio.Event()
        if self.log.durable_offset >= self.log.end_offset:
            done.set()  # nothing to sync
            return
        self._syncing = True
        token = self._token
        assert token is not None

        def deliver(result: outcome.Outcome[object]) -> None:  # in the worker thread
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self._fsync_ended, result, done)

        trio.lowlevel.start_thread_soon(self.log.flush, deliver, name="delayd fsync")

    def _fsync_ended(self, result: outcome.Outcome[object], done: trio.Event) -> None:
        """In the event loop: the fsync started with ``done`` ended. Must not raise
        (it runs as a trio callback): an error is kept for the run task to raise."""
        self._syncing = False
        self._synced.set()
        try:
            result.unwrap()
            self.fsyncs += 1
            if self.on_durable is not None:
                self.on_durable()
        except BaseException as exc:
            # Never retried (fsyncgate): nothing appended since is acknowledged, and the
            # run task raises this, which stops the process; recovery re-reads the disk.
            log.critical(
                "%s: fsync failed, acknowledging nothing more and stopping: %s",
                self.log.directory,
                exc,
            )
            self._error = exc
            self._failed.set()
        finally:
            done.set()
        self._start_fsync()  # appends made during this one
