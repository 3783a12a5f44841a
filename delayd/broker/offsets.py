"""Committed consumer offsets per (group, subject, queue), kept in ``offsets.json``.

An offset is the next queue offset the group will read: everything before it is
consumed. Commits change memory at once; ``save()`` writes the whole table when it
changed — the broker calls it every ``checkpoint_interval_ms`` and at shutdown, so a
``kill -9`` forgets at most that interval of commits and those messages are delivered
again (at-least-once; RocketMQ's ConsumerOffsetManager persists every 5 s the same way).
A durable COMMIT_OFFSET (the consumers' ``commit="sync"``) does not wait for that: the
broker writes the table at once and answers after ``saved_version`` covers the commit.

The file is replaced atomically: written to ``offsets.json.tmp``, fsynced, renamed over
``offsets.json``, directory fsynced. A reader sees the old table or the new, never a mix::

    {"version": 1, "offsets": {"<group>": {"<subject>": {"<queue>": <offset>}}}}
"""

from __future__ import annotations

import json
import os
import threading

from storage.errors import CorruptionError, is_disk_full
from storage.fs import O_WRITE, REAL_FS, FileSystem, disk_full_error

FILE_NAME = "offsets.json"
VERSION = 1

OffsetKey = tuple[str, str, int]  # (group, subject, queue)


class OffsetStore:
    """The committed offsets; see the module docstring. Use :meth:`open`."""

    def __init__(self, path: str, fs: FileSystem) -> None:
        self.path = path
        self.fs = fs
        self._offsets: dict[OffsetKey, int] = {}
        self._version = 0  # bumped by every change
        self._saved_version = 0
        self._save_lock = threading.Lock()

    @classmethod
    def open(cls, directory: str, *, fs: FileSystem = REAL_FS) -> OffsetStore:
        """Load ``<directory>/offsets.json`` (none yet: empty).

        Raises CorruptionError when the file is not the JSON this module writes.
        """
        store = cls(os.path.join(directory, FILE_NAME), fs)
        if fs.exists(store.path):
            fd = fs.open(store.path, os.O_RDONLY)
            try:
                raw = fs.pread(fd, fs.fsize(fd), 0)
            finally:
                fs.close(fd)
            store._offsets = _parse(store.path, raw)
        return store

    def get(self, group: str, subject: str, queue: int) -> int | None:
        return self._offsets.get((group, subject, queue))

    def set(self, group: str, subject: str, queue: int, offset: int) -> None:
        key = (group, subject, queue)
        if self._offsets.get(key) != offset:
            self._offsets[key] = offset
            self._version += 1

    def items(self) -> list[tuple[OffsetKey, int]]:
        return list(self._offsets.items())

    @property
    def dirty(self) -> bool:
        return self._version != self._saved_version

    @property
    def version(self) -> int:
        """Bumped by every change: a table of this version or later holds them all."""
        return self._version

    @property
    def saved_version(self) -> int:
        """The version last written, fsynced and renamed into place."""
        return self._saved_version

    def snapshot(self) -> tuple[int, bytes]:
        """(version, file contents) of the table now; pass both to :meth:`write`."""
        nested: dict[str, dict[str, dict[str, int]]] = {}
        for (group, subject, queue), offset in sorted(self._offsets.items()):
            nested.setdefault(group, {}).setdefault(subject, {})[str(queue)] = offset
        data = json.dumps({"version": VERSION, "offsets": nested}, indent=1, sort_keys=True)
        return self._version, data.encode()

    def write(self, version: int, data: bytes) -> None:
        """Replace the file with a snapshot (blocking: run it in a worker thread)."""
        with self._save_lock:
            if version <= self._saved_version:
                return
            temp = self.path + ".tmp"
            fd = self.fs.open(temp, O_WRITE)
            try:
                self.fs.ftruncate(fd, 0)
                try:
                    self.fs.pwrite(fd, data, 0)
                except OSError as exc:
                    if not is_disk_full(exc):
                        raise
                    # The previous file stands; the next checkpoint writes again.
                    self.fs.ftruncate(fd, 0)
                    raise disk_full_error(self.fs, temp, exc) from None
                self.fs.fsync(fd)
            finally:
                self.fs.close(fd)
            self.fs.replace(temp, self.path)
            self.fs.fsync_dir(os.path.dirname(self.path) or ".")
            self._saved_version = version


def _parse(path: str, raw: bytes) -> dict[OffsetKey, int]:
    try:
        doc = json.loads(raw)
        if doc.get("version") != VERSION:
            raise ValueError(f"version {doc.get('version')!r}, expected {VERSION}")
        offsets: dict[OffsetKey, int] = {}
        for group, subjects in doc["offsets"].items():
            for subject, queues in subjects.items():
                for queue, offset in queues.items():
                    if not isinstance(offset, int) or offset < 0:
                        raise ValueError(f"offset {offset!r} of {group}/{subject}/{queue}")
                    offsets[(group, subject, int(queue))] = offset
        return offsets
    except (ValueError, KeyError, AttributeError, TypeError) as exc:
        raise CorruptionError(path, 0, len(raw), f"not a delayd offsets file: {exc}") from None
