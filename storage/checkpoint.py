"""Checkpoint files: small blobs replaced atomically (temp file, fsync, rename, fsync dir).

A reader sees either the previous checkpoint or the new one, never a mix, across crashes
and power loss. The blob is framed with a magic and a crc32c so that damage is reported
instead of being parsed as a position.

Layout::

    checkpoint := magic:"DCK1" length:u32 crc:u32 data:byte[length]
    crc        := crc32c(data)
"""

from __future__ import annotations

import os
import struct

from storage.errors import CorruptionError, FsyncError, is_disk_full
from storage.framing import crc32c
from storage.fs import O_WRITE, FileSystem, disk_full_error

MAGIC = b"DCK1"
HEADER = struct.Struct("<4sII")  # 4 + 4 + 4: magic, length, crc32c
TEMP_SUFFIX = ".tmp"


def write_checkpoint(fs: FileSystem, path: str, data: bytes) -> None:
    """Replace the checkpoint at ``path`` with ``data``; durable when this returns.

    Raises DiskFullError when the disk is full (the previous checkpoint stays, the temp
    file is removed: calling again later is safe), FsyncError when the fsync fails.
    """
    temp = path + TEMP_SUFFIX
    try:
        fd = fs.open(temp, O_WRITE)
        try:
            # A temp file left by an earlier crash may be longer than this blob.
            fs.ftruncate(fd, 0)
            fs.pwrite(fd, HEADER.pack(MAGIC, len(data), crc32c(data)) + data, 0)
            try:
                fs.fsync(fd)
            except OSError as exc:
                raise FsyncError(temp, exc) from exc
        finally:
            fs.close(fd)
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        if fs.exists(temp):
            fs.unlink(temp)
        raise disk_full_error(fs, temp, exc) from None
    fs.replace(temp, path)
    fs.fsync_dir(os.path.dirname(path) or ".")


def read_checkpoint(fs: FileSystem, path: str) -> bytes | None:
    """The data of the checkpoint at ``path``, or None when there is none.

    Raises CorruptionError when the file exists but does not hold a whole, valid blob:
    the rename protocol never leaves a partial file, so that is damage, not a crash.
    """
    if not fs.exists(path):
        return None
    fd = fs.open(path, os.O_RDONLY)
    try:
        raw = fs.pread(fd, fs.fsize(fd), 0)
    finally:
        fs.close(fd)
    if len(raw) < HEADER.size:
        raise CorruptionError(path, 0, len(raw), "checkpoint shorter than its header")
    magic, length, crc = HEADER.unpack_from(raw)
    data = raw[HEADER.size :]
    if magic != MAGIC or length != len(data) or crc32c(data) != crc:
        raise CorruptionError(path, 0, len(raw), "checkpoint magic, length or crc mismatch")
    return data
