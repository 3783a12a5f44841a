"""What the replayer persists: the data directory's segment_scale, and its checkpoint.

Both are storage checkpoint files (atomic: temp file, fsync, rename, fsync dir) under
``<data>/delay/checkpoint/``; docs/delay-formats.md has their grammar.

``meta``   — JSON ``{"format": 1, "segment_scale_minutes": N}``, written once when the
             data directory is first used. segment_scale decides which schedule_log file
             a message lives in, so a later start with another value is refused (QMQ
             documents "never change it" but does not check).
``replay`` — the replayer's position in message_log and what recovery needs::

    replay     := version:u8 position:u64 next_sequence:u64 count:u32 bucket{count}
    bucket     := start_ms:i64 size:u64

             ``position``: every message_log record below it is durably in schedule_log.
             ``next_sequence``: the sequence after the last record below ``position``.
             ``bucket``: the length of each bucket file open when it was written — all
             durable then; recovery cuts a bucket back to it without scanning the file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

from delayd.errors import DelaydError
from delayd.logs import layout
from delayd.logs.buckets import check_segment_scale
from storage.checkpoint import read_checkpoint, write_checkpoint
from storage.errors import CorruptionError
from storage.fs import FileSystem, create_dirs_durably

META_FORMAT = 1
REPLAY_FORMAT = 1
REPLAY_HEAD = struct.Struct("<BQQI")
assert REPLAY_HEAD.size == 1 + 8 + 8 + 4
REPLAY_BUCKET = struct.Struct("<qQ")
assert REPLAY_BUCKET.size == 8 + 8
FIRST_SEQUENCE = 1  # sequences start at 1; 0 means "none yet"


class SegmentScaleMismatchError(DelaydError):
    """The data directory was made with another segment_scale than the one requested."""

    def __init__(self, data_dir: str, stored: int, requested: int) -> None:
        self.stored = stored
        self.requested = requested
        super().__init__(
            f"{data_dir} was created with segment_scale = {stored} minute(s), but this start "
            f"asks for segment_scale = {requested}. segment_scale decides which "
            f"schedule_log bucket file every scheduled message is in, so the buckets already "
            f"written would no longer be found. Start with segment_scale = {stored}, or use "
            f"a new data directory for {requested}."
        )


@dataclass(frozen=True, slots=True)
class ReplayCheckpoint:
    """The replayer's durable state; see the module docstring."""

    position: int = 0  # message_log offset
    next_sequence: int = FIRST_SEQUENCE
    bucket_sizes: dict[int, int] = field(default_factory=dict)  # bucket start ms -> bytes


def encode_replay_checkpoint(checkpoint: ReplayCheckpoint) -> bytes:
    parts = [
        REPLAY_HEAD.pack(
            REPLAY_FORMAT,
            checkpoint.position,
            checkpoint.next_sequence,
            len(checkpoint.bucket_sizes),
        )
    ]
    parts.extend(REPLAY_BUCKET.pack(s, n) for s, n in sorted(checkpoint.bucket_sizes.items()))
    return b"".join(parts)


def decode_replay_checkpoint(data: bytes, path: str) -> ReplayCheckpoint:
    """Raises CorruptionError when ``data`` is not a replay checkpoint of this format."""
    if len(data) < REPLAY_HEAD.size:
        raise CorruptionError(path, 0, len(data), "replay checkpoint shorter than its head")
    version, position, next_sequence, count = REPLAY_HEAD.unpack_from(data)
    if version != REPLAY_FORMAT:
        raise CorruptionError(
            path, 0, len(data), f"replay checkpoint format {version}, this version reads 1"
        )
    if len(data) != REPLAY_HEAD.size + count * REPLAY_BUCKET.size:
        raise CorruptionError(path, 0, len(data), f"replay checkpoint length wrong for {count}")
    sizes = dict(
        REPLAY_BUCKET.unpack_from(data, REPLAY_HEAD.size + i * REPLAY_BUCKET.size)
        for i in range(count)
    )
    return ReplayCheckpoint(position, next_sequence, sizes)


def read_replay_checkpoint(fs: FileSystem, data_dir: str) -> ReplayCheckpoint:
    """The stored checkpoint, or the initial one when there is none."""
    path = layout.replay_checkpoint_path(data_dir)
    data = read_checkpoint(fs, path)
    return ReplayCheckpoint() if data is None else decode_replay_checkpoint(data, path)


def write_replay_checkpoint(fs: FileSystem, data_dir: str, checkpoint: ReplayCheckpoint) -> None:
    """Replace the stored checkpoint; durable when this returns."""
    path = layout.replay_checkpoint_path(data_dir)
    write_checkpoint(fs, path, encode_replay_checkpoint(checkpoint))


def read_segment_scale(fs: FileSystem, data_dir: str) -> int | None:
    """The segment_scale (minutes) stored with the data, or None when there is none yet.
    Raises CorruptionError when the meta file is unreadable."""
    path = layout.meta_checkpoint_path(data_dir)
    data = read_checkpoint(fs, path)
    if data is None:
        return None
    try:
        meta = json.loads(data)
        stored = meta["segment_scale_minutes"]
        if meta["format"] != META_FORMAT:
            raise ValueError(f"format {meta['format']}, this version reads {META_FORMAT}")
        check_segment_scale(stored)
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptionError(path, 0, len(data), f"meta checkpoint unreadable: {exc}") from None
    return stored


def ensure_segment_scale(fs: FileSystem, data_dir: str, segment_scale: int) -> int:
    """Check ``segment_scale`` (minutes) against the one stored with the data, storing
    it when the data directory is new. Returns it.

    Raises ValueError for a scale outside 1..60, SegmentScaleMismatchError when the data
    was made with another one, CorruptionError when the meta file is unreadable or
    missing although schedule_log or a replay checkpoint exists.
    """
    check_segment_scale(segment_scale)
    path = layout.meta_checkpoint_path(data_dir)
    create_dirs_durably(fs, layout.checkpoint_dir(data_dir))
    stored = read_segment_scale(fs, data_dir)
    if stored is None:
        _refuse_data_without_meta(fs, data_dir, path)
        meta = {"format": META_FORMAT, "segment_scale_minutes": segment_scale}
        write_checkpoint(fs, path, json.dumps(meta, sort_keys=True).encode())
        return segment_scale
    if stored != segment_scale:
        raise SegmentScaleMismatchError(data_dir, stored, segment_scale)
    return segment_scale


def _refuse_data_without_meta(fs: FileSystem, data_dir: str, path: str) -> None:
    schedule_dir = layout.schedule_log_dir(data_dir)
    has_buckets = fs.exists(schedule_dir) and bool(fs.listdir(schedule_dir))
    if has_buckets or fs.exists(layout.replay_checkpoint_path(data_dir)):
        raise CorruptionError(
            path,
            0,
            0,
            "the meta checkpoint is missing but schedule_log data exists, so the "
            "segment_scale it was written with is unknown",
        )
