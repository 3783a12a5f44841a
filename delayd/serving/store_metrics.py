"""Bytes and files of each log on disk, and the room left, for ``delayd serve`` and
``delayd broker``.

The directories are walked (scandir + stat) in a worker thread, never at scrape time:
a data directory can hold one schedule_log file per minute of two years. A walk runs
every ``min_interval_s`` at most, and at least 20 walk-durations apart, so that a huge
directory costs at most about 5 % of a core; a scrape reads the last walk's result.

The free space of the data directory's file system is asked (statvfs, in a worker
thread) every second: ``delayd_store_free_bytes`` and ``_filesystem_bytes`` for the
alert that comes before a full disk, ``delayd_store_refusing_writes{log}`` for the
logs that refuse writes now (delayd.write_refusals). When a log refuses and the file
system has ``RESUME_FREE_BYTES`` free again, the refusals are cleared, so /readyz turns
ready again even while no client retries; a log that still cannot write refuses again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import trio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from delayd.serving.metric_families import labelled
from delayd.write_refusals import LOGS, WriteRefusals

log = logging.getLogger(__name__)

MIN_INTERVAL_S = 5.0
COST_FACTOR = 20  # sleep at least this many times as long as the last walk took
FREE_SPACE_INTERVAL_S = 1.0
# Free bytes at which refusing logs are taken to write again: room for a few batches
# and the derived files they feed (a log that still cannot write refuses again).
RESUME_FREE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class DirectorySize:
    """What a walk found under one directory: segments (files named by digits: 20-digit
    base offsets, 12-digit buckets) and the bytes of every file (checkpoints too)."""

    segments: int
    bytes: int


def directory_size(path: str) -> DirectorySize:
    """Segments under ``path`` (recursively) and the apparent size of all its regular
    files; a missing directory is empty. Files that vanish during the walk are skipped."""
    segments = size = 0
    stack = [path]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                elif entry.is_file(follow_symlinks=False):
                    size += entry.stat(follow_symlinks=False).st_size
                    segments += entry.name.isascii() and entry.name.isdigit()
            except FileNotFoundError:
                continue
    return DirectorySize(segments, size)


class StoreSizes:
    """The sizes of named directories (``{"message_log": path, ...}``), refreshed by
    ``run``; ``sizes`` is None until the first walk is done."""

    def __init__(self, directories: Mapping[str, str], *, min_interval_s: float = MIN_INTERVAL_S):
        self.directories = dict(directories)
        self.min_interval_s = min_interval_s
        self.sizes: dict[str, DirectorySize] | None = None
        self.walks = 0

    def walk(self) -> dict[str, DirectorySize]:
        """Walk every directory now (blocking)."""
        return {name: directory_size(path) for name, path in self.directories.items()}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Walk in a worker thread, then sleep (see the module docstring); until cancelled."""
        task_status.started()
        while True:
            self.sizes, took = await trio.to_thread.run_sync(self._timed_walk)
            self.walks += 1
            await trio.sleep(max(self.min_interval_s, COST_FACTOR * took))

    def _timed_walk(self) -> tuple[dict[str, DirectorySize], float]:
        # The walk's real duration (its cost), not trio's clock, which a test may mock.
        started = time.perf_counter()
        sizes = self.walk()
        return sizes, time.perf_counter() - started


class StoreCollector(Collector):
    """``delayd_store_bytes{log}`` and ``delayd_store_segments{log}``."""

    def __init__(self, sizes: StoreSizes) -> None:
        self.sizes = sizes

    def collect(self) -> Iterator[Metric]:
        sizes = self.sizes.sizes
        if sizes is None:
            return
        by_log = sorted(sizes.items())
        yield labelled(
            GaugeMetricFamily,
            "delayd_store_bytes",
            "Bytes of all files of each log (apparent size; checkpoints included), as of "
            "the last walk.",
            "log",
            ((name, found.bytes) for name, found in by_log),
        )
        yield labelled(
            GaugeMetricFamily,
            "delayd_store_segments",
            "Segment files of each log (one per bucket for schedule_log and dispatch_log), "
            "as of the last walk.",
            "log",
            ((name, found.segments) for name, found in by_log),
        )


def broker_directories(broker_dir: str) -> dict[str, str]:
    """The broker's logs under ``<data>/broker`` (delayd.broker.store's layout)."""
    return {
        "broker_commitlog": os.path.join(broker_dir, "commitlog"),
        "broker_consumequeue": os.path.join(broker_dir, "consumequeue"),
        "broker_index": os.path.join(broker_dir, "index"),
    }


class FreeSpace:
    """The size and free bytes of the file system holding ``path``, asked every
    ``interval_s`` by ``run``; None until the first answer. Clears ``refusals`` once
    ``resume_free_bytes`` are free (see the module docstring)."""

    def __init__(
        self,
        path: str,
        refusals: WriteRefusals,
        *,
        interval_s: float = FREE_SPACE_INTERVAL_S,
        resume_free_bytes: int = RESUME_FREE_BYTES,
    ) -> None:
        self.path = path
        self.refusals = refusals
        self.interval_s = interval_s
        self.resume_free_bytes = resume_free_bytes
        self.free_bytes: int | None = None
        self.size_bytes: int | None = None

    def ask(self) -> tuple[int, int]:
        """(free bytes for this process, total bytes) now (blocking: statvfs)."""
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            try:
                self.free_bytes, self.size_bytes = await trio.to_thread.run_sync(self.ask)
            except OSError as exc:  # a metric is not worth stopping the server for
                log.warning("cannot ask the free space of %s: %s", self.path, exc)
                self.free_bytes = self.size_bytes = None
            else:
                if self.refusals.any and self.free_bytes >= self.resume_free_bytes:
                    self.refusals.clear_all()
            await trio.sleep(self.interval_s)


class DiskCollector(Collector):
    """``delayd_store_free_bytes``, ``delayd_store_filesystem_bytes``,
    ``delayd_store_refusing_writes{log,reason}`` and
    ``delayd_store_refused_writes_total{log}``."""

    def __init__(self, space: FreeSpace) -> None:
        self.space = space

    def collect(self) -> Iterator[Metric]:
        space, refusals = self.space, self.space.refusals
        if space.free_bytes is not None and space.size_bytes is not None:
            yield GaugeMetricFamily(
                "delayd_store_free_bytes",
                "Bytes free (to this process) on the file system of the data directory.",
                value=space.free_bytes,
            )
            yield GaugeMetricFamily(
                "delayd_store_filesystem_bytes",
                "Size in bytes of the file system of the data directory.",
                value=space.size_bytes,
            )
        refusing = GaugeMetricFamily(
            "delayd_store_refusing_writes",
            "1 while a log refuses writes (its disk is full), else 0.",
            labels=["log", "reason"],
        )
        refused = CounterMetricFamily(
            "delayd_store_refused_writes_total",
            "Writes a log refused because its disk was full.",
            labels=["log"],
        )
        for name in LOGS:
            refusing.add_metric([name, "disk_full"], int(refusals.refusing(name)))
            refused.add_metric([name], refusals.refused_total[name])
        yield refusing
        yield refused


class StoreMetrics:
    """What /metrics shows of a server's data directory: the sizes of ``directories``
    (StoreSizes) and the free space where ``data_dir`` is (FreeSpace, which clears
    ``refusals``), kept up to date by ``run``, shown by the collectors ``register``
    adds."""

    def __init__(
        self,
        directories: Mapping[str, str],
        data_dir: str,
        refusals: WriteRefusals,
        *,
        resume_free_bytes: int = RESUME_FREE_BYTES,
    ) -> None:
        self.sizes = StoreSizes(directories)
        self.space = FreeSpace(data_dir, refusals, resume_free_bytes=resume_free_bytes)

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(StoreCollector(self.sizes))
        registry.register(DiskCollector(self.space))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Walk the sizes and ask the free space until cancelled."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.sizes.run)
            await nursery.start(self.space.run)
            task_status.started()
