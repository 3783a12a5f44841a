"""Bucket retirements: message_log records of type RETIRE_BUCKET, and the deletion of a
bucket's files that their replay performs.

Retention on a group's leader (delayd.server.retention) decides that a bucket is done
and old enough; instead of deleting its files it appends a retirement to message_log,
replicated and acknowledged like any record. Every member deletes the bucket's
schedule_log and dispatch_log files when its replayer reaches the record, so the
deletion happens at the same message_log position everywhere: the replay of a
RESCHEDULE after it finds no record to copy on any member, before it on every member
(docs/replication.md, "Retention in a group").

Payload (little-endian, under the storage frame's CRC like every record)::

    retire_bucket := start_ms:i64 schedule_bytes:u64 receive_ms:i64      (type 6)

``start_ms`` names the bucket; ``schedule_bytes`` is its schedule_log file's length
when the leader found it complete. A replay deletes the bucket only while the file
still has that length: a record appended to the bucket after the leader decided (a
clock set back) makes the file longer on every member alike, and every member then
keeps it (a later pass retires it again). ``receive_ms`` dates the record, as a
message's does, for message_log retention.
"""

from __future__ import annotations

import contextlib
import os
import struct
from dataclasses import dataclass

from delayd.logs import layout
from delayd.logs.buckets import bucket_name
from delayd.logs.message_log import RecordFormatError
from storage.fs import FileSystem

RETIREMENT = struct.Struct("<qQq")
RETIREMENT_SIZE = RETIREMENT.size  # 8 + 8 + 8 = 24: start_ms, schedule_bytes, receive_ms
assert RETIREMENT_SIZE == 8 + 8 + 8


@dataclass(frozen=True, slots=True)
class Retirement:
    """A decoded RETIRE_BUCKET record; see the module docstring. Times in epoch ms."""

    start_ms: int
    schedule_bytes: int
    receive_ms: int


def encode(retirement: Retirement) -> bytes:
    """The payload of ``retirement`` (its frame type is TYPE_RETIRE_BUCKET)."""
    return RETIREMENT.pack(retirement.start_ms, retirement.schedule_bytes, retirement.receive_ms)


def decode(payload: bytes | memoryview) -> Retirement:
    """The Retirement of a RETIRE_BUCKET payload. Raises RecordFormatError."""
    if len(payload) != RETIREMENT_SIZE:
        raise RecordFormatError(
            f"a bucket retirement has {RETIREMENT_SIZE} bytes, this record has {len(payload)}"
        )
    return Retirement(*RETIREMENT.unpack_from(payload))


def delete_bucket_files(fs: FileSystem, data_dir: str, starts: list[int]) -> None:
    """Delete the schedule_log and dispatch_log files of the buckets ``starts`` (epoch
    ms): the schedule_log files first, a directory fsync, then the dispatch_log files
    and theirs. A crash in between leaves dispatch_log files without a schedule_log
    file, which retention's ``remove_orphans`` deletes at the next start — never a
    schedule_log file without the dispatch_log that says it was delivered (which
    would send it all again). Files already gone are fine (a replay after a crash).
    Every descriptor of the files must be closed first (blocking)."""
    if not starts:
        return
    for directory in (layout.schedule_log_dir(data_dir), layout.dispatch_log_dir(data_dir)):
        for start_ms in starts:
            with contextlib.suppress(FileNotFoundError):
                fs.unlink(os.path.join(directory, bucket_name(start_ms)))
        if fs.exists(directory):
            fs.fsync_dir(directory)
