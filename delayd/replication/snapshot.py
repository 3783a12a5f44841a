"""Snapshots: a set of files shipped whole from the leader to a follower that lacks
records retention deleted (docs/replication.md, "Resync from a snapshot").

What the files are is the server's (a delay member ships its derived state as of its
replay checkpoint: delayd.server.snapshot); replication moves them and makes their
arrival all or nothing:

* the leader's ``SnapshotSource.take()`` (blocking: a worker thread) names the files, a
  frozen copy of each (the delay server hard-links them), their sizes, and ``meta``,
  what the installer needs besides them; ``release()`` drops the copy once it is sent;
* the follower's ``SnapshotReceiver`` writes file ``i`` of the manifest to
  ``<directory>/<i>.part`` as its chunks arrive, in order; ``finish()`` checks that
  every file is whole, fsyncs and renames each to ``<directory>/<i>``, and last writes
  ``<directory>/MANIFEST`` (storage checkpoint file: temp, fsync, rename, fsync dir).
  MANIFEST is the commit point: a directory without it is a snapshot cut short, which
  ``discard_partial`` removes; one with it is whole and durable (``read_manifest``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from delayd.errors import DelaydError
from storage.checkpoint import read_checkpoint, write_checkpoint
from storage.fs import O_WRITE, REAL_FS, FileSystem, create_dirs_durably, empty_directory_durably

MANIFEST = "MANIFEST"
MANIFEST_FORMAT = 1
PART_SUFFIX = ".part"


class SnapshotError(DelaydError):
    """A snapshot that is not what the leader described (a file cut short, a chunk out
    of place, a name that would leave the directory)."""


@dataclass(frozen=True, slots=True)
class SnapshotFile:
    name: str  # where the installer puts it, relative to its root (``schedule_log/...``)
    size: int  # bytes shipped: the file's first ``size`` bytes
    path: str = ""  # the leader's frozen copy it is read from


@dataclass
class Snapshot:
    """What a leader ships: ``files`` in order, ``meta`` for the installer."""

    files: list[SnapshotFile]
    meta: dict = field(default_factory=dict)
    release: Callable[[], None] = lambda: None  # drops the leader's frozen copy

    def manifest(self) -> dict:
        return {
            "format": MANIFEST_FORMAT,
            "files": [{"name": f.name, "size": f.size} for f in self.files],
            "meta": self.meta,
        }

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


class SnapshotSource(Protocol):
    def take(self) -> Snapshot:
        """A consistent snapshot now (blocking; run in a worker thread)."""
        ...


def read_chunk(path: str, offset: int, size: int) -> bytes:
    """``size`` bytes of the leader's frozen copy ``path`` from ``offset`` (blocking)."""
    with open(path, "rb") as file:
        file.seek(offset)
        data = file.read(size)
    if len(data) != size:
        raise SnapshotError(f"{path} holds {offset + len(data)} bytes, the snapshot names more")
    return data


def manifest_files(manifest: dict) -> list[SnapshotFile]:
    """The files a manifest lists; SnapshotError when it is not one."""
    if not isinstance(manifest, dict):
        raise SnapshotError(f"a snapshot manifest must be a JSON object, not {manifest!r}")
    files = manifest.get("files")
    if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, list):
        raise SnapshotError(
            f"a snapshot manifest of format {manifest.get('format')!r}; this member reads "
            f"format {MANIFEST_FORMAT}: run the same delayd version on every member"
        )
    out = []
    for item in files:
        name, size = (item.get("name"), item.get("size")) if isinstance(item, dict) else (0, 0)
        if not isinstance(name, str) or not isinstance(size, int) or size < 0:
            raise SnapshotError(f"snapshot manifest entry {item!r}: want a name and a size")
        parts = name.split("/")
        if name.startswith("/") or any(part in ("", ".", "..") for part in parts):
            raise SnapshotError(f"snapshot file name {name!r} leaves the data directory")
        out.append(SnapshotFile(name, size))
    return out


class SnapshotReceiver:
    """Writes one snapshot at a time into ``directory`` (module docstring). Blocking
    methods: the follower runs them in a worker thread."""

    def __init__(self, directory: str, fs: FileSystem = REAL_FS) -> None:
        self.directory = directory
        self.fs = fs
        self.files: list[SnapshotFile] = []
        self.manifest: dict = {}
        self._written: list[int] = []
        self._fds: dict[int, int] = {}

    def begin(self, manifest: dict) -> None:
        """Start receiving the snapshot ``manifest`` describes; what an earlier one
        left in the directory goes first."""
        self.close()
        self.files = manifest_files(manifest)
        self.manifest = manifest
        discard_partial(self.directory, self.fs, whole_too=True)
        create_dirs_durably(self.fs, self.directory)
        self._written = [0] * len(self.files)

    def write(self, index: int, offset: int, data: bytes) -> None:
        """The bytes of file ``index`` at ``offset``: chunks come in order."""
        if not 0 <= index < len(self.files):
            raise SnapshotError(
                f"a snapshot chunk of file {index}; the manifest has {len(self.files)}"
            )
        expected, size = self._written[index], self.files[index].size
        if offset != expected or offset + len(data) > size:
            raise SnapshotError(
                f"a chunk of {self.files[index].name} at {offset} ({len(data)} bytes): "
                f"{expected} of its {size} bytes arrived so far"
            )
        fd = self._fds.get(index)
        if fd is None:
            fd = self._fds[index] = self._create(index)
        self.fs.pwrite(fd, data, offset)
        self._written[index] = offset + len(data)

    def finish(self) -> dict:
        """Every file whole: make them durable under their final names, then MANIFEST
        (the commit point). Returns the manifest."""
        for index, file in enumerate(self.files):
            if self._written[index] != file.size:
                raise SnapshotError(
                    f"snapshot ended with {self._written[index]} of the {file.size} bytes "
                    f"of {file.name}"
                )
            fd = self._fds.pop(index, None)
            if fd is None:  # an empty file: no chunk came
                fd = self._create(index)
            try:
                self.fs.fsync(fd)
            finally:
                self.fs.close(fd)
            self.fs.replace(self._part(index), os.path.join(self.directory, str(index)))
        self.fs.fsync_dir(self.directory)
        body = json.dumps(self.manifest, sort_keys=True).encode()
        write_checkpoint(self.fs, os.path.join(self.directory, MANIFEST), body)
        return self.manifest

    def close(self) -> None:
        for fd in self._fds.values():
            self.fs.close(fd)
        self._fds.clear()

    def _create(self, index: int) -> int:
        fd = self.fs.open(self._part(index), O_WRITE)
        self.fs.ftruncate(fd, 0)  # a part left by a crash
        return fd

    def _part(self, index: int) -> str:
        return os.path.join(self.directory, f"{index}{PART_SUFFIX}")


def read_manifest(directory: str, fs: FileSystem = REAL_FS) -> dict | None:
    """The manifest of the whole snapshot in ``directory``; None when there is none
    (no directory, or a snapshot cut short). Raises SnapshotError for a bad one."""
    if not fs.exists(directory):
        return None
    body = read_checkpoint(fs, os.path.join(directory, MANIFEST))
    if body is None:
        return None
    try:
        manifest = json.loads(body)
    except ValueError as exc:
        raise SnapshotError(f"{directory}/{MANIFEST} is not JSON: {exc}") from None
    manifest_files(manifest)  # a manifest, or SnapshotError
    return manifest


def received_file(directory: str, index: int) -> str:
    """Where file ``index`` of a whole snapshot lies until it is installed."""
    return os.path.join(directory, str(index))


def discard_partial(directory: str, fs: FileSystem = REAL_FS, *, whole_too: bool = False) -> bool:
    """Remove ``directory`` when it holds a snapshot cut short (no MANIFEST), or any
    snapshot with ``whole_too``; returns whether a file was removed. MANIFEST goes
    first, so a crash part way leaves a partial snapshot, never a whole-looking one."""
    if not fs.exists(directory):
        return False
    manifest = os.path.join(directory, MANIFEST)
    if fs.exists(manifest):
        if not whole_too:
            return False
        fs.unlink(manifest)
        fs.fsync_dir(directory)
    return bool(empty_directory_durably(fs, directory))
