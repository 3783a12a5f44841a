"""Errors raised by storage/, rooted at StorageError.

delayd.errors re-exports StorageError and CorruptionError but does not re-parent them
under DelaydError: storage/ knows nothing of delayd (DESIGN.md, "Layers"), so nothing
here can derive from a delayd class. Code that wants "anything delayd can raise"
catches ``(DelaydError, StorageError)``.
"""

from __future__ import annotations

import errno
import os

# What a write that found no room fails with: no space left, or the user's quota spent.
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is a write refused for lack of space or quota (ENOSPC, EDQUOT)."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS


class StorageError(Exception):
    """Something is wrong with the on-disk store."""


class CorruptionError(StorageError):
    """Bytes that were once written correctly no longer read back correctly.

    Never raised for a torn tail (an interrupted last write), only for damage that a
    crash cannot explain; the store never skips or truncates such bytes by itself.
    """

    def __init__(self, path: str, offset: int, length: int, reason: str) -> None:
        self.path = path
        self.offset = offset  # byte position inside the file
        self.length = length  # bytes affected, from offset to the end of what is unreadable
        self.reason = reason
        super().__init__(
            f"{path}: corrupt record at byte {offset} ({length} bytes affected): {reason}. "
            "The store refuses to skip or truncate it; restore the file from a replica or "
            "backup, or inspect it with `delayd inspect`."
        )


class RecordTooLargeError(StorageError):
    """A record cannot fit in a segment of the configured size."""


class LogClosedError(StorageError):
    """The log was used after close()."""


class DiskFullError(StorageError):
    """A write found no space (ENOSPC) or quota (EDQUOT) left on its file system.

    Nothing of the refused write is kept: the file is cut back to its last good end, so
    no torn record sits in the middle of a log that later appends follow, and the same
    object takes appends again once space returns. ``free_bytes`` is what the file
    system reported just after the failure (None when it could not be asked).
    """

    def __init__(self, path: str, free_bytes: int | None, cause: OSError) -> None:
        self.path = path
        self.directory = os.path.dirname(path) or "."
        self.free_bytes = free_bytes
        self.errno = cause.errno
        free = "unknown" if free_bytes is None else f"{free_bytes}"
        name = errno.errorcode.get(cause.errno or 0, str(cause.errno))
        super().__init__(
            f"disk full: cannot write {path} ({name}: {cause.strerror}); {free} bytes free "
            f"in {self.directory}. Nothing was stored; free space or grow the volume, and "
            "writes resume by themselves"
        )


class FsyncError(StorageError):
    """An fsync (or fdatasync) failed.

    After a failed fsync the kernel may have dropped the dirty pages it could not write
    and marked them clean (PostgreSQL's "fsyncgate", 2018): a second fsync would report
    success for data that is not on disk. So the file is never synced again: the store
    that raised this refuses every further use, and the process must stop acknowledging
    and recover from what is really on disk (restart: recovery re-reads the files).
    """

    def __init__(self, path: str, cause: BaseException) -> None:
        self.path = path
        super().__init__(
            f"fsync of {path} failed ({cause!r}): what the page cache held can no longer "
            "be trusted to be on disk, so this store stops; restart the process to "
            "recover from the files (never retry the fsync)"
        )


class RawAppendRefused(StorageError):
    """Raw framed bytes (a replica's copy) were refused before anything was written:
    they were meant for another offset than the log's end, or a frame in them is cut
    short or fails its CRC. The log is unchanged."""
