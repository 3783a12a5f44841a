"""Time buckets of schedule_log: pure arithmetic on epoch milliseconds, always UTC.

A bucket is the half-open interval ``[start_ms, start_ms + segment_scale minutes)``;
buckets are aligned to the Unix epoch, so a bucket's start is a multiple of its width.
Each bucket is one schedule_log file named by its UTC start, ``yyyyMMddHHmm`` — as QMQ's
ScheduleLog.locateSegment / DelaySegment naming, except that QMQ formats the name in
the JVM's local time zone, where a DST change makes two buckets share a name (autumn)
or skips one (spring). UTC has neither.

For scales that divide 60 (1, 2, 3, 4, 5, 6, 10, 12, 15, 20, 30, 60) buckets also align
with the hour; other scales in the range 1..60 are allowed and simply
tile the time line from the epoch.
"""

from __future__ import annotations

import datetime as _dt
import functools
from collections.abc import Iterable

MS_PER_MINUTE = 60_000
MIN_SEGMENT_SCALE = 1  # minutes
MAX_SEGMENT_SCALE = 60  # minutes
DEFAULT_SEGMENT_SCALE = 1  # minutes, as QMQ's default
BUCKET_NAME_LENGTH = 12  # yyyyMMddHHmm

_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)
# Names have four year digits: buckets exist from the epoch to the last minute of 9999.
MAX_BUCKET_START_MS = int(
    (_dt.datetime(9999, 12, 31, 23, 59, tzinfo=_dt.UTC) - _EPOCH).total_seconds() * 1000
)


def check_segment_scale(segment_scale: int) -> int:
    """``segment_scale`` (minutes) when it is an int in 1..60; ValueError otherwise."""
    if (
        isinstance(segment_scale, bool)
        or not isinstance(segment_scale, int)
        or not MIN_SEGMENT_SCALE <= segment_scale <= MAX_SEGMENT_SCALE
    ):
        raise ValueError(
            f"segment_scale must be a whole number of minutes in "
            f"{MIN_SEGMENT_SCALE}..{MAX_SEGMENT_SCALE}, got {segment_scale!r}"
        )
    return segment_scale


def bucket_width_ms(segment_scale: int) -> int:
    """The width of a bucket in milliseconds. Raises ValueError for a bad scale."""
    return check_segment_scale(segment_scale) * MS_PER_MINUTE


def bucket_of(due_ms: int, segment_scale: int) -> int:
    """The start (epoch ms) of the bucket holding ``due_ms`` (epoch ms).

    Python's ``%`` floors, so times before the epoch also fall in the bucket that starts
    at or before them. Raises ValueError for a bad scale.
    """
    return due_ms - due_ms % bucket_width_ms(segment_scale)


@functools.lru_cache(maxsize=4096)  # the sender and the replayer name a bucket per batch
def bucket_name(start_ms: int) -> str:
    """The file name of the bucket starting at ``start_ms``: its UTC ``yyyyMMddHHmm``.

    Raises ValueError unless ``start_ms`` is a whole minute between the epoch and the
    year 9999 (a name has exactly 12 digits).
    """
    if not 0 <= start_ms <= MAX_BUCKET_START_MS or start_ms % MS_PER_MINUTE:
        raise ValueError(
            f"a bucket starts on a whole minute between 1970 and 9999; got {start_ms} ms"
        )
    moment = _EPOCH + _dt.timedelta(milliseconds=start_ms)
    return f"{moment:%Y%m%d%H%M}"


def parse_bucket_name(name: str) -> int:
    """The start (epoch ms) of the bucket named ``name``; the inverse of bucket_name.

    Raises ValueError unless ``name`` is 12 ASCII digits forming a real UTC date and time
    (``202613011200`` has no month 13).
    """
    if len(name) != BUCKET_NAME_LENGTH or not (name.isascii() and name.isdigit()):
        raise ValueError(f"bucket names are 12 digits, yyyyMMddHHmm; got {name!r}")
    try:
        moment = _dt.datetime(
            int(name[0:4]),
            int(name[4:6]),
            int(name[6:8]),
            int(name[8:10]),
            int(name[10:12]),
            tzinfo=_dt.UTC,
        )
    except ValueError as exc:
        raise ValueError(f"bucket name {name!r} is not a valid UTC time: {exc}") from None
    start_ms = (moment - _EPOCH) // _dt.timedelta(milliseconds=1)
    if start_ms < 0:
        raise ValueError(f"bucket name {name!r} is before the epoch")
    return start_ms


def is_bucket_name(name: str) -> bool:
    """Whether ``name`` is a bucket file name (other files may share the directory)."""
    try:
        parse_bucket_name(name)
    except ValueError:
        return False
    return True


def bucket_starts(names: Iterable[str]) -> list[int]:
    """The starts (epoch ms) of the bucket files among ``names`` (a directory's
    listing), ascending; any other file in the directory is left out."""
    starts = []
    for name in names:
        try:
            starts.append(parse_bucket_name(name))
        except ValueError:
            continue
    return sorted(starts)
