"""Files packed into the input partitions of the audit's data sources.

The files themselves, with their sizes, are listed by delayd.logs.log_files.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

DEFAULT_PARTITION_BYTES = 64 << 20  # see pack()
# The least split_bytes() makes a partition, as Spark's spark.sql.files.openCostInBytes:
# below it a task costs more to start than to read its files.
MIN_SPLIT_BYTES = 4 << 20


class _Sized(Protocol):
    @property
    def size(self) -> int: ...


Part = TypeVar("Part", bound=_Sized)  # a LogFile, or a bucket's pair of them (judge/pairing.py)


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


def split_bytes(files: list[Part], target_bytes: int, min_partitions: int) -> int:
    """The partition size to pack ``files`` at: ``target_bytes``, or less when that
    would leave fewer than ``min_partitions`` partitions (the cores there are to read
    them), but not below MIN_SPLIT_BYTES — Spark's own rule for its file sources
    (``FilePartition.maxSplitBytes``). 0 stays 0: a partition per file."""
    if target_bytes <= 0 or min_partitions <= 1:
        return target_bytes
    per_core = -(-sum(file.size for file in files) // min_partitions)
    return min(target_bytes, max(MIN_SPLIT_BYTES, per_core))
