"""The files of a data directory's three logs, with their sizes when listed.

``delayd inspect`` and the audit list what they read here. A reader reads each file up
to the size recorded here, never further: a file that a running server is still
appending to is read as a snapshot. Paths come from delayd.logs.layout, names are told
apart with the logs' own rules (bucket names, segment names), and anything else in a log
directory (a recovery checkpoint, a temp file) is not a log file.

Each file also carries what storage.torn_tail needs to judge an invalid frame in it as
recovery would: where its log ends and what is known durable. For message_log that is
the end of the last segment and the log's recovery checkpoint (SegmentedLog.open scans
from there). A bucket file is a log of its own. The server opens a dispatch_log file
from its start (trusted_end 0); a schedule_log file from the length the replayer's
recovery trusts when records after its checkpoint map to the bucket, and at its full
length otherwise, which recovery never cuts. That knowledge is the replayer's
(delayd.replay.recovery.scanned_buckets): callers pass it in as ``scanned``; without it
a schedule_log file is judged as one opened from its start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from delayd.logs import layout
from delayd.logs.buckets import parse_bucket_name
from storage.errors import CorruptionError
from storage.fs import O_READ, REAL_FS, FileSystem
from storage.segmented_log import is_segment_name, read_recovery_checkpoint
from storage.torn_tail import is_torn_tail

SCHEDULE_LOG = layout.SCHEDULE_LOG
DISPATCH_LOG = layout.DISPATCH_LOG
MESSAGE_LOG = layout.MESSAGE_LOG
LOGS = (SCHEDULE_LOG, DISPATCH_LOG, MESSAGE_LOG)


@dataclass(frozen=True, slots=True)
class LogFile:
    """One file of a log: up to ``size`` bytes of ``path``. ``base`` is the logical
    offset of its first byte (a message_log segment's name; 0 for a bucket file) and
    ``bucket_ms`` the bucket's UTC start (None for a segment). ``log_end`` is the
    logical end of the whole log this file belongs to and ``durable_end`` the offset
    below which that log is known durable (the module docstring says why)."""

    path: str
    size: int
    base: int = 0
    bucket_ms: int | None = None
    log_end: int | None = None  # None: the end of this file
    durable_end: int = 0

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def is_torn_tail(self, position: int) -> bool:
        """Whether a first invalid frame at byte ``position`` of this file is a torn
        tail that recovery would cut, not corruption (storage.torn_tail)."""
        log_end = self.base + self.size if self.log_end is None else self.log_end
        return is_torn_tail(self.base + position, log_end, durable_end=self.durable_end)


def log_dir(data_dir: str, log: str) -> str:
    """The directory of ``log`` (one of LOGS) in ``data_dir``."""
    if log == SCHEDULE_LOG:
        return layout.schedule_log_dir(data_dir)
    if log == DISPATCH_LOG:
        return layout.dispatch_log_dir(data_dir)
    if log == MESSAGE_LOG:
        return layout.message_log_dir(data_dir)
    raise ValueError(f"unknown log {log!r}; one of {', '.join(LOGS)}")


def file_size(fs: FileSystem, path: str) -> int:
    """The size of the file at ``path`` now. Raises OSError when it cannot be opened."""
    fd = fs.open(path, O_READ)
    try:
        return fs.fsize(fd)
    finally:
        fs.close(fd)


def list_files(
    data_dir: str,
    log: str,
    fs: FileSystem = REAL_FS,
    scanned: Mapping[int, int] | None = None,
) -> list[LogFile]:
    """The files of ``log`` in ``data_dir``, in name order (time order for buckets,
    offset order for segments). ``scanned``: for schedule_log, the buckets recovery
    would scan and where it starts (module docstring). A log directory that does not
    exist yet has no files (a server that has delivered nothing has no dispatch_log); a
    data directory that does not exist raises FileNotFoundError."""
    if not fs.exists(layout.delay_dir(data_dir)):
        raise FileNotFoundError(f"{data_dir} is not a delayd data directory (no delay/ in it)")
    directory = log_dir(data_dir, log)
    if not fs.exists(directory):
        return []
    names = sorted(fs.listdir(directory))
    if log == MESSAGE_LOG:
        return _segments(fs, directory, [name for name in names if is_segment_name(name)])
    files = []
    for name in names:
        try:
            bucket_ms = parse_bucket_name(name)
        except ValueError:
            continue
        files.append(_bucket(os.path.join(directory, name), log, bucket_ms, fs, scanned))
    return files


def bucket_file(
    data_dir: str,
    log: str,
    name: str,
    fs: FileSystem = REAL_FS,
    scanned: Mapping[int, int] | None = None,
) -> LogFile | None:
    """The file of bucket ``name`` (a bucket name) in ``log`` (schedule_log or
    dispatch_log) of ``data_dir``, or None when that bucket has none; ``scanned`` as for
    list_files. Raises ValueError for a name that is not a bucket's."""
    bucket_ms = parse_bucket_name(name)
    path = os.path.join(log_dir(data_dir, log), name)
    if not fs.exists(path):
        return None
    return _bucket(path, log, bucket_ms, fs, scanned)


def _bucket(
    path: str, log: str, bucket_ms: int, fs: FileSystem, scanned: Mapping[int, int] | None
) -> LogFile:
    size = file_size(fs, path)
    durable_end = 0
    if log == SCHEDULE_LOG and scanned is not None:
        durable_end = scanned.get(bucket_ms, size)
    return LogFile(path, size, bucket_ms=bucket_ms, durable_end=durable_end)


def _segments(fs: FileSystem, directory: str, names: list[str]) -> list[LogFile]:
    sized = [(int(name), os.path.join(directory, name)) for name in names]
    sizes = [file_size(fs, path) for _, path in sized]
    if not sized:
        return []
    log_end = sized[-1][0] + sizes[-1]
    try:
        durable_end = read_recovery_checkpoint(fs, directory) or 0
    except CorruptionError:
        durable_end = 0  # recovery refuses the log then; judge the frames as if unknown
    return [
        LogFile(path, size, base=base, log_end=log_end, durable_end=durable_end)
        for (base, path), size in zip(sized, sizes, strict=True)
    ]


def total_bytes(data_dir: str, fs: FileSystem = REAL_FS) -> int:
    """Bytes in message_log, schedule_log and dispatch_log: the work of a full scan."""
    return sum(file.size for log in LOGS for file in list_files(data_dir, log, fs))
