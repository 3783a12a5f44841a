"""The replication frames, sans-I/O: events, ``encode``, and ``WireDecoder``.

A replication connection runs on the leader's replication listener, apart from the
client protocol, so it has its own small frame set; each frame is a storage frame
(storage/framing.py: ``length:u32 crc:u32 type:u8 body``, the CRC over type and body),
the frame type saying which event it is::

    FOLLOW       2  follower -> leader, first frame: JSON {"magic", "version", "group",
                    "member", "last_epoch", "ends": {stream: offset}}
    TRUNCATE_TO  3  leader -> follower, once, the answer to FOLLOW: JSON {"epoch",
                    "offsets": {stream: offset}} — cut each stream back to its offset
    RECORDS      4  leader -> follower: epoch:u64 offset:u64 stream:str16
                    acked:count:u16 (stream:str16 offset:u64)* data:rest — framed records
                    of ``stream`` from ``offset``, raw, and the group's acknowledged
                    offsets that moved since the last RECORDS
    DURABLE      5  follower -> leader: count:u16 (stream:str16 offset:u64)* — how far
                    each stream listed is durable on the follower now
    FENCED       6  either way: epoch:u64 — the sender has seen this newer epoch; the
                    receiver must stop (a leader) or stop following this leader
    RETAINED     7  leader -> follower: count:u16 (stream:str16 offset:u64)* — where
                    each listed stream now begins on the leader (retention deleted what
                    lay below); sent after TRUNCATE_TO and whenever it moves
    SNAPSHOT     8  leader -> follower, instead of RECORDS to a follower that lacks
                    records retention deleted: JSON {"epoch", "manifest": {"files":
                    [{"name", "size"}], "meta": {...}}} — the files that follow
    SNAPSHOT_CHUNK 9  leader -> follower: epoch:u64 file:u32 offset:u64 data:rest —
                    bytes of the manifest's file number ``file`` from ``offset``
    SNAPSHOT_END 10  leader -> follower: epoch:u64 — every file was sent
    str16 := length:u16 utf8:byte[length]

All integers little-endian. A decoder that meets a bad frame raises WireError and is
unusable from then on: the caller drops the connection (the follower reconnects).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

from delayd.errors import RemoteProtocolError
from delayd.protocol.receive_buffer import ReceiveBuffer
from storage.framing import HEADER, HEADER_SIZE, encode_record, record_crc

MAGIC = "delayd-replication"
VERSION = 3  # 2: RETAINED; 3: SNAPSHOT
DEFAULT_MAX_FRAME_SIZE = 64 << 20  # a chunk of records, or one record of up to a segment

FOLLOW = 2
TRUNCATE_TO = 3
RECORDS = 4
DURABLE = 5
FENCED = 6
RETAINED = 7
SNAPSHOT = 8
SNAPSHOT_CHUNK = 9
SNAPSHOT_END = 10

U16 = struct.Struct("<H")
U64 = struct.Struct("<Q")
RECORDS_HEAD = struct.Struct("<QQ")  # epoch, offset
CHUNK_HEAD = struct.Struct("<QIQ")  # epoch, file, offset


class WireError(RemoteProtocolError):
    """A replication frame that cannot be what the peer meant to send."""


@dataclass(frozen=True, slots=True)
class Follow:
    group: str
    member: str
    last_epoch: int
    ends: dict[str, int]


@dataclass(frozen=True, slots=True)
class TruncateTo:
    epoch: int
    offsets: dict[str, int]


@dataclass(frozen=True, slots=True)
class Records:
    epoch: int
    stream: str
    offset: int
    data: bytes
    acked: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Durable:
    offsets: dict[str, int]


@dataclass(frozen=True, slots=True)
class Fenced:
    epoch: int


@dataclass(frozen=True, slots=True)
class Retained:
    starts: dict[str, int]


@dataclass(frozen=True, slots=True)
class Snapshot:
    epoch: int
    manifest: dict  # {"files": [{"name", "size"}], "meta": {...}}: delayd.replication.snapshot


@dataclass(frozen=True, slots=True)
class SnapshotChunk:
    epoch: int
    file: int  # the file's place in the manifest's list
    offset: int
    data: bytes


@dataclass(frozen=True, slots=True)
class SnapshotEnd:
    epoch: int


Event = (
    Follow
    | TruncateTo
    | Records
    | Durable
    | Fenced
    | Retained
    | Snapshot
    | SnapshotChunk
    | SnapshotEnd
)


def encode(event: Event) -> bytes:
    """The frame carrying ``event``."""
    if isinstance(event, Records):
        head = RECORDS_HEAD.pack(event.epoch, event.offset) + _str16(event.stream)
        return encode_record(head + _offsets(event.acked) + event.data, RECORDS)
    if isinstance(event, Durable):
        return encode_record(_offsets(event.offsets), DURABLE)
    if isinstance(event, Fenced):
        return encode_record(U64.pack(event.epoch), FENCED)
    if isinstance(event, Retained):
        return encode_record(_offsets(event.starts), RETAINED)
    if isinstance(event, SnapshotChunk):
        head = CHUNK_HEAD.pack(event.epoch, event.file, event.offset)
        return encode_record(head + event.data, SNAPSHOT_CHUNK)
    if isinstance(event, SnapshotEnd):
        return encode_record(U64.pack(event.epoch), SNAPSHOT_END)
    if isinstance(event, Snapshot):
        body = {"epoch": event.epoch, "manifest": event.manifest}
        return encode_record(json.dumps(body).encode(), SNAPSHOT)
    if isinstance(event, Follow):
        body = {
            "magic": MAGIC,
            "version": VERSION,
            "group": event.group,
            "member": event.member,
            "last_epoch": event.last_epoch,
            "ends": event.ends,
        }
        return encode_record(json.dumps(body).encode(), FOLLOW)
    if isinstance(event, TruncateTo):
        body = {"epoch": event.epoch, "offsets": event.offsets}
        return encode_record(json.dumps(body).encode(), TRUNCATE_TO)
    raise TypeError(f"not a replication event: {event!r}")


def _str16(text: str) -> bytes:
    raw = text.encode()
    return U16.pack(len(raw)) + raw


def _offsets(offsets: dict[str, int]) -> bytes:
    return U16.pack(len(offsets)) + b"".join(
        _str16(name) + U64.pack(offset) for name, offset in offsets.items()
    )


class _Reader:
    """Reads a frame's body front to back; runs short -> WireError."""

    def __init__(self, body: bytes, kind: str) -> None:
        self.body, self.kind, self.at = body, kind, 0

    def take(self, size: int) -> bytes:
        if self.at + size > len(self.body):
            raise WireError(f"{self.kind} frame is cut short at byte {self.at} of its body")
        chunk = self.body[self.at : self.at + size]
        self.at += size
        return chunk

    def u16(self) -> int:
        return U16.unpack(self.take(2))[0]

    def u64(self) -> int:
        return U64.unpack(self.take(8))[0]

    def str16(self) -> str:
        raw = self.take(self.u16())
        try:
            return raw.decode()
        except UnicodeDecodeError:
            raise WireError(f"{self.kind} frame has a stream name that is not UTF-8") from None

    def offsets(self) -> dict[str, int]:
        return {self.str16(): self.u64() for _ in range(self.u16())}

    def rest(self) -> bytes:
        return self.take(len(self.body) - self.at)


def decode_body(kind: int, body: bytes) -> Event:
    """The event of a frame of type ``kind`` with ``body``. Raises WireError."""
    if kind == RECORDS:
        reader = _Reader(body, "RECORDS")
        epoch, offset = RECORDS_HEAD.unpack(reader.take(RECORDS_HEAD.size))
        stream = reader.str16()
        acked = reader.offsets()
        return Records(epoch, stream, offset, reader.rest(), acked)
    if kind == DURABLE:
        reader = _Reader(body, "DURABLE")
        offsets = reader.offsets()
        _no_trailing(reader)
        return Durable(offsets)
    if kind == RETAINED:
        reader = _Reader(body, "RETAINED")
        starts = reader.offsets()
        _no_trailing(reader)
        return Retained(starts)
    if kind == SNAPSHOT_CHUNK:
        reader = _Reader(body, "SNAPSHOT_CHUNK")
        epoch, file, offset = CHUNK_HEAD.unpack(reader.take(CHUNK_HEAD.size))
        return SnapshotChunk(epoch, file, offset, reader.rest())
    if kind == SNAPSHOT_END:
        return SnapshotEnd(_epoch_only(body, "SNAPSHOT_END"))
    if kind == SNAPSHOT:
        value = _json(body, "SNAPSHOT")
        return Snapshot(
            _field(value, "epoch", int, "SNAPSHOT"), _field(value, "manifest", dict, "SNAPSHOT")
        )
    if kind == FENCED:
        return Fenced(_epoch_only(body, "FENCED"))
    if kind == FOLLOW:
        value = _json(body, "FOLLOW")
        if value.get("magic") != MAGIC:
            raise WireError(
                f"FOLLOW without the magic {MAGIC!r}: the peer is not a delayd follower"
            )
        if value.get("version") != VERSION:
            raise WireError(
                f"FOLLOW of replication version {value.get('version')!r}; this member "
                f"speaks version {VERSION}: run the same delayd version on every member"
            )
        return Follow(
            _field(value, "group", str, "FOLLOW"),
            _field(value, "member", str, "FOLLOW"),
            _field(value, "last_epoch", int, "FOLLOW"),
            _offset_map(value, "ends", "FOLLOW"),
        )
    if kind == TRUNCATE_TO:
        value = _json(body, "TRUNCATE_TO")
        return TruncateTo(
            _field(value, "epoch", int, "TRUNCATE_TO"), _offset_map(value, "offsets", "TRUNCATE_TO")
        )
    raise WireError(f"unknown replication frame type {kind}")


def _epoch_only(body: bytes, kind: str) -> int:
    """The body of a frame that is an epoch and nothing else."""
    reader = _Reader(body, kind)
    epoch = reader.u64()
    _no_trailing(reader)
    return epoch


def _no_trailing(reader: _Reader) -> None:
    if reader.at != len(reader.body):
        raise WireError(f"{reader.kind} frame has {len(reader.body) - reader.at} trailing bytes")


def _json(body: bytes, kind: str) -> dict:
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise WireError(f"{kind} frame body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise WireError(f"{kind} frame body is not a JSON object")
    return value


def _field(value: dict, name: str, kind_of: type, frame: str):
    item = value.get(name)
    if not isinstance(item, kind_of) or isinstance(item, bool):
        raise WireError(f"{frame} frame: {name!r} must be a {kind_of.__name__}, got {item!r}")
    return item


def _offset_map(value: dict, name: str, frame: str) -> dict[str, int]:
    item = _field(value, name, dict, frame)
    for stream, offset in item.items():
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise WireError(f"{frame} frame: offset of {stream!r} must be >= 0, got {offset!r}")
    return item


class WireDecoder(ReceiveBuffer):
    """Cuts a byte stream into replication events: ``feed(bytes)``, ``next_event()``."""

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        super().__init__()
        self.max_frame_size = max_frame_size

    def next_event(self) -> Event | None:
        """The next whole event, or None when more bytes are needed. Raises WireError
        for a frame too large, with a bad CRC, or with a body that does not decode."""
        buf, pos = self._buf, self._pos
        if len(buf) - pos < HEADER_SIZE:
            return None
        length, crc, kind = HEADER.unpack_from(buf, pos)
        size = HEADER_SIZE + length
        if size > self.max_frame_size:
            raise WireError(
                f"replication frame of {size} bytes exceeds the limit of {self.max_frame_size}"
            )
        if len(buf) - pos < size:
            return None
        body = bytes(buf[pos + HEADER_SIZE : pos + size])
        if record_crc(kind, body) != crc:
            raise WireError(f"replication frame of type {kind} fails its CRC")
        self._pos = pos + size
        if self._pos == len(buf):
            buf.clear()
            self._pos = 0
        return decode_body(kind, body)
