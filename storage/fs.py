"""The one file-system interface every byte of storage/ goes through.

Production passes :data:`REAL_FS` (thin wrappers over :mod:`os`). Tests pass a crash
simulator (:mod:`storage.crashfs`) that remembers which bytes and directory entries an
fsync has made durable, so that a power loss can be materialised at any point — the
idea of leveldb's FaultInjectionTestEnv and SQLite's crash VFS (test6.c). No write may
bypass this interface (no mmap writes), or the simulator would not see it.

File descriptors are opaque integers owned by the file system object that made them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

from storage.errors import DiskFullError

O_READ = os.O_RDONLY
O_WRITE = os.O_RDWR | os.O_CREAT  # read-write, create when missing, never truncate


class FileSystem(Protocol):
    """What storage/ needs from a file system; paths are ``str``."""

    def open(self, path: str, flags: int) -> int: ...
    def close(self, fd: int) -> None: ...
    def pread(self, fd: int, size: int, offset: int) -> bytes: ...
    def pwrite(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int: ...
    def fsync(self, fd: int) -> None: ...
    def fdatasync(self, fd: int) -> None: ...
    def ftruncate(self, fd: int, size: int) -> None: ...
    def fsize(self, fd: int) -> int: ...
    def replace(self, src: str, dst: str) -> None: ...
    def unlink(self, path: str) -> None: ...
    def mkdir(self, path: str) -> None: ...
    def listdir(self, path: str) -> list[str]: ...
    def exists(self, path: str) -> bool: ...
    def fsync_dir(self, path: str) -> None: ...
    def free_bytes(self, path: str) -> int: ...


class OsFileSystem:
    """The real file system: every call is the matching :mod:`os` call."""

    def open(self, path: str, flags: int) -> int:
        return os.open(path, flags, 0o644)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def pwrite(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        # os.pwrite may write less than asked (signals, huge buffers); loop until done so
        # callers can treat a write as all-or-exception.
        view = memoryview(data)
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written:], offset + written)
        return written

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def fsize(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def mkdir(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def fsync_dir(self, path: str) -> None:
        # A rename, creation or unlink is durable only once its directory is fsynced.
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def free_bytes(self, path: str) -> int:
        # What an unprivileged writer may still use (f_bavail, not f_bfree: root's
        # reserved blocks are not ours to count on).
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize


REAL_FS: FileSystem = OsFileSystem()


def disk_full_error(fs: FileSystem, path: str, cause: OSError) -> DiskFullError:
    """The DiskFullError for a write to ``path`` refused with ``cause``, naming the
    free bytes of its file system (None when even asking fails)."""
    try:
        free: int | None = fs.free_bytes(os.path.dirname(path) or ".")
    except OSError:
        free = None
    return DiskFullError(path, free, cause)


def create_dirs_durably(fs: FileSystem, directory: str) -> None:
    """Create ``directory`` and missing parents, and make the whole chain durable.

    A directory entry survives a power loss only once its parent is fsynced, so this
    fsyncs ``directory`` itself (entries a crashed run created in it) and every ancestor
    up to the root — also when they already exist: a run killed between its mkdir and
    its fsync leaves a directory that exists but is not yet durable. Clean directories
    fsync cheaply; stores call this once when they open.
    """
    path = os.path.normpath(os.path.abspath(directory))
    fs.mkdir(path)
    for each in dirs_up_to(path, os.path.abspath(os.sep)):
        fs.fsync_dir(each)


def remove_durably(fs: FileSystem, path: str) -> None:
    """Unlink ``path`` if it exists, and fsync its directory: gone after a power loss."""
    if fs.exists(path):
        fs.unlink(path)
        fs.fsync_dir(os.path.dirname(path))


def empty_directory_durably(
    fs: FileSystem, directory: str, keep: Callable[[str], bool] = lambda name: False
) -> list[str]:
    """Unlink every file of ``directory`` (if it exists) whose name ``keep`` does not
    keep, with one fsync of the directory; returns the names removed."""
    if not fs.exists(directory):
        return []
    gone = [name for name in fs.listdir(directory) if not keep(name)]
    for name in gone:
        fs.unlink(os.path.join(directory, name))
    if gone:
        fs.fsync_dir(directory)
    return gone


def dirs_up_to(directory: str, ancestor: str) -> list[str]:
    """``directory``, its parent, ... up to and including ``ancestor``: what to fsync
    after a ``mkdir -p`` of ``directory`` when ``ancestor``'s own entry is known to be
    durable already. Raises ValueError when ``ancestor`` is not ``directory`` or one of
    its parents."""
    path = os.path.normpath(os.path.abspath(directory))
    top = os.path.normpath(os.path.abspath(ancestor))
    chain = [path]
    while path != top:
        parent = os.path.dirname(path)
        if parent == path:
            raise ValueError(f"{ancestor!r} is not {directory!r} or one of its parents")
        chain.append(parent)
        path = parent
    return chain
