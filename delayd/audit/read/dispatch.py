"""dispatch_log files as Arrow batches, a block of fixed-width entries at a time.

Every entry is FRAMED_SIZE (41) bytes, so a block of entries is one Arrow column of
fixed-size values, and its fields — at the positions of the codecs' own structs,
``storage.framing.HEADER`` + ``dispatch_log.ENTRY`` — are cut out by Arrow's kernels
(fields.py). A block is taken as it is only when every entry in it has the entry
length, a known kind and a CRC that matches (crc32c per entry: the C crc32c package,
over the same bytes scan_frames checks). At the first entry that fails, reading goes
one frame at a time through the server's code — ``storage.scan.read_frame`` and
``dispatch_log.decode_entry`` — which decides what it is: a bad frame ends the file
(torn tail or corruption, frames.py), an entry the codec refuses is a ``format`` row;
then block reading resumes.

Option ``verify=full`` reads every entry the slow way; the tests check both agree.

ROUTE and ROUTED entries (where a send went, for a resend after a failover; not what
became of a record) are left out: the audit judges fates, and a ROUTED entry comes
before its record's fate.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from delayd.audit.kinds import FORMAT, HEAD
from delayd.audit.read import fields
from delayd.audit.read.batches import ALL, ReadOptions, bucket_value, build, problems_batch
from delayd.audit.read.frames import Problem, verdict
from delayd.audit.schemas import DISPATCH_LOG, select
from delayd.logs.dispatch_log import (
    ENTRY,
    ENTRY_SIZE,
    FRAMED_SIZE,
    ROUTING,
    EntryKind,
    decode_entry,
)
from delayd.logs.log_files import LogFile
from storage.errors import CorruptionError
from storage.framing import HEADER, HEADER_SIZE, crc32c
from storage.fs import O_READ, REAL_FS
from storage.scan import BadFrame, read_frame

# One entry, frame header included: length, crc, type, offset, at_ms, group.
_FRAMED_ENTRY = struct.Struct("<" + HEADER.format[1:] + ENTRY.format[1:])
assert _FRAMED_ENTRY.size == FRAMED_SIZE
_FRAMED_FIELDS = fields.layout(_FRAMED_ENTRY)
_CRC_FROM = HEADER_SIZE - 1  # the CRC covers the type byte and the payload
_KINDS = frozenset(kind.value for kind in EntryKind)
_KIND_VALUES = pa.array(sorted(_KINDS), pa.uint8())
_ROUTING_VALUES = pa.array(sorted(kind.value for kind in ROUTING), pa.uint8())
# Kind names indexed by the frame's type byte, for Arrow's take().
_KIND_NAMES = pa.array(
    [EntryKind(t).name.lower() if t in _KINDS else None for t in range(256)], pa.string()
)


def dispatch_batches(
    file: LogFile, server: str, options: ReadOptions = ALL
) -> Iterator[pa.RecordBatch]:
    """The entries of one dispatch_log file (DISPATCH_LOG schema, or its
    ``options.columns``), then one row per problem found."""
    schema = select(DISPATCH_LOG, options.columns)
    verify, batch_rows = options.verify, options.batch_rows
    where = {"server": server, "file": file.name, "bucket": bucket_value(file.bucket_ms)}
    problems: list[Problem] = []
    fd = REAL_FS.open(file.path, O_READ)
    try:
        position, limit = 0, file.size
        slow_rows: list[tuple[int, tuple]] = []
        while position < limit:
            count = 0 if verify != HEAD else min(batch_rows, (limit - position) // FRAMED_SIZE)
            if count:
                block = REAL_FS.pread(fd, count * FRAMED_SIZE, position)
                good, batch = _read_block(schema, block, count, position, where)
                if good:
                    if batch is not None:
                        yield batch
                    position += good * FRAMED_SIZE
                    continue
            # One frame the server's way: the block reader stopped here, or fewer than
            # a whole entry is left.
            try:
                record = read_frame(REAL_FS, fd, file.path, 0, position, limit)
            except BadFrame as bad:
                problems.append(verdict(file, bad))
                break
            try:
                entry = decode_entry(record.type, record.payload, file.path, position)
                if entry.kind not in ROUTING:
                    row = (entry.kind.name.lower(), entry.offset, entry.at_ms, entry.group)
                    slow_rows.append((position, row))
            except (CorruptionError, UnicodeDecodeError) as exc:
                problems.append(Problem(FORMAT, position, getattr(exc, "reason", str(exc))))
            position = record.next_offset
            if len(slow_rows) >= batch_rows:
                yield _rows_batch(schema, slow_rows, where)
                slow_rows = []
        if slow_rows:
            yield _rows_batch(schema, slow_rows, where)
    finally:
        REAL_FS.close(fd)
    if problems:
        yield problems_batch(schema, where, problems, "position")


def _read_block(
    schema: pa.Schema, block: bytes, count: int, position: int, where: dict
) -> tuple[int, pa.RecordBatch | None]:
    """The whole, known, CRC-valid entries at the start of ``block`` (``count`` entries
    long), stopping before the first that is not — or whose group is not ASCII, which
    decode_entry would refuse: how many, and their batch without the ROUTE and ROUTED
    entries (None for none)."""
    entries = pa.Array.from_buffers(pa.binary(FRAMED_SIZE), count, [None, pa.py_buffer(block)])
    length, crc, rtype, offset, at_ms, group = (fields.field(entries, *at) for at in _FRAMED_FIELDS)
    view = memoryview(block)
    computed = [
        crc32c(view[i : i + ENTRY_SIZE + 1])
        for i in range(_CRC_FROM, count * FRAMED_SIZE, FRAMED_SIZE)
    ]
    groups = group.dictionary_encode()  # a file names few groups: each is looked at once
    raw = groups.dictionary.to_pylist()
    ascii_group = pa.array([name.isascii() for name in raw], pa.bool_()).take(groups.indices)
    valid = pc.and_(
        pc.and_(pc.equal(length, ENTRY_SIZE), pc.equal(crc, pa.array(computed, pa.uint32()))),
        pc.and_(pc.is_in(rtype, _KIND_VALUES), ascii_group),
    )
    good = count if pc.all(valid).as_py() else pc.index(valid, False).as_py()
    if not good:
        return 0, None
    values = dict(where)
    values["position"] = pc.add(pc.multiply(fields.counting(good), FRAMED_SIZE), position)
    values["kind"] = _KIND_NAMES.take(rtype.slice(0, good))
    values["offset"] = offset.slice(0, good).cast(pa.int64())
    values["at_ms"] = at_ms.slice(0, good)
    if "group" in schema.names:
        # As the codec reads a name: NUL padding removed.
        names = [name.rstrip(b"\0").decode("ascii") if name.isascii() else None for name in raw]
        values["group"] = pa.array(names, pa.string()).take(groups.indices.slice(0, good))
    batch = build(schema, good, values)
    routing = pc.is_in(rtype.slice(0, good), _ROUTING_VALUES)
    if pc.any(routing).as_py():
        batch = batch.filter(pc.invert(routing))
    return good, batch if batch.num_rows else None


def _rows_batch(schema: pa.Schema, rows: list[tuple[int, tuple]], where: dict) -> pa.RecordBatch:
    values = dict(where)
    values["position"] = [position for position, _ in rows]
    kinds, offsets, at_ms, groups = zip(*(fields for _, fields in rows), strict=True)
    values.update(kind=kinds, offset=offsets, at_ms=at_ms, group=groups)
    return build(schema, len(rows), values)
