"""Read-only scans of the framed files of a data directory, for ``delayd inspect``.

Files are opened O_RDONLY and read with storage.scan, the parser every log uses — never
through ``RecordFile.open`` or ``SegmentedLog.open``, which cut torn tails and fsync:
inspecting must not change what it looks at (a damaged directory is evidence).

A scan stops at the first invalid frame of a file: a framed file cannot be resynced,
since any byte after a bad length could be taken for a header. The stop is reported as
a ``Damage``, judged by storage.torn_tail as the stores judge it on open
(docs/storage-format.md):

* **torn tail** — what recovery would cut quietly: a bad frame at or after what the log
  knows durable and within the unsynced window (``max_unsynced_bytes``) of the log's end.
* **corrupt** — anything else: bytes that were once written correctly. The server
  refuses to open such a file.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

from delayd.logs.log_files import LogFile
from storage.fs import O_READ, FileSystem
from storage.scan import BadFrame, Record, scan_frames

TORN_TAIL = "torn tail"
CORRUPT = "corrupt"
PROGRESS_EVERY_RECORDS = 4096  # how often a scan reports the bytes it read


@dataclass(frozen=True, slots=True)
class Damage:
    """Where a scan met bytes that are not a valid record, and what they likely are."""

    kind: str  # TORN_TAIL or CORRUPT
    path: str
    position: int  # byte position in the file
    length: int  # bytes from there to the end of the file, all unread
    reason: str


@dataclass(frozen=True, slots=True)
class FileEnd:
    """How the scan of one file ended."""

    size: int  # bytes in the file
    stopped_at: int  # byte position where the scan stopped (damage, marker or end)
    sealed: bool  # stopped at an END_OF_SEGMENT marker
    damage: Damage | None


def classify(file: LogFile, bad: BadFrame, size: int) -> Damage:
    """The Damage a BadFrame of ``file``, now ``size`` bytes long, stands for."""
    torn = dataclasses.replace(file, size=size).is_torn_tail(bad.position)
    return Damage(
        TORN_TAIL if torn else CORRUPT, bad.path, bad.position, size - bad.position, bad.reason
    )


def scan_file(
    fs: FileSystem,
    file: LogFile,
    *,
    start: int = 0,
    on_bytes: Callable[[int], None] | None = None,
) -> Generator[Record, None, FileEnd]:
    """The records of ``file`` from byte ``start``, offsets counted from its base;
    returns (``yield from``) how the scan ended. ``on_bytes`` is told every few
    thousand records how many more bytes were read (for progress). Raises OSError when
    the file cannot be opened."""
    path, base = file.path, file.base
    fd = fs.open(path, O_READ)
    try:
        size = fs.fsize(fd)
        reported = start
        frames = scan_frames(fs, fd, path, base, start, size)
        count = 0
        try:
            while True:
                try:
                    record = next(frames)
                except StopIteration as done:
                    position, sealed = done.value
                    end = FileEnd(size, position, sealed, None)
                    break
                yield record
                count += 1
                if on_bytes is not None and count % PROGRESS_EVERY_RECORDS == 0:
                    on_bytes(record.next_offset - base - reported)
                    reported = record.next_offset - base
        except BadFrame as bad:
            damage = classify(file, bad, size)
            end = FileEnd(size, bad.position, False, damage)
        if on_bytes is not None:
            on_bytes(size - reported)
        return end
    finally:
        fs.close(fd)


def records_of(
    scan: Generator[Record, None, FileEnd], ends: list[FileEnd] | None = None
) -> Iterator[Record]:
    """The records of ``scan``, for a plain ``for`` loop. When the scan finishes, its
    FileEnd is appended to ``ends``; closing this iterator early closes the scan (and
    its file)."""
    with contextlib.closing(scan):
        end = yield from scan
    if ends is not None:
        ends.append(end)
