"""StoreSizes (delayd.serving.store_metrics): what a walk counts, and that it walks at most every
min_interval_s (trio's MockClock; the walk itself is real, over tmp_path)."""

from __future__ import annotations

import errno

import trio

from delayd.serving.store_metrics import (
    DirectorySize,
    DiskCollector,
    FreeSpace,
    StoreSizes,
    directory_size,
)
from delayd.write_refusals import MESSAGE_LOG, WriteRefusals
from storage.errors import DiskFullError


def test_segments_are_the_files_named_by_digits_bytes_are_all_files(tmp_path):
    (tmp_path / "q" / "0").mkdir(parents=True)
    (tmp_path / "q" / "0" / "00000000000000000000").write_bytes(b"x" * 10)
    (tmp_path / "00000000000000000010").write_bytes(b"y" * 5)
    (tmp_path / "recovery.checkpoint").write_bytes(b"z" * 3)
    assert directory_size(str(tmp_path)) == DirectorySize(segments=2, bytes=18)
    assert directory_size(str(tmp_path / "missing")) == DirectorySize(0, 0)


async def test_walks_at_most_every_min_interval(tmp_path, autojump_clock):
    log = tmp_path / "log"
    log.mkdir()
    sizes = StoreSizes({"message_log": str(log)}, min_interval_s=5.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(sizes.run)
        while sizes.sizes is None:
            await trio.sleep(0.01)
        started = trio.current_time()
        assert sizes.sizes == {"message_log": DirectorySize(0, 0)}
        (log / "00000000000000000000").write_bytes(b"x" * 7)
        await trio.sleep_until(started + 4.9)
        assert sizes.sizes["message_log"] == DirectorySize(0, 0) and sizes.walks == 1
        while sizes.walks < 2:  # the walk runs in a thread: wait for it, not a time
            await trio.sleep(0.01)
        # The first walk ended within one poll (0.01 s) before ``started``.
        assert trio.current_time() >= started + 5.0 - 0.02
        assert sizes.sizes["message_log"] == DirectorySize(1, 7)
        nursery.cancel_scope.cancel()


class ScriptedSpace(FreeSpace):
    """FreeSpace whose file system reports the free bytes a test sets."""

    free_now = 0

    def ask(self) -> tuple[int, int]:
        return self.free_now, 8 << 20


async def test_free_space_is_exported_and_clears_refusals_once_room_returns(autojump_clock):
    refusals = WriteRefusals()
    space = ScriptedSpace("/unused", refusals, interval_s=1.0, resume_free_bytes=1 << 20)
    collector = DiskCollector(space)
    assert [m.name for m in collector.collect()] == [
        "delayd_store_refusing_writes",
        "delayd_store_refused_writes",
    ]  # no free-space sample before the first answer
    full = DiskFullError("/data/delay/message_log/0", 4096, OSError(errno.ENOSPC, "full"))
    refusals.refuse(MESSAGE_LOG, full)
    space.free_now = 4096
    async with trio.open_nursery() as nursery:
        await nursery.start(space.run)
        # The question runs in a worker thread, which the autojump clock does not wait
        # for: wait for the answer, not for a time.
        with trio.fail_after(60):
            while space.free_bytes is None:
                await trio.sleep(0.01)
        samples = {
            (s.name, s.labels.get("log")): s.value for m in collector.collect() for s in m.samples
        }
        assert samples[("delayd_store_free_bytes", None)] == 4096
        assert samples[("delayd_store_filesystem_bytes", None)] == 8 << 20
        assert samples[("delayd_store_refusing_writes", MESSAGE_LOG)] == 1
        assert samples[("delayd_store_refusing_writes", "schedule_log")] == 0
        assert samples[("delayd_store_refused_writes_total", MESSAGE_LOG)] == 1
        assert refusals.reason() == (
            "disk full: message_log refuses writes; /data/delay/message_log has 4096 bytes free"
        )
        space.free_now = 2 << 20  # a filler file deleted
        with trio.fail_after(60):  # a question a second: cleared at one of them
            while refusals.any:
                await trio.sleep(0.01)
        assert refusals.reason() is None
        nursery.cancel_scope.cancel()
