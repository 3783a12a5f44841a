"""What every store of storage/ does once it is closed or a write failed: refuse to be
used, saying which store and why (StorageError, LogClosedError), and close as a context
manager. A store that saw a failed fsync must not be synced again (storage/errors.py,
FsyncError), so after ``_failed`` is set only a reopen — recovery from what is really on
disk — goes on.
"""

from __future__ import annotations

from typing import Self

from storage.errors import LogClosedError, StorageError


class Store:
    """Base of SegmentedLog, RecordFile, ConsumeQueue and IndexFile. A subclass sets
    ``_failed`` to the error that poisoned it, names itself in ``described`` and releases
    its files in ``_release_files`` (or overrides ``close`` altogether)."""

    _closed: bool = False
    _failed: BaseException | None = None

    @property
    def described(self) -> str:
        """The store as an error message names it ("log /data/delay/message_log")."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush (unless an earlier write failed) and release every file, even when the
        flush raises; closing again does nothing."""
        if self._closed:
            return
        try:
            if self._failed is None:
                self._flush_before_close()
        finally:
            self._closed = True
            self._release_files()

    def _flush_before_close(self) -> None:
        self.flush()

    def _release_files(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        """Raises LogClosedError after close()."""
        if self._closed:
            raise LogClosedError(f"{self.described} is closed")

    def _check_usable(self) -> None:
        """Raises LogClosedError after close(), StorageError after a failed write."""
        self._check_open()
        if self._failed is not None:
            raise StorageError(
                f"{self.described} failed earlier ({self._failed!r}); reopen it to recover"
            )
