"""Load cursors: how far schedule_log has been loaded into the wheel, and canAdd.

The wheel manager loads schedule_log buckets in increasing order of their start, each
shortly before it is due; meanwhile the replayer keeps appending records to buckets,
including the one being loaded and ones already loaded. Two cursors, as QMQ's
WheelLoadCursor pair in WheelTickManager, say who puts which record into the wheel:

    loading = (bucket_ms, end)     the bucket being loaded and the offset it is loaded
                                   up to: its file's length when loading began
    loaded  = (bucket_ms, offset)  records of that bucket below ``offset`` are in the
                                   wheel; a failed load resumes here

and canAdd (``LoadCursors.can_add``) sends every record the loader will not read
straight into the wheel. Stricter than QMQ in three ways:

* A bucket's ``end`` is fixed when loading begins. QMQ's loadingCursor.shiftCursor
  accepts the same bucket again with a larger offset, so a retried load re-reads
  records that canAdd had already put into the wheel — a duplicate.
* ``loaded`` never leaves ``loading``'s bucket, and a bucket is begun only after the
  previous one is complete, so "below the loading bucket" means "fully in the wheel".
* Misuse raises instead of logging and carrying on.

Pure logic, no I/O: the manager reads files and sizes and calls these methods.
docs/wheel.md works an example through.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

NO_BUCKET = -1  # the loading bucket before anything was loaded; below every bucket
MAX_BUCKET_MS = 2**63 - 1  # the limits of the checkpoint fields
MAX_OFFSET = 2**64 - 1
VERSION = 1
FORMAT = struct.Struct("<BqQQ")  # 1 + 8 + 8 + 8: version, bucket_ms, loading end, loaded
assert FORMAT.size == 1 + 8 + 8 + 8


class Cursor(NamedTuple):
    """A position in schedule_log: a bucket (its start, epoch ms) and a byte offset in
    that bucket's file."""

    bucket_ms: int
    offset: int


class LoadCursors:
    """The loading and loaded cursors of the wheel manager; see the module docstring.

    Start with ``LoadCursors()`` (nothing loaded, every record left to the loader) or
    restore one with ``from_bytes``. Raises ValueError for a bucket outside
    NO_BUCKET..MAX_BUCKET_MS, offsets outside 0..MAX_OFFSET, or ``loaded_offset >
    loading_offset``.
    """

    __slots__ = ("_bucket_ms", "_end", "_loaded")

    def __init__(
        self, bucket_ms: int = NO_BUCKET, loading_offset: int = 0, loaded_offset: int = 0
    ) -> None:
        if not (
            NO_BUCKET <= bucket_ms <= MAX_BUCKET_MS
            and 0 <= loaded_offset <= loading_offset <= MAX_OFFSET
        ):
            raise ValueError(
                f"bad cursors: bucket {bucket_ms}, loading up to {loading_offset}, "
                f"loaded up to {loaded_offset}"
            )
        self._bucket_ms = bucket_ms
        self._end = loading_offset
        self._loaded = loaded_offset

    @property
    def loading(self) -> Cursor:
        """The bucket being loaded (or last loaded) and the offset it is loaded up to."""
        return Cursor(self._bucket_ms, self._end)

    @property
    def loaded(self) -> Cursor:
        """The same bucket and the offset below which its records are in the wheel."""
        return Cursor(self._bucket_ms, self._loaded)

    @property
    def complete(self) -> bool:
        """Whether the loading bucket is entirely in the wheel (loaded == loading)."""
        return self._loaded == self._end

    def can_add(self, bucket_ms: int, offset: int) -> bool:
        """Whether the record just appended at ``offset`` of bucket ``bucket_ms`` goes
        straight into the wheel (True) or is left for the loader (False).

        True exactly when ``bucket_ms < loading.bucket_ms``, or ``bucket_ms ==
        loading.bucket_ms and offset >= loading.offset`` — QMQ's
        WheelTickManager.canAdd. Every record then reaches the wheel exactly once,
        provided the callers keep two rules:

        1. The replayer asks can_add about a record before the loader can take another
           step, i.e. with no checkpoint between the append and the question
           (delayd.replay.Replayer calls its hook right after append_batch). A question
           asked late, after the loader has moved past the bucket, would answer True
           for a record the loader has already read.
        2. The loader begins every bucket that has a file, in increasing order, passing
           the file's length at that moment (see ``begin``). A bucket it jumps over
           must have no file at the moment of the jump; records appended to it later
           are below the loading bucket, so they go straight in.
        """
        return bucket_ms < self._bucket_ms or (bucket_ms == self._bucket_ms and offset >= self._end)

    def begin(self, bucket_ms: int, end_offset: int) -> int:
        """Start (or resume) loading bucket ``bucket_ms`` whose file is ``end_offset``
        bytes long now (0 when it has no file); returns the offset to read from.

        The loader reads the records in ``[returned offset, loading.offset)``, adds them
        to the wheel and calls ``advance`` after each; records appended from now on are
        at or past ``end_offset`` and reach the wheel through can_add.

        A new bucket (above the loading one) needs the loading one complete; the jump
        also settles every bucket in between as a gap (rule 2 of can_add). Beginning
        the loading bucket again resumes a failed load at ``loaded.offset``; its end
        stays the one fixed when it began, since the records past it went in through
        can_add. Raises ValueError for a bucket below the loading one, a new bucket
        while the loading one is incomplete, a bucket or ``end_offset`` out of range,
        or, on resume, an ``end_offset`` below the fixed end (the file shrank).
        """
        if not (0 <= end_offset <= MAX_OFFSET and bucket_ms <= MAX_BUCKET_MS):
            raise ValueError(f"bucket {bucket_ms} or end_offset {end_offset} out of range")
        if bucket_ms == self._bucket_ms:
            if end_offset < self._end:
                raise ValueError(
                    f"bucket {bucket_ms} is {end_offset} bytes long, but loading began "
                    f"when it was {self._end}: a bucket file never shrinks"
                )
            return self._loaded
        if bucket_ms < self._bucket_ms:
            raise ValueError(
                f"bucket {bucket_ms} is below the loading bucket {self._bucket_ms}: "
                "buckets are loaded in increasing order"
            )
        if not self.complete:
            raise ValueError(
                f"bucket {self._bucket_ms} is loaded only up to {self._loaded} of "
                f"{self._end}; resume it before beginning bucket {bucket_ms}"
            )
        self._bucket_ms = bucket_ms
        self._end = end_offset
        self._loaded = 0
        return 0

    def advance(self, offset: int) -> None:
        """Every record of the loading bucket below ``offset`` (the end of the last
        record added) is now in the wheel.

        Raises ValueError unless ``loaded.offset <= offset <= loading.offset``.
        """
        if not self._loaded <= offset <= self._end:
            raise ValueError(
                f"loaded offset of bucket {self._bucket_ms} must stay within "
                f"{self._loaded}..{self._end}, got {offset}"
            )
        self._loaded = offset

    def finish(self) -> None:
        """Declare the reader done with the loading bucket.

        Raises ValueError when the loaded offset is short of the loading one: the reader
        stopped early (a short read, or a file cut behind the loader's back), and moving
        on would lose the records in between.
        """
        if not self.complete:
            raise ValueError(
                f"bucket {self._bucket_ms} was read up to {self._loaded} but loading "
                f"goes up to {self._end}: {self._end - self._loaded} bytes not loaded"
            )

    # ------------------------------------------------------------------ checkpoint

    def to_bytes(self) -> bytes:
        """The cursors as 25 bytes (``FORMAT``), for a checkpoint file."""
        return FORMAT.pack(VERSION, self._bucket_ms, self._end, self._loaded)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> LoadCursors:
        """The cursors ``to_bytes`` wrote. Raises ValueError for a wrong length, an
        unknown version, or values no cursors can have."""
        if len(data) != FORMAT.size:
            raise ValueError(f"load cursors are {FORMAT.size} bytes, got {len(data)}")
        version, bucket_ms, end, loaded = FORMAT.unpack(data)
        if version != VERSION:
            raise ValueError(f"load cursors version {version} is not {VERSION}")
        return cls(bucket_ms, end, loaded)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LoadCursors):
            return NotImplemented
        return self.loading == other.loading and self.loaded == other.loaded

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"LoadCursors(loading={tuple(self.loading)}, loaded={tuple(self.loaded)})"
