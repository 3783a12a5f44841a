"""Fields of many records at once: the integers of a fixed-layout head and the
variable-length texts behind it, cut out of an Arrow column of payloads by Arrow's
compute kernels (C++), with no Python step per record.

A payload column is what ``pa.array(payloads, pa.binary())`` builds: the payloads end
to end in one data buffer, and an offset where each starts. A head is read with the
codec's own ``struct.Struct`` (``layout`` turns its format into byte positions and Arrow
types), so the format is defined once, in delayd.logs. Integers are little-endian on
disk and reinterpreted in place, which needs a little-endian host (x86, ARM).
"""

from __future__ import annotations

import re
import struct
import sys

import pyarrow as pa
import pyarrow.compute as pc

if sys.byteorder != "little":  # the reinterpretation below reads the host's byte order
    raise ImportError("delayd.audit reads log heads in place and needs a little-endian host")

_TYPES = {
    "b": pa.int8(),
    "B": pa.uint8(),
    "h": pa.int16(),
    "H": pa.uint16(),
    "i": pa.int32(),
    "I": pa.uint32(),
    "q": pa.int64(),
    "Q": pa.uint64(),
}


def layout(head: struct.Struct) -> list[tuple[int, pa.DataType]]:
    """(byte position, Arrow type) of each field of ``head``, a little-endian struct of
    integers and byte strings (``16s`` is ``pa.binary(16)``) such as
    ``message_log.HEAD``. Raises ValueError for any other format."""
    fmt = head.format
    if fmt[:1] != "<":
        raise ValueError(f"not a little-endian struct: {fmt!r}")
    fields: list[tuple[int, pa.DataType]] = []
    position = 0  # "<" packs the fields without padding
    for count, code in re.findall(r"(\d*)(\D)", fmt[1:]):
        if code == "s":
            type_ = pa.binary(int(count or 1))
            width = type_.byte_width
        elif code in _TYPES and not count:
            type_ = _TYPES[code]
            width = type_.bit_width // 8
        else:
            raise ValueError(f"not a struct of integers and byte strings: {fmt!r}")
        fields.append((position, type_))
        position += width
    assert position == head.size, fmt
    return fields


def heads(payloads: pa.BinaryArray, size: int) -> pa.FixedSizeBinaryArray:
    """The first ``size`` bytes of every payload, each at least that long."""
    return pc.binary_slice(payloads, 0, size).cast(pa.binary(size))


def field(heads_: pa.FixedSizeBinaryArray, at: int, type_: pa.DataType) -> pa.Array:
    """The field of ``type_`` (as ``layout`` gives it) at byte ``at`` of every head."""
    if pa.types.is_fixed_size_binary(type_):
        return pc.binary_slice(heads_, at, at + type_.byte_width)
    part = pc.binary_slice(heads_, at, at + type_.bit_width // 8)
    return pa.Array.from_buffers(type_, len(part), [None, part.buffers()[1]], offset=part.offset)


def counting(count: int) -> pa.Int64Array:
    """0, 1, ..., count - 1."""
    return pc.subtract(pc.cumulative_sum(pa.repeat(pa.scalar(1, pa.int64()), count)), 1)


def starts(payloads: pa.BinaryArray) -> pa.Int64Array:
    """Where each payload starts in the column's data buffer."""
    offsets = pa.Array.from_buffers(
        pa.int32(), len(payloads) + 1, [None, payloads.buffers()[1]], offset=payloads.offset
    )
    return offsets.slice(0, len(payloads)).cast(pa.int64())


def cut(payloads: pa.BinaryArray, at: pa.Int64Array, lengths: pa.Int64Array) -> pa.BinaryArray:
    """Bytes ``at[i] .. at[i] + lengths[i]`` of the column's data buffer (``at`` as
    ``starts`` counts, plus a position in the payload), one value per payload.

    The values are cut by an Arrow ``filter``: a binary column over the same data buffer
    alternates the wanted slices with the bytes between them, and every other value is
    kept. Its offsets are (start, end) pairs; packing each pair into one int64 (end in
    the high half) and reading that buffer as int32 lays them out in that order, which
    is why the data buffer must be under 2 GiB (int32 offsets, as the column has).
    """
    count = len(payloads)
    if count == 0:
        return pa.array([], pa.binary())
    ends = pc.add(at, lengths)
    pairs = pc.bit_wise_or(at, pc.multiply(ends, 1 << 32))
    last = pa.array([ends[-1].as_py()], pa.int64())
    offsets = pa.concat_arrays([pairs, last]).buffers()[1]  # 2 * count int32, then one more
    alternating = pa.Array.from_buffers(
        pa.binary(), 2 * count, [None, offsets, payloads.buffers()[2]]
    )
    every_other = pa.py_buffer(b"\x55" * ((2 * count + 7) // 8))  # bits 0, 2, 4, ... set
    return alternating.filter(pa.Array.from_buffers(pa.bool_(), 2 * count, [None, every_other]))
