"""Delivery: the delay server's second half, wired — wheel, ticker, manager, sender.

    replayer ─on_scheduled─▶ WheelManager ─add─▶ Ticker/TimingWheel ─on_due─▶ Sender
                                                                      ─▶ broker groups
                                                                      ─▶ dispatch_log

Built while the server opens (blocking), run by the server once replay has caught up
with what message_log held at start (so records a crashed run had re-appended reach
the loader, which checks them against dispatch_log, before canAdd could offer them).
"""

from __future__ import annotations

import logging
import math
from functools import partial
from typing import TYPE_CHECKING

import trio

from delayd.broker import Broker
from delayd.logs import layout
from delayd.logs.dispatch_files import DispatchFiles
from delayd.logs.schedule_reader import ScheduleReader
from delayd.replay import Replayer
from delayd.sender.sender import Sender
from delayd.sender.targets import EmbeddedTarget, RemoteTarget, SendTarget
from delayd.server.cancels import Canceller
from delayd.server.config import ServeConfig
from delayd.timestamps import wall_ms
from delayd.wheel.manager import WheelManager
from delayd.wheel.ticker import Ticker
from delayd.wheel.timer import TimingWheel
from storage.checkpoint import write_checkpoint
from storage.fs import REAL_FS, FileSystem

if TYPE_CHECKING:
    from delayd.sender.discovery import BrokerDiscovery

log = logging.getLogger(__name__)

WHEEL_CHECKPOINT = "wheel"  # <data>/delay/checkpoint/wheel: the cursors, for operators


def build_targets(config: ServeConfig, broker: Broker) -> list[tuple[SendTarget, int]]:
    """The configured broker groups as send targets, with their weights; none when they
    are found in etcd (``broker_groups_from = "etcd"``: Delivery's BrokerDiscovery adds
    them as it finds them)."""
    targets: list[tuple[SendTarget, int]] = []
    if config.discovers_broker_groups:
        return targets
    for group in config.broker_groups:
        target: SendTarget
        if group.embedded:
            target = EmbeddedTarget(group.name, broker)
        else:
            target = RemoteTarget(group.name, group.addresses, token=config.token, tls=group.tls)
        targets.append((target, group.weight))
    return targets


class Delivery:
    """The delivery tasks of one delay server; see the module docstring."""

    def __init__(
        self,
        data_dir: str,
        config: ServeConfig,
        replayer: Replayer,
        targets: list[tuple[SendTarget, int]],
        *,
        fs: FileSystem = REAL_FS,
    ) -> None:
        self.data_dir = data_dir
        self.fs = fs
        schedule_dir = layout.schedule_log_dir(data_dir)
        wheel = TimingWheel(wall_ms(), tick_ms=config.wheel_tick_ms, slots=config.wheel_slots)
        self.ticker = Ticker(wheel, precise=True)  # trio's real clock: see precise.py
        self.dispatch = DispatchFiles(layout.dispatch_log_dir(data_dir), fs=fs)
        self.dispatch_lock = trio.Lock()
        # One reader each: the manager reads in worker threads, so does the sender.
        self.manager = WheelManager(
            self.ticker,
            ScheduleReader(schedule_dir, fs=fs),
            self.dispatch,
            replayer.append_lock,
            self.dispatch_lock,
            segment_scale=config.segment_scale_minutes,
            load_ahead_ms=config.load_ahead_ms,
        )
        replayer.on_scheduled = self.manager.on_scheduled
        self.sender = Sender(
            targets,
            self.manager,
            ScheduleReader(schedule_dir, fs=fs),
            self.dispatch,
            self.dispatch_lock,
            clock=self.ticker.now_ms,
            config=config.sender,
        )
        self.manager.on_marked = self.sender.entries_written
        # Tombstones are resolved as they are replayed, also before delivery runs (the
        # manager then has loaded nothing: dispatch_log decides; docs/cancel.md).
        self.canceller = Canceller(
            self.manager,
            self.sender,
            self.dispatch,
            self.dispatch_lock,
            clock=self.now_ms,
            earlier_end=replayer.log.end_offset,  # built before intake takes anything
        )
        self.discovery: BrokerDiscovery | None = None
        if config.discovers_broker_groups:
            # Here, not at the top: etcd's client brings httpx, which a server without
            # etcd (and `delayd serve --help`) does without.
            from delayd.sender.discovery import BrokerDiscovery

            self.discovery = BrokerDiscovery(
                self.sender,
                config.cluster.etcd,
                config.cluster.prefix,
                partial(RemoteTarget, token=config.token, tls=config.discovered_broker_tls),
                refresh_s=config.broker_groups_refresh_ms / 1000,
            )
        self.replayer = replayer
        self.decide_tombstones()
        self.running = False

    def decide_tombstones(self) -> None:
        """The replayer hands tombstones to this delivery's canceller (a leader, a
        server of no group)."""
        self.replayer.on_tombstones = self.canceller.on_tombstones
        self.replayer.before_checkpoint = self.canceller.before_checkpoint

    def derive_tombstones(self) -> None:
        """The replayer derives what tombstones put in schedule_log and the id index
        and decides nothing (a follower: the leader decides, ``Canceller.take_over``
        decides again at a promotion)."""
        self.replayer.on_tombstones = None
        self.replayer.before_checkpoint = None

    def now_ms(self) -> int:
        """The ticker's clock once ``run`` has set its origin; the wall clock before
        (the canceller runs during the start-up replay, before delivery)."""
        return self.ticker.now_ms() if self.ticker.origin_ms else wall_ms()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the sender, the ticker and the manager until cancelled."""
        # The ticker's epoch ms at trio time 0: the wheel reads time only through it.
        # Rounded down (floor of the wall clock, ceil of trio's, read after it), so the
        # ticker never runs ahead of the wall clock: with round() it could be up to
        # 0.5 ms ahead, and a broker stamped messages with a store_ms 1 ms before due.
        self.ticker.origin_ms = wall_ms() - math.ceil(trio.current_time() * 1000)
        async with trio.open_nursery() as nursery:
            if self.discovery is not None:
                # Before the sender: it routes over every group of the registry at once.
                await nursery.start(self.discovery.run)
            await nursery.start(self.sender.run)
            await nursery.start(self.ticker.run, self.sender.on_due)
            await nursery.start(self.manager.run)
            self.running = True
            task_status.started()

    async def stop(self) -> None:
        """Make dispatch_log durable and write the cursors (the tasks are cancelled by
        the caller afterwards)."""
        await self.sender.flush()
        data = self.manager.cursors.to_bytes()
        path = f"{layout.checkpoint_dir(self.data_dir)}/{WHEEL_CHECKPOINT}"
        await trio.to_thread.run_sync(write_checkpoint, self.fs, path, data)
        log.info("wheel cursors: %r", self.manager.cursors)

    def close(self) -> None:
        self.dispatch.close()
        self.manager.reader.close()
        self.sender.reader.close()
