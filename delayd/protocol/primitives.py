"""The primitives every frame body is built of, and the reader that checks them.

Little-endian; docs/protocol.md has the grammar of every body::

    str       := length:u16 utf8:byte[length]
    opt_str   := 0:u8 | 1:u8 str
    opt_i64   := 0:u8 | 1:u8 i64

``BodyReader`` trusts nothing: every read checks the bytes left first, text must be
UTF-8, and each failure is a RemoteProtocolError naming the body and the field, never
IndexError, struct.error or UnicodeDecodeError.
"""

from __future__ import annotations

import struct

from delayd.errors import LocalProtocolError, RemoteProtocolError
from delayd.protocol.codes import ErrorCode

U8 = struct.Struct("<B")
U16 = struct.Struct("<H")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
I64 = struct.Struct("<q")
F64 = struct.Struct("<d")
MAX_STR_BYTES = 2**16 - 1  # str lengths are u16
MAX_COUNT_U16 = 2**16 - 1


def put_str(out: bytearray, value: str, what: str) -> None:
    data = value.encode()
    if len(data) > MAX_STR_BYTES:
        raise LocalProtocolError(
            f"{what} is {len(data)} bytes of UTF-8; the wire allows at most {MAX_STR_BYTES}"
        )
    out += U16.pack(len(data))
    out += data


def put_opt_str(out: bytearray, value: str | None, what: str) -> None:
    if value is None:
        out.append(0)
    else:
        out.append(1)
        put_str(out, value, what)


def put_opt_i64(out: bytearray, value: int | None) -> None:
    if value is None:
        out.append(0)
    else:
        out.append(1)
        out += I64.pack(value)


class BodyReader:
    """A cursor over one frame body; every read checks the bytes left first."""

    __slots__ = ("body", "end", "name", "pos", "request_id")

    def __init__(self, body: bytes, name: str, request_id: int) -> None:
        self.body = body
        self.pos = 0
        self.end = len(body)
        self.name = name
        self.request_id = request_id

    def error(self, problem: str) -> RemoteProtocolError:
        return RemoteProtocolError(
            f"malformed {self.name} body at byte {self.pos}: {problem}",
            code=ErrorCode.MALFORMED,
            request_id=self.request_id,
        )

    def _short(self, what: str, need: int) -> RemoteProtocolError:
        return self.error(f"{what} needs {need} bytes, only {self.end - self.pos} left")

    def fixed(self, fmt: struct.Struct, what: str) -> int:
        pos = self.pos
        if self.end - pos < fmt.size:
            raise self._short(what, fmt.size)
        self.pos = pos + fmt.size
        return fmt.unpack_from(self.body, pos)[0]

    def u8(self, what: str) -> int:
        if self.pos >= self.end:
            raise self._short(what, 1)
        self.pos += 1
        return self.body[self.pos - 1]

    def flag(self, what: str) -> bool:
        value = self.u8(what)
        if value > 1:
            raise self.error(f"{what} presence byte is {value}, must be 0 or 1")
        return value == 1

    def text(self, what: str) -> str:
        pos = self.pos
        if self.end - pos < 2:
            raise self._short(f"length of {what}", 2)
        (n,) = U16.unpack_from(self.body, pos)
        pos += 2
        if self.end - pos < n:
            self.pos = pos
            raise self._short(what, n)
        try:
            value = self.body[pos : pos + n].decode()
        except UnicodeDecodeError as exc:
            raise self.error(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
        self.pos = pos + n
        return value

    def opt_str(self, what: str) -> str | None:
        return self.text(what) if self.flag(what) else None

    def opt_i64(self, what: str) -> int | None:
        return self.fixed(I64, what) if self.flag(what) else None

    def enum(self, table: dict[int, object], value: int, what: str) -> object:
        member = table.get(value)
        if member is None:
            raise self.error(f"unknown {what} {value}")
        return member

    def finish(self) -> None:
        if self.pos != self.end:
            raise self.error(f"{self.end - self.pos} trailing bytes after the last field")
