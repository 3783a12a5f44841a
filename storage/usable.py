"""What every open storage file object shares: closed is closed, and a failed write
poisons the object until it is reopened.

A write that fails half way (an fsync error, a full disk in the middle of a batch)
leaves the in-memory state ahead of the file, so the object refuses every later
operation instead of guessing (as PostgreSQL panics on an fsync failure rather than
retrying it); reopening runs recovery, which knows what is on disk.
"""

from __future__ import annotations

from typing import Self

from storage.errors import LogClosedError, StorageError


class Usable:
    """Mixin for storage objects: a context manager that closes, and the checks before
    use. The class sets ``_closed`` on close and ``_failed`` to the error that poisoned
    it, and says what it is in ``_label()`` ("log /data/x", "index file /data/y")."""

    _closed: bool = False
    _failed: BaseException | None = None

    def _label(self) -> str:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_open(self) -> None:
        """Raises LogClosedError after ``close``."""
        if self._closed:
            raise LogClosedError(f"{self._label()} is closed")

    def _check_usable(self) -> None:
        """Raises LogClosedError after ``close``, StorageError after a failed write."""
        self._check_open()
        if self._failed is not None:
            raise StorageError(
                f"{self._label()} failed earlier ({self._failed!r}); reopen it to recover"
            )
