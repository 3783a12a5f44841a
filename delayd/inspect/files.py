"""Read-only scans of the framed files of a data directory, for ``delayd inspect``.

Files are opened O_RDONLY and read with storage.scan, the parser every log uses — never
through ``RecordFile.open`` or ``SegmentedLog.open``, which cut torn tails and fsync:
inspecting must not change what it looks at (a damaged directory is evidence).

A scan stops at the first invalid frame of a file: a framed file cannot be resynced,
since any byte after a bad length could be taken for a header. The stop is reported as
a ``Damage``, classified as the stores would on open (docs/storage-format.md):

* **torn tail** — an interrupted last write: the bad frame is the file's last (it runs
  past the end, or its length ends exactly there) or everything from it on is zero
  bytes, it lies within the unsynced window of the end (``max_unsynced_bytes``), and the
  file may be written to (not a sealed message_log segment). Recovery cuts it quietly.
* **corrupt** — anything else: bytes that were once written correctly. The server
  refuses to open such a file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass

from storage.fs import O_READ, FileSystem
from storage.record_file import DEFAULT_MAX_UNSYNCED_BYTES
from storage.scan import READ_CHUNK, BadFrame, Record, scan_frames

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


def _all_zero(fs: FileSystem, fd: int, position: int, size: int) -> bool:
    """Whether bytes ``[position, size)`` of the file are all zero (a zero-filled tail,
    what some file systems leave after a crash extended a file)."""
    while position < size:
        chunk = fs.pread(fd, min(READ_CHUNK, size - position), position)
        if not chunk:
            return True  # the file is shorter than it was a moment ago
        if chunk.count(0) != len(chunk):
            return False
        position += len(chunk)
    return True


def classify(fs: FileSystem, fd: int, bad: BadFrame, size: int, *, may_be_torn: bool) -> Damage:
    """The Damage a BadFrame of a file of ``size`` bytes stands for (module docstring)."""
    tail = size - bad.position
    torn = (
        may_be_torn
        and tail <= DEFAULT_MAX_UNSYNCED_BYTES
        and (bad.position + bad.length >= size or _all_zero(fs, fd, bad.position, size))
    )
    return Damage(TORN_TAIL if torn else CORRUPT, bad.path, bad.position, tail, bad.reason)


def scan_file(
    fs: FileSystem,
    path: str,
    *,
    base: int = 0,
    start: int = 0,
    may_be_torn: bool = True,
    on_bytes: Callable[[int], None] | None = None,
) -> Generator[Record, None, FileEnd]:
    """The records of the file at ``path`` from byte ``start``, offsets counted from
    ``base``; returns (``yield from``) how the scan ended. ``on_bytes`` is told every
    few thousand records how many more bytes were read (for progress). Raises OSError
    when the file cannot be opened."""
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
            damage = classify(fs, fd, bad, size, may_be_torn=may_be_torn)
            end = FileEnd(size, bad.position, False, damage)
        if on_bytes is not None:
            on_bytes(size - reported)
        return end
    finally:
        fs.close(fd)


def file_size(fs: FileSystem, path: str) -> int:
    fd = fs.open(path, O_READ)
    try:
        return fs.fsize(fd)
    finally:
        fs.close(fd)


def list_names(fs: FileSystem, directory: str, keep: Callable[[str], bool]) -> list[str]:
    """The names in ``directory`` that ``keep`` accepts, sorted; [] when it is missing."""
    if not fs.exists(directory):
        return []
    return sorted(name for name in fs.listdir(directory) if keep(name))


def join(directory: str, name: str) -> str:
    return os.path.join(directory, name)


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
