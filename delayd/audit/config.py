"""What one audit run is asked to do, and its exit statuses.

``delayd audit`` and ``spark-submit tools/audit_job.py`` build it from the same
arguments (delayd/cli/audit.py). Pure Python: it needs no Spark.
"""

from __future__ import annotations

from dataclasses import dataclass

from delayd.audit.kinds import HEAD
from delayd.audit.read.partitions import DEFAULT_PARTITION_BYTES

DEFAULT_GRACE_MS = 60_000
DEFAULT_LATE_MS = 5_000

EXIT_CLEAN = 0  # nothing found
EXIT_DISCREPANCIES = 1  # discrepancies or corrupt records found: alert
EXIT_FAILED = 2  # the audit could not run (bad arguments, missing directory, Spark error)


@dataclass(frozen=True, slots=True)
class Server:
    """One delay server's data directory — of a group, the one copy the audit reads
    (groups.py) — and the name its rows carry (``server``: the group's name). ``copy``
    says which copy of the group's logs this is and why it was chosen ("" for a lone
    ``--data`` directory)."""

    name: str
    data_dir: str
    copy: str = ""


@dataclass(frozen=True, slots=True)
class AuditConfig:
    """One audit. Times are epoch milliseconds, UTC; durations milliseconds.

    A record due before ``as_of_ms - grace_ms`` with no entry is overdue; a dispatch
    more than ``late_ms`` after its due time is late. Entries and message_log records
    newer than ``as_of_ms - grace_ms`` are not judged (a live server may be writing
    them while the audit reads).
    """

    servers: tuple[Server, ...]
    out: str
    as_of_ms: int
    grace_ms: int = DEFAULT_GRACE_MS
    late_ms: int = DEFAULT_LATE_MS
    verify: str = HEAD
    partition_bytes: int = DEFAULT_PARTITION_BYTES

    @property
    def cutoff_ms(self) -> int:
        """Due times and entries before this are judged; later ones are in flight."""
        return self.as_of_ms - self.grace_ms
