"""Scanning one log file offline: storage's scanner, plus a verdict on where it stopped.

The server decides at open what an invalid frame means and then never sees it again.
Offline nothing is cut, so the audit says what it found, by the rule recovery applies
(storage.torn_tail, with what delayd.logs.log_files knows of the file's log):

* ``torn_tail`` — what recovery would cut: the frame lies at or after what the log knows
  durable and within the unsynced window of the log's end. A crash leaves this; so does
  a server still writing the record.
* ``corrupt`` — any other invalid frame, or bytes after an END_OF_SEGMENT marker that
  the same rule does not call torn.

Either way reading that file stops there: a framed log has no sync markers, so past a
bad length nothing can be trusted to be a record boundary (leveldb's log has blocks to
resync on; this format does not). The problem is reported with the file and the byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from delayd.audit.kinds import CORRUPT, TORN_TAIL
from delayd.logs.log_files import LogFile
from storage.framing import HEADER_SIZE
from storage.fs import O_READ, REAL_FS
from storage.scan import BadFrame, scan_frames


@dataclass(frozen=True, slots=True)
class Problem:
    """Where and why reading a file stopped, or a record that could not be decoded.
    ``position`` is the byte in the file; ``kind`` one of kinds.PROBLEMS."""

    kind: str
    position: int
    detail: str


class FileScan:
    """One file scanned with storage.scan.scan_frames, the server's parser.

    A context manager (it holds the file open). Iterate ``frames`` — scan_frames itself,
    not a wrapper around it: that loop runs once per record of every file audited —
    catching BadFrame; then ask ``stopped(bad)`` or, after a loop that ran out,
    ``finished(next_offset)`` (the last record's, or the file's base) for the problem,
    if any.
    """

    def __init__(self, file: LogFile) -> None:
        self.file = file

    def __enter__(self) -> FileScan:
        file = self.file
        self.fd = REAL_FS.open(file.path, O_READ)
        self.frames = scan_frames(REAL_FS, self.fd, file.path, file.base, 0, file.size)
        return self

    def __exit__(self, *exc_info: object) -> None:
        REAL_FS.close(self.fd)

    def stopped(self, bad: BadFrame) -> Problem:
        """The problem at the frame the scan could not read."""
        return verdict(self.file, bad)

    def finished(self, next_offset: int) -> Problem | None:
        """The problem, if any, of a scan that ran out at ``next_offset``. scan_frames
        stops early only at an END_OF_SEGMENT marker: bytes after it are corruption."""
        marker = next_offset - self.file.base
        after = marker + HEADER_SIZE  # the marker has no payload
        if marker >= self.file.size or after >= self.file.size:
            return None
        return Problem(
            TORN_TAIL if self.file.is_torn_tail(after) else CORRUPT,
            after,
            f"{self.file.size - after} bytes after the end-of-segment marker at byte {marker}",
        )


def verdict(file: LogFile, bad: BadFrame) -> Problem:
    """torn_tail or corrupt for the invalid frame ``bad`` of ``file`` (see the module
    docstring)."""
    if file.is_torn_tail(bad.position):
        rest = file.size - bad.position
        return Problem(TORN_TAIL, bad.position, f"{bad.reason} ({rest} bytes to the end)")
    return Problem(CORRUPT, bad.position, f"{bad.reason} ({bad.length} bytes affected)")
