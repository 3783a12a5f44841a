"""Framed records as raw bytes: what replication copies from one log to another.

A chunk of a log's bytes is shipped as it lies on disk (headers, CRCs, payloads, and a
segmented log's END_OF_SEGMENT markers), so a copy is byte-identical at identical
offsets. ``walk_frames`` (pure) finds the whole frames at the start of a chunk and
checks each CRC: a reader uses it to end a chunk on a record boundary, a writer to
refuse bytes it cannot prove intact before writing any of them. The file-level helpers
below serve SegmentedLog and RecordFile alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from storage.errors import RawAppendRefused
from storage.framing import HEADER, HEADER_SIZE, TYPE_END_OF_SEGMENT, crc32c
from storage.fs import FileSystem
from storage.scan import BadFrame, count_frames


@dataclass(frozen=True, slots=True)
class FrameWalk:
    """The whole frames at the start of a chunk.

    ``complete`` is the length of the prefix made of whole frames; ``ends`` the end of
    each of those frames (positions in the chunk, ascending); ``segment_ends`` the ends
    of the END_OF_SEGMENT markers among them."""

    complete: int
    ends: list[int]
    segment_ends: list[int]


def walk_frames(data: bytes | bytearray | memoryview, path: str, position: int) -> FrameWalk:
    """Walk the frames of ``data`` (bytes of ``path`` from byte ``position``, named in
    errors) up to the first one that is cut short by the end of ``data``.

    Raises BadFrame at the first frame with a bad CRC or the invalid type 0.
    """
    view = memoryview(data)
    unpack_from = HEADER.unpack_from
    ends: list[int] = []
    segment_ends: list[int] = []
    i, n = 0, len(view)
    while i + HEADER_SIZE <= n:
        length, crc, rtype = unpack_from(view, i)
        end = i + HEADER_SIZE + length
        if end > n:
            break
        if rtype == 0 or crc32c(view[i + HEADER_SIZE - 1 : end]) != crc:
            raise BadFrame(path, position + i, end - i, "crc mismatch")
        ends.append(end)
        if rtype == TYPE_END_OF_SEGMENT:
            segment_ends.append(end)
        i = end
    return FrameWalk(i, ends, segment_ends)


def frame_length(data: bytes | bytearray | memoryview) -> int | None:
    """The whole length of the frame ``data`` starts with, from its header, or None when
    ``data`` is shorter than a header."""
    if len(data) < HEADER_SIZE:
        return None
    length, _, _ = HEADER.unpack_from(data, 0)
    return HEADER_SIZE + length


def check_whole_frames(data: bytes | bytearray | memoryview, path: str, position: int) -> FrameWalk:
    """Walk ``data`` as bytes to append at ``position`` of ``path``: every frame whole,
    every CRC right. Raises BadFrame otherwise (nothing is written by the caller)."""
    walk = walk_frames(data, path, position)
    if walk.complete != len(data):
        raise BadFrame(
            path,
            position + walk.complete,
            len(data) - walk.complete,
            "the bytes to append end with a partial record",
        )
    return walk


def check_append(data: bytes, name: str, offset: int, end: int) -> FrameWalk:
    """Walk ``data``, bytes to append at ``offset`` to the store ``name`` that ends at
    ``end``. Raises RawAppendRefused unless ``offset`` is ``end`` and ``data`` is whole
    frames with right CRCs."""
    if offset != end:
        raise RawAppendRefused(
            f"{name}: raw bytes for offset {offset} but it ends at {end}; truncate or "
            "fetch from the end"
        )
    try:
        return check_whole_frames(data, name, offset)
    except BadFrame as bad:
        raise RawAppendRefused(f"{name}: refused raw bytes: {bad}") from None


def pieces(walk: FrameWalk, max_bytes: int) -> list[int]:
    """Where to split a walked chunk into writes: after every END_OF_SEGMENT marker and
    so that no piece exceeds ``max_bytes`` (a writer's unsynced window) unless one
    frame alone does. The stops, ascending, the last one ``walk.complete``."""
    stops: list[int] = []
    start = previous = 0
    segment_ends = set(walk.segment_ends)
    for end in walk.ends:
        if end - start > max_bytes and previous > start:
            stops.append(previous)
            start = previous
        if end in segment_ends:
            stops.append(end)
            start = end
        previous = end
    if not stops or stops[-1] != walk.complete:
        stops.append(walk.complete)
    return stops


def whole_frames(
    fs: FileSystem, fd: int, path: str, position: int, limit: int, data: bytes
) -> bytes:
    """The whole, CRC-checked frames at the start of ``data``, which was read from
    ``fd`` at ``position`` (``limit`` is where the file's records end); when the first
    frame is longer than ``data``, that frame alone, read whole. Raises
    CorruptionError when the bytes at ``position`` are not a valid frame."""
    try:
        walk = walk_frames(data, path, position)
        if walk.complete:
            return data[: walk.complete]
        length = frame_length(data)
        if length is None or position + length > limit:
            raise BadFrame(path, position, limit - position, "record runs past the end")
        whole = fs.pread(fd, length, position)
        check_whole_frames(whole, path, position)
        return whole
    except BadFrame as bad:
        raise bad.corruption() from None


def check_boundary(fs: FileSystem, fd: int, path: str, position: int, start: int = 0) -> None:
    """Raise ValueError unless a record starts at byte ``position`` of ``fd``, hopping
    from header to header from ``start``, a record boundary at or below it."""
    _, bad = count_frames(fs, fd, path, start, position, TYPE_END_OF_SEGMENT)
    if bad is not None:
        raise ValueError(f"{path}: byte {position} is not a record boundary ({bad.reason})")
