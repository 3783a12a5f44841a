"""An in-process delay server without sockets, for delivery tests on trio's
autojump_clock: real message_log, replayer, schedule_log, dispatch_log, wheel manager
and sender, delivering to in-memory targets that record what they receive (beside the
real broker targets, which the process tests use)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field

import trio

from delayd.logs import layout, message_log, tombstone
from delayd.logs.dispatch_log import FATES, DispatchEntry, decode_records
from delayd.logs.message_log import MessageRecord
from delayd.protocol import Message, SendResult
from delayd.protocol.codes import ResultCode
from delayd.replay import open_replayer
from delayd.sender.targets import TargetUnavailable
from delayd.server.cancels import Answer
from delayd.server.config import ServeConfig
from delayd.server.delivery import Delivery
from storage.fs import O_READ, REAL_FS, FileSystem
from storage.scan import scan_frames
from storage.segmented_log import SegmentedLog
from tests.trio_support import running

# Trio's clock starts at 0; the pipeline's epoch ms at trio time 0 is fixed so tests
# can name due times exactly.
T0 = 1_795_341_600_000  # 2026-11-22T10:00:00Z


@dataclass
class Received:
    at_ms: int  # the pipeline's clock when the target got it
    message: Message


@dataclass
class RecordingTarget:
    """A broker group that stores nothing: it records the messages it is sent, and can
    be told to fail (unavailable), refuse (a result code), or hang."""

    name: str
    clock: object = None
    received: list[Received] = field(default_factory=list)
    unavailable: bool = False
    refuse: ResultCode | None = None
    hang: trio.Event | None = None
    send_s: float = 0  # how long each send takes (trio time)
    calls: int = 0
    subjects: list[str] = field(default_factory=list)  # of every message it was sent

    async def send_batch(self, messages):
        self.calls += 1
        self.subjects += [m.subject for m in messages]
        if self.hang is not None:
            await self.hang.wait()
        if self.unavailable:
            raise TargetUnavailable(f"{self.name} is down (test)")
        await trio.sleep(self.send_s)
        if self.refuse is not None:
            return [SendResult(self.refuse, "refused (test)") for _ in messages]
        now = self.clock()
        self.received.extend(Received(now, m) for m in messages)
        return [SendResult(ResultCode.OK) for _ in messages]

    async def aclose(self) -> None:
        pass


class Pipeline:
    """message_log → replayer → schedule_log → wheel → sender → targets, in-process.

    A test owns it in a ``with`` block, which closes its files however the test ends,
    and runs its tasks in ``async with pipeline.running():`` inside it::

        with Pipeline(data, [target]) as pipeline:
            ids = pipeline.schedule([T0 + 1000])
            async with pipeline.running():
                await trio.sleep(2)
            assert received_ids([target]) == ids
    """

    _ids = itertools.count(1)

    def __init__(
        self, data: str, targets: list[RecordingTarget], *, fs: FileSystem = REAL_FS, **config
    ) -> None:
        self.data = data
        self.config = ServeConfig(**config)
        self.targets = targets
        self.log = SegmentedLog.open(
            layout.message_log_dir(data),
            fs=fs,
            segment_size=self.config.message_log_segment_bytes,
        )
        self.replayer = open_replayer(
            data, self.log, segment_scale=self.config.segment_scale_minutes, fs=fs
        )
        self.sequence = self.replayer.recovery.next_sequence - 1
        self.delivery = Delivery(data, self.config, self.replayer, [(t, 1) for t in targets], fs=fs)
        self.delivery.ticker.origin_ms = T0
        for target in targets:
            target.clock = self.delivery.ticker.now_ms

    def now_ms(self) -> int:
        return self.delivery.ticker.now_ms()

    def schedule(self, dues: list[int], *, key: str | None = None) -> list[str]:
        """Accept messages due at ``dues`` (epoch ms) as intake would; their ids."""
        payloads, ids = [], []
        for due in dues:
            self.sequence += 1
            message_id = f"m{next(self._ids)}"
            ids.append(message_id)
            record = MessageRecord(
                due_ms=due,
                sequence=self.sequence,
                receive_ms=self.now_ms(),
                message_id=message_id,
                subject="orders",
                key=key,
                body=message_id.encode(),
            )
            payloads.append(message_log.encode_record(record))
        self.log.append_batch(payloads, message_log.TYPE_MESSAGE)
        self.log.flush()
        self.replayer.notify(self.sequence)
        return ids

    def append_tombstone(
        self, message_id: str, due_ms: int | None = None, *, always_copies: bool = True
    ) -> Answer:
        """What intake does for CANCEL / RESCHEDULE: a durable tombstone, whose Answer
        the canceller fills (``always_copies`` False: a reschedule of type 4, as
        versions before replication wrote it)."""
        stone = tombstone.Tombstone(message_id, self.now_ms(), due_ms, always_copies)
        (offset,) = self.log.append_batch([tombstone.encode(stone)], stone.rtype)
        self.log.flush()
        answer = self.delivery.canceller.expect(offset, is_cancel=stone.is_cancel)
        self.replayer.notify(0)
        return answer

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The replayer and the delivery tasks, as the server starts them; but the
        delivery tasks' origin stays T0 (Delivery.run would read the wall clock)."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.replayer.run)
            # As the server: delivery starts once replay has caught up.
            while self.replayer.position < self.log.durable_offset:
                await trio.sleep(0.001)
            delivery = self.delivery
            await nursery.start(delivery.sender.run)
            await nursery.start(delivery.ticker.run, delivery.sender.on_due)
            await nursery.start(delivery.manager.run)
            task_status.started()

    def running(self) -> AbstractAsyncContextManager[None]:
        """``run``'s tasks, started before the block and cancelled when it ends, so
        that what a test asserts after it is what the run left behind."""
        return running(self.run)

    async def run_until(self, deadline_ms: int, done: Callable[[], bool] | None = None) -> None:
        """Run the tasks until virtual ``deadline_ms`` (epoch ms), and then, when
        ``done`` is given, on until ``done()`` (a minute of real time at most, not
        virtual: the autojump clock moves on while a worker thread — a chunk of a big
        load — outlasts the clock's hold, so on a loaded machine virtual minutes can pass
        before work that was due long before them is done). Stops (the replayer, the
        sender's flush) before the tasks end."""
        async with self.running():
            await trio.sleep_until((deadline_ms - self.delivery.ticker.origin_ms) / 1000)
            give_up = time.monotonic() + 60
            while done is not None and not done() and time.monotonic() < give_up:
                await trio.sleep(0.1)
            await self.stop()

    async def stop(self) -> None:
        await self.replayer.stop()
        await self.delivery.sender.flush()

    def close(self) -> None:
        self.delivery.close()
        self.replayer.close()
        self.log.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def received_ids(targets: list[RecordingTarget]) -> list[str]:
    return [r.message.message_id for t in targets for r in t.received]


def dispatch_entries(data: str, fs: FileSystem = REAL_FS) -> dict[str, list[DispatchEntry]]:
    """Every dispatch_log entry, by bucket file name."""
    directory = layout.dispatch_log_dir(data)
    out = {}
    for name in sorted(fs.listdir(directory)):
        path = f"{directory}/{name}"
        fd = fs.open(path, O_READ)
        try:
            size = fs.fsize(fd)
            out[name] = list(decode_records(scan_frames(fs, fd, path, 0, 0, size), path))
        finally:
            fs.close(fd)
    return out


def dispatched_offsets(data: str) -> list[tuple[str, int]]:
    return [
        (name, e.offset)
        for name, entries in dispatch_entries(data).items()
        for e in entries
        if e.kind in FATES
    ]
