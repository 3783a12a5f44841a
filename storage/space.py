"""FreeSpaceGuard: refuse appends before the disk is full, keeping a reserve.

A log that writes until ENOSPC leaves nothing for the writers that must follow it: the
delay server's replay copies every accepted message into schedule_log, delivery writes
the broker's commitlog and dispatch_log entries, checkpoints are rewritten. So intake
stops at a reserve (``min_free_bytes``) and those go on into it; the hard ENOSPC path
(storage/segmented_log.py, "When a write fails") still holds for whatever gets there.
RocketMQ does the same with its disk usage ratios (diskMaxUsedSpaceRatio).

Asking the file system costs a statvfs; the guard asks only every ``recheck_bytes``
appended, or on every append once its estimate comes within that of the reserve, so a
busy log pays one call per MiB, not one per batch. Other writers on the same file
system make the estimate optimistic by what they wrote since the last call: the
reserve is a margin, not a promise, and ENOSPC remains an answer.
"""

from __future__ import annotations

import errno

from storage.errors import DiskFullError
from storage.fs import FileSystem

DEFAULT_RECHECK_BYTES = 1 << 20


class FreeSpaceGuard:
    """``check(size)`` before appending ``size`` bytes under ``directory``: raises
    DiskFullError when fewer than ``min_free_bytes`` would be left. Not thread-safe
    (one appender)."""

    def __init__(
        self,
        fs: FileSystem,
        directory: str,
        min_free_bytes: int,
        *,
        recheck_bytes: int = DEFAULT_RECHECK_BYTES,
    ) -> None:
        self.fs = fs
        self.directory = directory
        self.min_free_bytes = min_free_bytes
        self.recheck_bytes = recheck_bytes
        self._free: int | None = None  # as the file system last said
        self._since = 0  # bytes appended since it said so

    def check(self, size: int) -> None:
        """Raises DiskFullError (naming the directory, its free bytes and the reserve)
        when appending ``size`` bytes would leave less than the reserve free."""
        if self._stale(size):
            self._free = self.fs.free_bytes(self.directory)
            self._since = 0
        assert self._free is not None
        if self._free - self._since - size < self.min_free_bytes:
            reason = f"{size} more bytes would leave less than the reserve of {self.min_free_bytes}"
            raise DiskFullError(self.directory + "/", self._free, OSError(errno.ENOSPC, reason))
        self._since += size

    def _stale(self, size: int) -> bool:
        if self._free is None or self._since >= self.recheck_bytes:
            return True
        return self._free - self._since - size < self.min_free_bytes + self.recheck_bytes
