"""Building Arrow record batches for the log readers: whole columns at once.

A reader collects a chunk of records into plain lists and turns each list into one
Arrow array in C (``pa.array``), rather than handing Spark one Python row at a time;
columns that are the same for a whole file (server, file, bucket) are repeated scalars.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from delayd.audit.kinds import HEAD, VERIFY_MODES
from delayd.audit.read.frames import Problem

BATCH_ROWS = 65_536  # records per batch: big enough to amortise, small enough for memory
US_PER_MS = 1000


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """How a reader reads a file: ``verify`` (kinds.VERIFY_MODES: the head checked as
    the codec checks it, or every record through the codec), ``batch_rows`` records
    at most per batch, and ``columns`` to build (None: all of the log's schema).
    Raises ValueError for an unknown ``verify``."""

    verify: str = HEAD
    batch_rows: int = BATCH_ROWS
    columns: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if self.verify not in VERIFY_MODES:
            raise ValueError(
                f"verify must be one of {', '.join(VERIFY_MODES)}, got {self.verify!r}"
            )


ALL = ReadOptions()


def build(schema: pa.Schema, rows: int, columns: Mapping[str, Any]) -> pa.RecordBatch:
    """A batch of ``schema`` with ``rows`` rows. ``columns`` maps a name to an Arrow
    array, a sequence of Python values, or a scalar value repeated on every row;
    columns not given are null."""
    arrays = []
    for field in schema:
        value = columns.get(field.name)
        if value is None:
            arrays.append(pa.nulls(rows, field.type))
        elif isinstance(value, pa.Array):
            arrays.append(value)
        elif isinstance(value, (str, int)):
            arrays.append(pa.repeat(pa.scalar(value, field.type), rows))
        else:
            arrays.append(pa.array(value, field.type))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def bucket_value(bucket_ms: int | None) -> int | None:
    """A bucket start (epoch ms) as the microseconds of Spark's TimestampType."""
    return None if bucket_ms is None else bucket_ms * US_PER_MS


def problems_batch(
    schema: pa.Schema,
    where: Mapping[str, Any],
    problems: Sequence[Problem],
    position_column: str,
    base: int = 0,
) -> pa.RecordBatch:
    """One row per problem: ``where`` (server, file, bucket), the problem's byte in
    ``position_column`` (plus ``base``: a message_log segment's first offset), kind and
    detail; every data column null."""
    columns = dict(where)
    columns[position_column] = [base + p.position for p in problems]
    columns["problem"] = [p.kind for p in problems]
    columns["detail"] = [p.detail for p in problems]
    return build(schema, len(problems), columns)
