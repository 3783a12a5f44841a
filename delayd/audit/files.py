"""The files of a data directory's three logs, with their sizes when listed.

A reader reads each file up to the size recorded here, never further: a file that a
running server is still appending to is read as a snapshot. Paths come from
delayd.logs.layout, names are told apart with the logs' own rules (bucket names,
segment names), and anything else in a log directory (a recovery checkpoint, a temp
file) is not a log file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol, TypeVar

from delayd.logs import layout
from delayd.logs.buckets import parse_bucket_name
from storage.segmented_log import is_segment_name

SCHEDULE_LOG = "schedule_log"
DISPATCH_LOG = "dispatch_log"
MESSAGE_LOG = "message_log"
LOGS = (SCHEDULE_LOG, DISPATCH_LOG, MESSAGE_LOG)
DEFAULT_PARTITION_BYTES = 64 << 20  # see pack()


@dataclass(frozen=True, slots=True)
class LogFile:
    """One file to read: up to ``size`` bytes of ``path``. ``base`` is the logical
    offset of its first byte (a message_log segment's name; 0 for a bucket file) and
    ``bucket_ms`` the bucket's UTC start (None for a segment)."""

    path: str
    size: int
    base: int = 0
    bucket_ms: int | None = None

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


def log_dir(data_dir: str, log: str) -> str:
    """The directory of ``log`` (one of LOGS) in ``data_dir``."""
    if log == SCHEDULE_LOG:
        return layout.schedule_log_dir(data_dir)
    if log == DISPATCH_LOG:
        return layout.dispatch_log_dir(data_dir)
    if log == MESSAGE_LOG:
        return layout.message_log_dir(data_dir)
    raise ValueError(f"unknown log {log!r}; one of {', '.join(LOGS)}")


def list_files(data_dir: str, log: str) -> list[LogFile]:
    """The files of ``log`` in ``data_dir``, in name order (time order for buckets,
    offset order for segments). A log directory that does not exist yet has no files
    (a server that has delivered nothing has no dispatch_log); a data directory that
    does not exist raises FileNotFoundError."""
    if not os.path.isdir(layout.delay_dir(data_dir)):
        raise FileNotFoundError(f"{data_dir} is not a delayd data directory (no delay/ in it)")
    directory = log_dir(data_dir, log)
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    files = []
    for name in names:
        path = os.path.join(directory, name)
        if log == MESSAGE_LOG:
            if not is_segment_name(name):
                continue
            files.append(LogFile(path, os.path.getsize(path), base=int(name)))
        else:
            try:
                bucket_ms = parse_bucket_name(name)
            except ValueError:
                continue
            files.append(LogFile(path, os.path.getsize(path), bucket_ms=bucket_ms))
    return files


class _Sized(Protocol):
    @property
    def size(self) -> int: ...


Part = TypeVar("Part", bound=_Sized)  # a LogFile, or a bucket's pair of them (pairs.py)


def pack(log_files: list[Part], target_bytes: int) -> list[list[Part]]:
    """Group consecutive files into partitions of about ``target_bytes`` (a file is
    never split; a bigger file is a partition of its own). 0 gives one partition per
    file.

    Spark's own file sources pack small files the same way
    (``spark.sql.files.maxPartitionBytes``): a Python data source task costs tens of
    milliseconds before it reads a byte, and a bucket file of a quiet minute holds a few
    kilobytes.
    """
    if target_bytes <= 0:
        return [[file] for file in log_files]
    groups: list[list[Part]] = []
    current: list[Part] = []
    current_bytes = 0
    for file in log_files:
        if current and current_bytes + file.size > target_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(file)
        current_bytes += file.size
    if current:
        groups.append(current)
    return groups
