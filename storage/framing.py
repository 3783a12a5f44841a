"""Record framing shared by every log: the format constants and their arithmetic.

Grammar (all integers little-endian; the full description with a worked example is in
docs/storage-format.md)::

    segment := record* [end_of_segment]
    record  := length:u32 crc:u32 type:u8 payload:byte[length]
    crc     := crc32c(type || payload)

``length`` counts payload bytes only. A record is never split across segments: when the
next record does not fit, the writer closes the segment with an END_OF_SEGMENT record
(empty payload) and rolls to a new file. Bytes after the last complete record are a torn
tail, which recovery cuts (see segmented_log.py for how a tear is told from corruption).
"""

from __future__ import annotations

import struct

import crc32c as _crc32c

HEADER = struct.Struct("<IIB")
HEADER_SIZE = HEADER.size  # 4 + 4 + 1: length, crc32c, type
assert HEADER_SIZE == 4 + 4 + 1

# Record types. 0 is never valid so that a zero-filled tail (what some file systems leave
# after a crash extended a file) never parses as a record.
TYPE_INVALID = 0
TYPE_END_OF_SEGMENT = 1
TYPE_DATA = 2  # the default for callers that have a single kind of record
FIRST_USER_TYPE = 2  # callers may use any type in 2..255 for their own record kinds
MAX_TYPE = 255

crc32c = _crc32c.crc32c


_TYPE_SEEDS = tuple(crc32c(bytes((rtype,))) for rtype in range(MAX_TYPE + 1))


def type_seed(rtype: int) -> int:
    """The crc32c of the type byte alone.

    ``crc32c(payload, type_seed(t)) == crc32c(bytes([t]) + payload)``: a batch computes
    the seed once and then one crc call per payload, without copying the payload.
    """
    if not 0 <= rtype <= MAX_TYPE:
        raise ValueError(f"record type {rtype} is not a byte")
    return _TYPE_SEEDS[rtype]


def record_crc(rtype: int, payload: bytes | bytearray | memoryview) -> int:
    """The crc32c a record of ``rtype`` with ``payload`` must carry."""
    return crc32c(payload, type_seed(rtype))


def encode_record(payload: bytes | bytearray | memoryview, rtype: int = TYPE_DATA) -> bytes:
    """One framed record, header and payload."""
    return HEADER.pack(len(payload), record_crc(rtype, payload), rtype) + bytes(payload)


END_OF_SEGMENT_RECORD = encode_record(b"", TYPE_END_OF_SEGMENT)
