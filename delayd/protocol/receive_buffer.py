"""The bytes a sans-I/O decoder has received and not yet consumed: the frame decoder of
the client protocol and the replication wire both cut their frames out of one."""

from __future__ import annotations


class ReceiveBuffer:
    """``feed(bytes)`` appends; a decoder reads from ``_buf`` at ``_pos`` and advances
    ``_pos`` past each frame it returns."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0  # start of the first unconsumed byte in _buf

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as part of a frame."""
        return len(self._buf) - self._pos

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        # Compact lazily: deleting consumed bytes after every frame would copy the rest of
        # the buffer once per frame, quadratic for a burst of small frames.
        if self._pos and self._pos * 2 >= len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data
