"""dispatch_log files as Arrow batches, a block of fixed-width entries at a time.

Every entry is FRAMED_SIZE (41) bytes, so a block of entries is unpacked by one
``struct.iter_unpack`` with the frame header and the entry composed from the codecs'
own structs (``storage.framing.HEADER`` + ``dispatch_log.ENTRY``). A block is taken
as it is only when every entry in it has the entry length, a known kind and a CRC that
matches (crc32c per entry: the C crc32c package, over the same bytes scan_frames
checks). At the first entry that fails, reading goes one frame at a time through the
server's code — ``storage.scan.read_frame`` and ``dispatch_log.decode_entry`` — which
decides what it is: a bad frame ends the file (torn tail or corruption, frames.py), an
entry the codec refuses is a ``format`` row; then block reading resumes.

Option ``verify=full`` reads every entry the slow way; the tests check both agree.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence

import pyarrow as pa

from delayd.audit.batches import BATCH_ROWS, bucket_value, build, problems_batch
from delayd.audit.files import LogFile
from delayd.audit.frames import Problem, verdict
from delayd.audit.kinds import FORMAT, HEAD, VERIFY_MODES
from delayd.audit.schemas import DISPATCH_LOG, select
from delayd.logs.dispatch_log import ENTRY, ENTRY_SIZE, FRAMED_SIZE, EntryKind, decode_entry
from storage.errors import CorruptionError
from storage.framing import HEADER, HEADER_SIZE, crc32c
from storage.fs import O_READ, REAL_FS
from storage.scan import BadFrame, read_frame

# One entry, frame header included: length, crc, type, offset, at_ms, group.
_FRAMED_ENTRY = struct.Struct("<" + HEADER.format[1:] + ENTRY.format[1:])
assert _FRAMED_ENTRY.size == FRAMED_SIZE
_CRC_FROM = HEADER_SIZE - 1  # the CRC covers the type byte and the payload
_KINDS = frozenset(kind.value for kind in EntryKind)
# Kind names indexed by the frame's type byte, for Arrow's take().
_KIND_NAMES = pa.array(
    [EntryKind(t).name.lower() if t in _KINDS else None for t in range(256)], pa.string()
)


def dispatch_batches(
    file: LogFile,
    server: str,
    *,
    verify: str = HEAD,
    batch_rows: int = BATCH_ROWS,
    columns: Sequence[str] | None = None,
) -> Iterator[pa.RecordBatch]:
    """The entries of one dispatch_log file (DISPATCH_LOG schema, or its ``columns``),
    then one row per problem found."""
    schema = select(DISPATCH_LOG, columns)
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_MODES)}, got {verify!r}")
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
                if batch is not None:
                    yield batch
                    position += good * FRAMED_SIZE
                    continue
            # One frame the server's way: the block reader stopped here, or fewer than
            # a whole entry is left.
            try:
                record = read_frame(REAL_FS, fd, file.path, 0, position, limit)
            except BadFrame as bad:
                problems.append(verdict(fd, file, bad))
                break
            try:
                entry = decode_entry(record.type, record.payload, file.path, position)
                slow_rows.append(
                    (position, (entry.kind.name.lower(), entry.offset, entry.at_ms, entry.group))
                )
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
    decode_entry would refuse: how many, and their batch (None for none)."""
    view = memoryview(block)
    lengths, crcs, types, offsets, at_ms, groups = zip(
        *_FRAMED_ENTRY.iter_unpack(block), strict=True
    )
    computed = [
        crc32c(view[i : i + ENTRY_SIZE + 1])
        for i in range(_CRC_FROM, count * FRAMED_SIZE, FRAMED_SIZE)
    ]
    bad_groups = {group for group in set(groups) if not group.isascii()}
    good = count
    if not (
        computed == list(crcs)
        and lengths.count(ENTRY_SIZE) == count
        and _KINDS.issuperset(types)
        and not bad_groups
    ):
        good = next(
            i
            for i in range(count + 1)
            if i == count
            or lengths[i] != ENTRY_SIZE
            or crcs[i] != computed[i]
            or types[i] not in _KINDS
            or groups[i] in bad_groups
        )
        if not good:
            return 0, None
    values = dict(where)
    values["position"] = range(position, position + good * FRAMED_SIZE, FRAMED_SIZE)
    type_bytes = block[_CRC_FROM : good * FRAMED_SIZE : FRAMED_SIZE]  # the type byte of each
    type_column = pa.Array.from_buffers(pa.uint8(), good, [None, pa.py_buffer(type_bytes)])
    values["kind"] = _KIND_NAMES.take(type_column)
    values["offset"] = offsets[:good]
    values["at_ms"] = at_ms[:good]
    if "group" in schema.names:
        values["group"] = _group_names(groups[:good])
    return good, build(schema, good, values)


def _group_names(groups: tuple[bytes, ...]) -> pa.Array:
    """Group names as the codec reads them (NUL padding removed), decoded once per
    distinct value: a file names few groups."""
    encoded = pa.array(groups, pa.binary()).dictionary_encode()
    names = [raw.rstrip(b"\0").decode("ascii") for raw in encoded.dictionary.to_pylist()]
    return pa.array(names, pa.string()).take(encoded.indices)


def _rows_batch(schema: pa.Schema, rows: list[tuple[int, tuple]], where: dict) -> pa.RecordBatch:
    values = dict(where)
    values["position"] = [position for position, _ in rows]
    kinds, offsets, at_ms, groups = zip(*(fields for _, fields in rows), strict=True)
    values.update(kind=kinds, offset=offsets, at_ms=at_ms, group=groups)
    return build(schema, len(rows), values)
