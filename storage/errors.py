"""Errors raised by storage/. The delayd error tree re-parents these (STYLE.md #9)."""

from __future__ import annotations


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
