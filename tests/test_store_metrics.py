"""StoreSizes (delayd.store_metrics): what a walk counts, and that it walks at most every
min_interval_s (trio's MockClock; the walk itself is real, over tmp_path)."""

from __future__ import annotations

import trio

from delayd.store_metrics import DirectorySize, StoreSizes, directory_size


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
