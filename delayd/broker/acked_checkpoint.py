"""The commitlog offset a broker member last knew its group acknowledged, kept on disk
(Kafka's high-watermark checkpoint).

A member promoted right after a restart has copied nothing since it started, so no
leader told it what the group acknowledged; without this file it could only start its
high watermark at the commitlog it holds, which may end in records no other member has
— consumers would see a record a later leader may not hold. The file may lag behind the
truth (it is written at most once per ``interval_s``): a lower start only hides records
until the new leader's in-sync followers have them, never shows too much.

``<data>/broker/replication/acked``: a storage checkpoint (temp, fsync, rename) holding
``offset:u64`` little-endian.
"""

from __future__ import annotations

import os
import struct

import trio

from storage.checkpoint import read_checkpoint, write_checkpoint
from storage.errors import CorruptionError
from storage.fs import REAL_FS, FileSystem, create_dirs_durably

OFFSET = struct.Struct("<Q")
INTERVAL_S = 1.0


def acked_checkpoint_path(broker_directory: str) -> str:
    """Where the broker under ``broker_directory`` (``<data>/broker``) keeps it."""
    return os.path.join(broker_directory, "replication", "acked")


class AckedCheckpoint:
    """See the module docstring."""

    def __init__(self, path: str, *, fs: FileSystem = REAL_FS, interval_s: float = INTERVAL_S):
        self.path = path
        self.fs = fs
        self.interval_s = interval_s
        self._saved = self.read()
        self._saved_at = -float("inf")

    def read(self) -> int | None:
        """The offset last saved; None when none was. Raises CorruptionError for a file
        that is not what ``save`` writes."""
        data = read_checkpoint(self.fs, self.path)
        if data is None:
            return None
        if len(data) != OFFSET.size:
            raise CorruptionError(
                f"{self.path}: {len(data)} bytes where an acknowledged offset takes "
                f"{OFFSET.size}; remove the file (the member then starts its high "
                "watermark at its commitlog's end)"
            )
        return OFFSET.unpack(data)[0]

    async def save(self, offset: int) -> None:
        """Keep ``offset`` (the group acknowledged the commitlog up to it) if it is past
        the one saved and ``interval_s`` passed since the last save; in a worker thread
        (an fsync)."""
        now = trio.current_time()
        if (self._saved is not None and offset <= self._saved) or (
            now - self._saved_at < self.interval_s
        ):
            return
        self._saved_at = now
        await trio.to_thread.run_sync(self._write, offset)
        self._saved = offset

    def _write(self, offset: int) -> None:
        create_dirs_durably(self.fs, os.path.dirname(self.path))
        write_checkpoint(self.fs, self.path, OFFSET.pack(offset))
