"""Damage to files on disk, as a crash or bit rot leaves it: the corruption tests of
storage, inspect and the audit make it with these."""

from __future__ import annotations

import os


def flip_byte(path: str, position: int, mask: int = 0xFF) -> None:
    """XOR the byte at ``position`` with ``mask``: all its bits by default, or one bit
    (``mask=0x40``) where a test wants a single flipped bit."""
    with open(path, "r+b") as file:
        file.seek(position)
        byte = file.read(1)
        file.seek(position)
        file.write(bytes([byte[0] ^ mask]))


def append_bytes(path: str, data: bytes) -> None:
    """Bytes at the end of a file, as a write cut short by a crash leaves them."""
    with open(path, "ab") as file:
        file.write(data)


def cut(path: str, size: int) -> None:
    """Shorten the file to ``size`` bytes, as a torn write leaves it."""
    os.truncate(path, size)
