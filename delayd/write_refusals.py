"""Which logs refuse writes because their disk is full, and why.

A full disk is an answer, not a crash (docs/operations.md, "A full disk"): a log whose
append fails with ENOSPC or EDQUOT cuts the refused append back and raises
DiskFullError; its writer answers DISK_FULL (intake), or waits and tries again (the
replayer, the sender's dispatch_log entries, the broker's checkpoints), and reports it
here. /readyz reads ``reason`` (not ready while any log refuses) and
``delayd_store_refusing_writes{log}`` reads ``refusing``. A log is cleared when a write
to it succeeds again, or when the free-space monitor sees room again
(delayd.serving.store_metrics.FreeSpace), whichever comes first.

Log names are a fixed set, so the metric's labels stay bounded.
"""

from __future__ import annotations

import logging

from storage.errors import DiskFullError

log = logging.getLogger(__name__)

MESSAGE_LOG = "message_log"
SCHEDULE_LOG = "schedule_log"
DISPATCH_LOG = "dispatch_log"
BROKER_COMMITLOG = "broker_commitlog"
CHECKPOINT = "checkpoint"  # replay and broker checkpoints, the broker's derived files
LOGS = (MESSAGE_LOG, SCHEDULE_LOG, DISPATCH_LOG, BROKER_COMMITLOG, CHECKPOINT)


class WriteRefusals:
    """The logs refusing writes now, each with the DiskFullError that says why.

    One per process, shared by everything that writes (the delay server hands its
    own to the embedded broker). Synchronous, event loop only.
    """

    def __init__(self) -> None:
        self._errors: dict[str, DiskFullError] = {}
        self.refused_total = dict.fromkeys(LOGS, 0)  # refused writes, by log

    def refuse(self, log_name: str, error: DiskFullError) -> None:
        """``log_name`` refused a write with ``error``; logged once per episode."""
        if log_name not in self.refused_total:
            raise ValueError(f"unknown log {log_name!r}; expected one of {LOGS}")
        self.refused_total[log_name] += 1
        if log_name not in self._errors:
            log.error("%s refuses writes: %s", log_name, error)
        self._errors[log_name] = error

    def clear(self, log_name: str) -> None:
        """A write to ``log_name`` succeeded: it takes writes again."""
        if self._errors.pop(log_name, None) is not None:
            log.warning("%s takes writes again: space returned", log_name)

    def clear_all(self) -> None:
        """Space returned (the free-space monitor says so): every log may write again;
        one that still cannot will refuse again at its next write."""
        for log_name in list(self._errors):
            self.clear(log_name)

    def refusing(self, log_name: str) -> bool:
        return log_name in self._errors

    @property
    def any(self) -> bool:
        return bool(self._errors)

    def reason(self) -> str | None:
        """Why the process is not ready, or None when no log refuses writes:
        ``disk full: <log> ...`` naming the directory and its free bytes."""
        if not self._errors:
            return None
        log_name, error = next(iter(self._errors.items()))
        free = "unknown" if error.free_bytes is None else f"{error.free_bytes}"
        others = f" (and {len(self._errors) - 1} more logs)" if len(self._errors) > 1 else ""
        where = f"{error.directory} has {free} bytes free"
        return f"disk full: {log_name} refuses writes{others}; {where}"
