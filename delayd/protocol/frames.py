"""Frames: the fixed header, the command codes, encode_frame and FrameDecoder.

Grammar (all integers little-endian; docs/protocol.md has the full description and a
worked example)::

    frame  := magic:"DLYD" version:u8 command:u8 flags:u16 request_id:u64
              body_length:u32 crc:u32 body:byte[body_length]
    crc    := crc32c(header bytes 0..19 || body)

The CRC covers the header too (everything before the ``crc`` field), so a flipped bit
in a request id or a command code is caught, not acted upon. TCP already checksums, but
weakly (16 bits), and the same frames are read back by tests and tools from files.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import crc32c as _crc32c

from delayd.errors import LocalProtocolError, RemoteProtocolError
from delayd.protocol.codes import Command, ErrorCode
from delayd.protocol.receive_buffer import ReceiveBuffer

MAGIC = b"DLYD"
# Version of the frame *layout* below. A peer with another layout cannot be parsed at
# all, so a mismatch is a hard ProtocolError. The command set evolves separately, through
# the protocol version negotiated in HELLO (PROTOCOL_VERSION in events.py).
FRAME_VERSION = 1

HEADER_PREFIX = struct.Struct("<4sBBHQI")  # magic, version, command, flags, request id, body length
HEADER = struct.Struct("<4sBBHQII")  # HEADER_PREFIX, then crc32c
HEADER_SIZE = HEADER.size
assert HEADER_PREFIX.size == 4 + 1 + 1 + 2 + 8 + 4
assert HEADER_SIZE == HEADER_PREFIX.size + 4 == 24

MAX_BODY_LENGTH = 2**32 - 1  # body_length is a u32
MAX_REQUEST_ID = 2**64 - 1  # request_id is a u64
DEFAULT_MAX_FRAME_SIZE = 16 * 1024 * 1024  # 16 MiB, header included
MAX_FRAME_SIZE_LIMIT = HEADER_SIZE + MAX_BODY_LENGTH  # the most the header can describe

# Flag bits. Every other bit must be zero: a frame with unknown flags comes from a peer
# we cannot understand, and guessing what it meant is worse than refusing.
FLAG_CLOSE = 0x0001  # the sender closes the connection after this frame (ERROR only)
KNOWN_FLAGS = FLAG_CLOSE

crc32c = _crc32c.crc32c


# Lookup by int, faster than Command(value) plus a try/except on the decode path.
_COMMANDS: dict[int, Command] = {int(c): c for c in Command}


@dataclass(frozen=True, slots=True)
class Frame:
    """One decoded frame: header fields and the raw body (CRC already checked)."""

    command: Command
    flags: int
    request_id: int
    body: bytes


def _check_max_frame_size(max_frame_size: int) -> int:
    if not HEADER_SIZE <= max_frame_size <= MAX_FRAME_SIZE_LIMIT:
        raise ValueError(
            f"max_frame_size must be between {HEADER_SIZE} and {MAX_FRAME_SIZE_LIMIT} bytes, "
            f"got {max_frame_size}"
        )
    return max_frame_size


def begin_frame() -> bytearray:
    """A buffer with room for the header; append the body, then call finish_frame."""
    return bytearray(HEADER_SIZE)


def finish_frame(out: bytearray, command: int, request_id: int, flags: int = 0) -> bytes:
    """Fill in the header of ``out`` (made by begin_frame, body appended) and return it.

    Raises LocalProtocolError for a request id, flags or body length the header cannot
    carry.
    """
    body_length = len(out) - HEADER_SIZE
    if body_length > MAX_BODY_LENGTH:
        raise LocalProtocolError(
            f"frame body of {body_length} bytes exceeds the u32 limit of {MAX_BODY_LENGTH}"
        )
    if not 0 <= request_id <= MAX_REQUEST_ID:
        raise LocalProtocolError(f"request id {request_id} does not fit in a u64")
    if flags & ~KNOWN_FLAGS:
        raise LocalProtocolError(f"unknown flag bits 0x{flags & ~KNOWN_FLAGS:04x}")
    HEADER_PREFIX.pack_into(out, 0, MAGIC, FRAME_VERSION, command, flags, request_id, body_length)
    with memoryview(out) as view:
        crc = crc32c(view[HEADER_SIZE:], crc32c(view[: HEADER_PREFIX.size]))
    struct.pack_into("<I", out, HEADER_PREFIX.size, crc)
    return bytes(out)


def encode_frame(command: int, request_id: int, body: bytes = b"", *, flags: int = 0) -> bytes:
    """One complete frame carrying ``body`` (raises LocalProtocolError, see finish_frame)."""
    out = begin_frame()
    out += body
    return finish_frame(out, command, request_id, flags)


class FrameDecoder(ReceiveBuffer):
    """Cuts a byte stream into frames, sans-I/O: ``feed(bytes)``, then ``next_frame()``.

    Checks, in this order, as soon as the bytes for each check have arrived: the magic
    (from its first byte, so a stray HTTP client is refused at once), the frame version,
    the command code, the flag bits, and the body length against ``max_frame_size``
    (header included) — all before a byte of the body is buffered; then the CRC once the
    body is complete. Any failure raises RemoteProtocolError and leaves the buffer as it
    was, so the decoder is unusable from then on (the caller closes the connection).
    """

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        super().__init__()
        self.max_frame_size = _check_max_frame_size(max_frame_size)

    @property
    def incomplete_frame_size(self) -> int:
        """The size (header included) of the frame being received, once its header is
        in and ``next_frame`` returned None; 0 when no header is waiting for its body."""
        if self.buffered < HEADER_SIZE:
            return 0
        body_length = HEADER_PREFIX.unpack_from(self._buf, self._pos)[-1]
        return HEADER_SIZE + body_length

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None when more bytes are needed.

        Raises RemoteProtocolError (with ``code`` set to an ErrorCode value) on a bad
        magic, version, command, flags, CRC, or a frame larger than ``max_frame_size``.
        """
        buf, pos = self._buf, self._pos
        available = len(buf) - pos
        if available < HEADER_SIZE:
            prefix = bytes(buf[pos : pos + min(available, len(MAGIC))])
            if not MAGIC.startswith(prefix):
                raise RemoteProtocolError(
                    f"bad magic {prefix!r}: the peer does not speak the delayd protocol "
                    f"(frames start with {MAGIC!r})",
                    code=ErrorCode.MALFORMED,
                )
            return None
        magic, version, command, flags, request_id, body_length, crc = HEADER.unpack_from(buf, pos)
        # Until the CRC is checked the request id cannot be trusted, so errors found in
        # the header concern the whole connection (request id 0).
        if magic != MAGIC:
            raise RemoteProtocolError(
                f"bad magic {magic!r}: the peer does not speak the delayd protocol",
                code=ErrorCode.MALFORMED,
            )
        if version != FRAME_VERSION:
            raise RemoteProtocolError(
                f"frame version {version}, this side reads only version {FRAME_VERSION}",
                code=ErrorCode.UNSUPPORTED_VERSION,
            )
        cmd = _COMMANDS.get(command)
        if cmd is None:
            raise RemoteProtocolError(
                f"unknown command code 0x{command:02x}", code=ErrorCode.UNKNOWN_COMMAND
            )
        if flags & ~KNOWN_FLAGS:
            raise RemoteProtocolError(
                f"unknown flag bits 0x{flags & ~KNOWN_FLAGS:04x} on {cmd.name}",
                code=ErrorCode.MALFORMED,
            )
        frame_size = HEADER_SIZE + body_length
        if frame_size > self.max_frame_size:
            raise RemoteProtocolError(
                f"{cmd.name} frame of {frame_size} bytes exceeds this connection's "
                f"max_frame_size of {self.max_frame_size} bytes",
                code=ErrorCode.FRAME_TOO_LARGE,
            )
        if available < frame_size:
            return None
        body = bytes(buf[pos + HEADER_SIZE : pos + frame_size])
        expected = crc32c(body, crc32c(bytes(buf[pos : pos + HEADER_PREFIX.size])))
        if crc != expected:
            raise RemoteProtocolError(
                f"{cmd.name} frame fails its CRC (carries 0x{crc:08x}, computed "
                f"0x{expected:08x}): corrupted in transit or by the sender",
                code=ErrorCode.MALFORMED,
            )
        self._pos = pos + frame_size
        if self._pos == len(buf):
            buf.clear()
            self._pos = 0
        return Frame(cmd, flags, request_id, body)
