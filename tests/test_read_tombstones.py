"""delayd.replay.tombstone_index.read_tombstones: the tombstones of message_log between two
offsets, read from its files with descriptors of its own (what a take-over reads in a
worker thread) — the same records, in the same order, as the log's own reader gives,
over rolled segments and from and to any record boundary."""

from __future__ import annotations

import random
from pathlib import Path

from delayd.logs import layout, message_log, tombstone
from delayd.logs.message_log import MessageRecord
from delayd.replay.tombstone_index import read_tombstones
from storage.fs import REAL_FS
from storage.segmented_log import SegmentedLog

T = 1_795_341_600_000


def test_the_same_tombstones_as_the_log_reader_gives(tmp_path: Path) -> None:
    data = str(tmp_path)
    rng = random.Random(5)
    with SegmentedLog.open(layout.message_log_dir(data), segment_size=4096) as log:
        for n in range(300):
            if rng.random() < 0.2:
                stone = tombstone.Tombstone(f"m-{rng.randrange(n)}", T, None, True)
                log.append_batch([tombstone.encode(stone)], message_log.TYPE_CANCEL)
            else:
                record = MessageRecord(T + n, n + 1, T, f"m-{n}", "orders", body=b"x" * 60)
                log.append_batch([message_log.encode_record(record)], message_log.TYPE_MESSAGE)
        log.flush()
        assert len(list(Path(layout.message_log_dir(data)).iterdir())) > 4  # rolled
        offsets = [record.offset for record in log.iter_from(0)] + [log.end_offset]

        def expected(start: int, end: int) -> list[tuple[int, int, bytes]]:
            return [
                (r.offset, r.type, r.payload)
                for r in log.iter_from(start, end)
                if r.type != message_log.TYPE_MESSAGE
            ]

        everything = read_tombstones(REAL_FS, data, 0, log.end_offset)
        assert len(everything) > 40
        assert everything == expected(0, log.end_offset)
        for _ in range(50):
            start, end = sorted(rng.sample(offsets, 2))
            assert read_tombstones(REAL_FS, data, start, end) == expected(start, end)
        assert read_tombstones(REAL_FS, data, offsets[9], offsets[9]) == []
