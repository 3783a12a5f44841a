"""The tombstones of message_log by offset: what a take-over decides again.

A member that takes over a group decides every cancel and reschedule tombstone of
message_log again (``Canceller.take_over``, docs/replication.md). Reading the whole log
back to find them cost a promotion seconds per million records; tombstones are a small
share of them. ``TombstoneIndex`` keeps their offsets instead (8 bytes per tombstone,
nothing per message), from two sources that meet at ``replay_start``, where this
process's replay began (its checkpoint):

- at and above it, the replayer notes the tombstones it passes (``note``): it reads
  every record anyway and knows each one's type;
- below it, one scan of the segment files in a worker thread (``scan_offsets``, run by
  ``Replayer.scan_tombstones`` while the member follows) fills in the rest
  (``add_below``). Until then the index answers only from ``replay_start`` on.

It lives in memory and is never persisted: the scan costs one read of the log at start,
off the event loop, and there is no file to keep crash-safe, nor to cut when
message_log is cut (a cut restarts the member, which starts a new index). Offsets below
``log.min_offset`` leave with retention (``forget_below``).

``read_tombstones`` (every tombstone of a range, by reading it all) and
``read_tombstones_at`` (the records at known offsets) read segment files with
descriptors of their own: a worker thread may read while the event loop appends.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from delayd.logs import message_log
from delayd.logs.log_files import MESSAGE_LOG, LogFile, list_files
from storage.errors import CorruptionError
from storage.fs import O_READ, FileSystem
from storage.scan import BadFrame, read_frame, scan_frames

TombstoneRecord = tuple[int, int, bytes]  # (message_log offset, record type, payload)
CHECK_EVERY_RECORDS = 65536  # records a scan reads between two calls of its ``check``


class TombstoneIndex:
    """The offsets of message_log's tombstones, in order; see the module docstring.

    ``note`` runs on the event loop, ``between`` in a worker thread too: a lock keeps
    each one whole (the array may move when it grows)."""

    def __init__(self, replay_start: int) -> None:
        self.replay_start = replay_start
        self._offsets = array("q")
        self._covered_from = replay_start  # tombstones below it are not known yet
        self.complete = False  # whether add_below gave the part below replay_start
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._offsets)

    def note(self, offsets: Sequence[int]) -> None:
        """Tombstones replay just passed, in log order, at or past ``replay_start`` and
        past every offset noted before."""
        with self._lock:
            self._offsets.extend(offsets)

    def add_below(self, scanned_from: int, offsets: array[int]) -> None:
        """The scan's answer: every tombstone in [``scanned_from``, ``replay_start``),
        in order."""
        with self._lock:
            self._offsets = offsets + self._offsets
            self._covered_from = min(scanned_from, self.replay_start)
            self.complete = True

    def between(self, start: int, end: int) -> list[int]:
        """The offsets in [start, end), in order. Raises RuntimeError when ``start``
        lies below what the index knows (the scan has not answered yet)."""
        with self._lock:
            if start < self._covered_from:
                raise RuntimeError(
                    f"the tombstones below message_log offset {self.replay_start} are not "
                    "scanned yet: await Replayer.scan_tombstones() first"
                )
            offsets = self._offsets
            return offsets[bisect_left(offsets, start) : bisect_left(offsets, end)].tolist()

    def forget_below(self, offset: int) -> None:
        """Drop the offsets below ``offset`` (message_log's segments there are deleted)."""
        with self._lock:
            del self._offsets[: bisect_left(self._offsets, offset)]


def _segments_between(fs: FileSystem, data_dir: str, start: int, end: int) -> list[LogFile]:
    return [
        segment
        for segment in list_files(data_dir, MESSAGE_LOG, fs)
        if segment.base < end and segment.base + segment.size > start
    ]


def _scan(
    fs: FileSystem, data_dir: str, start: int, end: int, check: Callable[[], object] | None
) -> Iterator[TombstoneRecord]:
    tombstone_types = message_log.TOMBSTONE_TYPES
    scanned = 0
    for segment in _segments_between(fs, data_dir, start, end):
        fd = fs.open(segment.path, O_READ)
        try:
            first = max(start - segment.base, 0)
            limit = min(end - segment.base, segment.size)
            for offset, rtype, payload, _ in scan_frames(
                fs, fd, segment.path, segment.base, first, limit
            ):
                if rtype in tombstone_types:
                    yield offset, rtype, payload
                scanned += 1
                if check is not None and scanned % CHECK_EVERY_RECORDS == 0:
                    check()
        finally:
            fs.close(fd)


def read_tombstones(fs: FileSystem, data_dir: str, start: int, end: int) -> list[TombstoneRecord]:
    """The tombstones of message_log in [start, end) (record boundaries, both within
    the records written), found by reading every record there. Every CRC is checked
    (BadFrame for a damaged record)."""
    return list(_scan(fs, data_dir, start, end, None))


def scan_offsets(
    fs: FileSystem,
    data_dir: str,
    start: int,
    end: int,
    check: Callable[[], object] | None = None,
) -> array[int]:
    """The offsets of ``read_tombstones``'s records, without keeping their payloads.
    ``check`` is called every CHECK_EVERY_RECORDS records read, and may raise to stop
    the scan (``trio.from_thread.check_cancelled``)."""
    return array("q", (offset for offset, _, _ in _scan(fs, data_dir, start, end, check)))


def read_tombstones_at(
    fs: FileSystem, data_dir: str, offsets: Sequence[int]
) -> list[TombstoneRecord]:
    """The records at ``offsets`` (ascending, each a tombstone's), one read each: only
    those bytes of message_log are read. Raises CorruptionError for a damaged record or
    one that is not a tombstone (the index and the log disagree)."""
    if not offsets:
        return []
    found: list[TombstoneRecord] = []
    segments = _segments_between(fs, data_dir, offsets[0], offsets[-1] + 1)
    at = 0
    for segment in segments:
        end = segment.base + segment.size
        if at == len(offsets) or offsets[at] >= end:
            continue
        fd = fs.open(segment.path, O_READ)
        try:
            while at < len(offsets) and offsets[at] < end:
                offset = offsets[at]
                try:
                    record = read_frame(
                        fs, fd, segment.path, segment.base, offset - segment.base, segment.size
                    )
                except BadFrame as bad:
                    raise bad.corruption() from None
                if record.type not in message_log.TOMBSTONE_TYPES:
                    raise CorruptionError(
                        segment.path,
                        offset - segment.base,
                        len(record.payload),
                        f"the tombstone index lists a record of type {record.type} here",
                    )
                found.append((offset, record.type, record.payload))
                at += 1
        finally:
            fs.close(fd)
    if at != len(offsets):
        raise CorruptionError(
            segments[-1].path if segments else MESSAGE_LOG,
            0,
            0,
            f"the tombstone index lists offset {offsets[at]}, past message_log's files",
        )
    return found
