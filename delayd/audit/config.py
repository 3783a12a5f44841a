"""What one audit run is asked to do, and the command-line arguments that say it.

Shared by ``delayd audit`` (command.py) and ``spark-submit tools/audit_job.py``, so both
take the same arguments. Pure Python: parsing arguments needs no Spark.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

from delayd.audit.kinds import HEAD, VERIFY_MODES
from delayd.audit.read.partitions import DEFAULT_PARTITION_BYTES
from delayd.client.send_command import parse_duration_ms, parse_utc_ms

DEFAULT_GRACE_MS = 60_000
DEFAULT_LATE_MS = 5_000

EXIT_CLEAN = 0  # nothing found
EXIT_DISCREPANCIES = 1  # discrepancies or corrupt records found: alert
EXIT_FAILED = 2  # the audit could not run (bad arguments, missing directory, Spark error)


@dataclass(frozen=True, slots=True)
class Server:
    """One delay server's data directory and the name its rows carry (``server``)."""

    name: str
    data_dir: str


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


def parse_server(text: str) -> Server:
    """``DIR`` or ``NAME=DIR``; the name defaults to the directory as given."""
    name, sep, data_dir = text.partition("=")
    if not sep or os.sep in name:
        name, data_dir = text.rstrip(os.sep) or text, text
    if not name or not data_dir:
        raise argparse.ArgumentTypeError(f"{text!r} is not DIR or NAME=DIR")
    return Server(name, data_dir)


def parse_as_of(text: str) -> int:
    """Epoch milliseconds (all digits) or an ISO-8601 time with a UTC offset."""
    stripped = text.strip()
    if stripped.isdigit():
        return int(stripped)
    return parse_utc_ms(stripped)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The audit's arguments, on ``parser``."""
    parser.add_argument(
        "--data",
        action="append",
        required=True,
        type=parse_server,
        metavar="[NAME=]DIR",
        help="a delay server's data directory (repeat to audit several servers as one); "
        "rows carry NAME, by default DIR",
    )
    parser.add_argument("--out", required=True, help="directory for the Parquet tables and report")
    parser.add_argument(
        "--as-of",
        type=parse_as_of,
        default=None,
        metavar="TIME",
        help="judge the logs as of this time: ISO-8601 UTC (2026-11-22T10:00:00Z) or epoch "
        "ms (default: now)",
    )
    parser.add_argument(
        "--grace",
        type=parse_duration_ms,
        default=DEFAULT_GRACE_MS,
        metavar="DURATION",
        help="a message due less than this before --as-of is not yet overdue (default 60s)",
    )
    parser.add_argument(
        "--late-after",
        type=parse_duration_ms,
        default=DEFAULT_LATE_MS,
        metavar="DURATION",
        help="a dispatch more than this after its due time is late (default 5s)",
    )
    parser.add_argument(
        "--verify",
        choices=VERIFY_MODES,
        default=HEAD,
        help="head: decode what the audit needs (default); full: decode every record "
        "with the codec, properties included (slower)",
    )


def config_from_args(args: argparse.Namespace) -> AuditConfig:
    """The AuditConfig of parsed arguments. Raises ValueError when two directories
    would carry the same server name."""
    names = [server.name for server in args.data]
    if len(set(names)) != len(names):
        raise ValueError(f"two --data directories have the same name: {sorted(names)}")
    as_of_ms = args.as_of if args.as_of is not None else int(time.time() * 1000)
    return AuditConfig(
        servers=tuple(args.data),
        out=args.out,
        as_of_ms=as_of_ms,
        grace_ms=args.grace,
        late_ms=args.late_after,
        verify=args.verify,
    )
