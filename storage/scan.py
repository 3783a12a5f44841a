"""The one parser of framed records on disk, shared by every log shape.

It reads big chunks with pread and yields ``Record`` tuples, checking every crc. Both
``SegmentedLog`` (many offset-named segments) and ``RecordFile`` (one file, as a
schedule_log bucket) scan through it, so a record is validated the same way wherever
it is read — including by the audit's Spark readers.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Generator, Sequence
from typing import NamedTuple

from storage.errors import CorruptionError
from storage.framing import HEADER, HEADER_SIZE, TYPE_END_OF_SEGMENT, crc32c
from storage.fs import FileSystem

READ_CHUNK = 1 << 20  # bytes per pread while scanning


class Record(NamedTuple):
    offset: int  # logical offset of the record's header
    type: int
    payload: bytes
    next_offset: int  # where the next record starts (resume a scan from here)


class BadFrame(Exception):
    """The scan met bytes that are not a valid record. Whether that is a torn tail or
    corruption is for the caller to decide; ``corruption()`` builds the report."""

    def __init__(self, path: str, position: int, length: int, reason: str) -> None:
        super().__init__(f"{path}@{position}: {reason}")
        self.path = path
        self.position = position  # byte position in the file
        self.length = length  # bytes affected
        self.reason = reason

    def corruption(self) -> CorruptionError:
        return CorruptionError(self.path, self.position, self.length, self.reason)


def scan_frames(
    fs: FileSystem, fd: int, path: str, base: int, position: int, limit: int
) -> Generator[Record, None, tuple[int, bool]]:
    """Records of the file ``fd`` from byte ``position`` up to byte ``limit``.

    Record offsets are ``base + position``. Returns (the position where the scan
    stopped, whether it stopped at END_OF_SEGMENT), which ``yield from`` hands to the
    caller; the marker itself is not yielded. Raises BadFrame at the first invalid frame,
    including one cut short by ``limit``.
    """
    unpack_from = HEADER.unpack_from
    # tuple.__new__ skips the Python-level NamedTuple constructor: this loop builds one
    # Record per record of every scan.
    new_record = tuple.__new__
    while position < limit:
        chunk = fs.pread(fd, min(READ_CHUNK, limit - position), position)
        view = memoryview(chunk)
        i, n = 0, len(chunk)
        while i + HEADER_SIZE <= n:
            length, crc, rtype = unpack_from(chunk, i)
            end = i + HEADER_SIZE + length
            if end > n:
                break
            if rtype == 0 or crc32c(view[i + HEADER_SIZE - 1 : end]) != crc:
                raise BadFrame(path, position + i, end - i, "crc mismatch")
            if rtype == TYPE_END_OF_SEGMENT:
                return position + end, True
            yield new_record(
                Record,
                (base + position + i, rtype, chunk[i + HEADER_SIZE : end], base + position + end),
            )
            i = end
        if i == 0:
            # The frame at ``position`` does not fit in the chunk: a record bigger than
            # READ_CHUNK, or one cut short by the end of what may be read.
            if n < HEADER_SIZE:
                raise BadFrame(path, position, limit - position, "partial record header")
            length, crc, rtype = unpack_from(chunk, 0)
            end = position + HEADER_SIZE + length
            if end > limit:
                raise BadFrame(
                    path, position, limit - position, f"record of {length} bytes runs past the end"
                )
            whole = fs.pread(fd, end - position, position)
            if rtype == 0 or crc32c(memoryview(whole)[HEADER_SIZE - 1 :]) != crc:
                raise BadFrame(path, position, end - position, "crc mismatch")
            if rtype == TYPE_END_OF_SEGMENT:
                return end, True
            yield Record(base + position, rtype, whole[HEADER_SIZE:], base + end)
            i = end - position
        position += i
    return position, False


def validate_frames(
    fs: FileSystem, fd: int, path: str, position: int, limit: int
) -> tuple[int, bool]:
    """Check every frame from ``position`` to ``limit`` without keeping the records.

    Returns what ``scan_frames`` returns; raises BadFrame at the first invalid frame.
    """
    frames = scan_frames(fs, fd, path, 0, position, limit)
    while True:
        try:
            next(frames)
        except StopIteration as done:
            return done.value


def count_frames(
    fs: FileSystem, fd: int, path: str, position: int, limit: int, rtype: int
) -> tuple[int, BadFrame | None]:
    """How many records of type ``rtype`` lie between ``position`` and ``limit``, found
    by hopping from header to header: no crc is checked and no payload copied, about a
    third of ``scan_frames``'s cost. Only for figures (a gauge), where bytes damaged
    after they were written cost a wrong count, never a wrong record: whoever reads
    the records themselves checks them. Returns (the count up to the first frame that
    cannot be walked, that frame's BadFrame or None when the walk reached ``limit``)."""
    unpack_from = HEADER.unpack_from
    count = 0
    while position < limit:
        chunk = fs.pread(fd, min(READ_CHUNK, limit - position), position)
        i, n = 0, len(chunk)
        while i + HEADER_SIZE <= n:
            length, _, frame_type = unpack_from(chunk, i)
            end = i + HEADER_SIZE + length
            if end > n:
                break
            if frame_type == 0:
                return count, BadFrame(path, position + i, end - i, "record of type 0")
            count += frame_type == rtype
            i = end
        if i == 0:  # a record bigger than READ_CHUNK, or one cut short by ``limit``
            if n < HEADER_SIZE:
                return count, BadFrame(path, position, limit - position, "partial record header")
            length, _, frame_type = unpack_from(chunk, 0)
            if position + HEADER_SIZE + length > limit:
                reason = f"record of {length} bytes runs past the end"
                return count, BadFrame(path, position, limit - position, reason)
            count += frame_type == rtype
            i = HEADER_SIZE + length
        position += i
    return count, None


FRAME_GUESS = 1024  # read_frame: bytes read with the header (most records fit)
SPAN_READ = 1 << 20  # read_frames: bytes of nearby records one pread may cover
SPAN_SLACK = 4096  # read_frames: bytes read past the last position, for its record


def read_frames(
    fs: FileSystem, fd: int, path: str, base: int, positions: Sequence[int], limit: int
) -> list[Record]:
    """The records at ``positions``, in that order, each exactly as ``read_frame`` gives
    it, with one pread per window of nearby positions (SPAN_READ bytes) instead of one
    or two per record: the sender reads the due records of a bucket this way, and they
    are mostly close together. A record that does not end inside its window's read is
    read alone by read_frame. Raises BadFrame as read_frame."""
    found: dict[int, Record] = {}
    ordered = sorted(set(positions))
    unpack_from = HEADER.unpack_from
    i, n = 0, len(ordered)
    while i < n:
        start = ordered[i]
        j = bisect_left(ordered, start + SPAN_READ, i + 1)
        size = min(ordered[j - 1] + SPAN_SLACK, limit) - start
        chunk = memoryview(fs.pread(fd, size, start) if size > HEADER_SIZE else b"")
        for position in ordered[i:j]:
            at = position - start
            if at + HEADER_SIZE <= len(chunk):
                length, crc, rtype = unpack_from(chunk, at)
                end = at + HEADER_SIZE + length
                if end <= len(chunk) and start + end <= limit:
                    framed = chunk[at + HEADER_SIZE - 1 : end]
                    found[position] = _checked(path, base, position, length, crc, rtype, framed)
                    continue
            found[position] = read_frame(fs, fd, path, base, position, limit)
        i = j
    return [found[position] for position in positions]


def read_frame(fs: FileSystem, fd: int, path: str, base: int, position: int, limit: int) -> Record:
    """The one record at byte ``position`` (not END_OF_SEGMENT). Raises BadFrame.

    One pread of up to FRAME_GUESS bytes brings the header and, for most records, the
    whole record; a longer one takes a second pread."""
    first = fs.pread(fd, max(HEADER_SIZE, min(FRAME_GUESS, limit - position)), position)
    if len(first) < HEADER_SIZE:
        raise BadFrame(path, position, len(first), "partial record header")
    length, crc, rtype = HEADER.unpack_from(first)
    if position + HEADER_SIZE + length > limit:
        raise BadFrame(path, position, limit - position, "record runs past the end")
    if HEADER_SIZE + length <= len(first):
        framed = memoryview(first)[HEADER_SIZE - 1 : HEADER_SIZE + length]
    else:
        framed = memoryview(fs.pread(fd, length + 1, position + HEADER_SIZE - 1))
    return _checked(path, base, position, length, crc, rtype, framed)


def _checked(
    path: str, base: int, position: int, length: int, crc: int, rtype: int, framed: memoryview
) -> Record:
    """The record at ``position`` whose header says ``length``, ``crc`` and ``rtype``,
    from ``framed``: its type byte and payload as read (short when the file is).
    Raises BadFrame."""
    if rtype == 0 or crc32c(framed) != crc:
        raise BadFrame(path, position, HEADER_SIZE + length, "no valid record at this offset")
    if rtype == TYPE_END_OF_SEGMENT:
        raise BadFrame(path, position, HEADER_SIZE, "an end-of-segment marker, not a record")
    return Record(base + position, rtype, bytes(framed[1:]), base + position + HEADER_SIZE + length)
