"""What an audit run found, in the small form the report and the exit status need.

The Parquet tables under ``--out`` hold everything; this holds the summary rows, the
number of findings of each kind, and the first few findings to show.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from delayd.audit.config import AuditConfig
from delayd.audit.kinds import ERROR, NOTICE  # noqa: F401 - the severities, re-exported

REPORT_ROWS = 50  # findings and corrupt records listed in the report


@dataclass
class AuditResult:
    config: AuditConfig
    summary: list[dict[str, Any]]  # every row of the summary table
    counts: dict[tuple[str, str], int]  # (kind, severity) -> rows in discrepancies
    problem_counts: dict[tuple[str, str], int]  # (problem, severity) -> corrupt_records
    discrepancies: list[dict[str, Any]]  # the first REPORT_ROWS, errors first
    problems: list[dict[str, Any]]  # the first REPORT_ROWS, errors first
    message_log_checked: bool
    seconds: float = 0.0
    paths: dict[str, str] = field(default_factory=dict)

    @property
    def errors(self) -> int:
        """Findings and corrupt records that fail the audit (notices excluded)."""
        tables = (self.counts, self.problem_counts)
        return sum(n for t in tables for (_, severity), n in t.items() if severity == ERROR)

    @property
    def clean(self) -> bool:
        return self.errors == 0

    def bucket_rows(self) -> list[dict[str, Any]]:
        """Summary rows of one bucket of one server, in (server, bucket) order."""
        return [r for r in self.summary if r["server"] is not None and r["bucket_ms"] is not None]

    def total_row(self) -> dict[str, Any] | None:
        """The summary row over every server and bucket."""
        for row in self.summary:
            if row["server"] is None and row["bucket_ms"] is None:
                return row
        return None

    def server_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.summary if r["server"] is not None and r["bucket_ms"] is None]
