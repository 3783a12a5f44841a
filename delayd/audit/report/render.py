"""The readable report of an audit: a table for the console and a self-contained HTML
page (tables and the chart of chart.py), both from an AuditResult.

Times are shown in UTC; bucket starts as ``yyyy-mm-dd HH:MM``. The console lists every
bucket when there are few, otherwise the buckets with findings; the HTML page lists
them all. Both end with the verdict the exit status repeats.
"""

from __future__ import annotations

import datetime as _dt
import os
from html import escape
from typing import Any

from delayd.audit.report import chart
from delayd.audit.report.result import ERROR, AuditResult

CONSOLE_BUCKETS = 30
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)

# (summary column, console header, HTML header)
COLUMNS = [
    ("scheduled", "sched", "scheduled"),
    ("dispatched", "disp", "dispatched"),
    ("duplicate_dispatch", "dup", "dispatched twice (by offset)"),
    ("duplicate_by_id", "dupid", "dispatched twice (by id)"),
    ("overdue", "overdue", "overdue, not dispatched"),
    ("unverified", "unver", "unverified"),
    ("late", "late", "late"),
    ("early", "early", "early"),
    ("unknown_record", "unkn", "unknown record"),
    ("dispatched_after_cancel", "sentcanc", "sent after cancel"),
    ("cancelled_after_dispatch", "cancsent", "cancelled after sent"),
    ("copy_missing", "nocopy", "moved, copy missing"),
    ("duplicate_send", "sent2", "id sent again (later sends)"),
    ("cancelled_id_delivered", "cancdel", "delivered, id answered CANCELLED"),
    ("dead_lettered", "dead", "dead-lettered"),
    ("cancelled", "canc", "cancelled"),
    ("rescheduled", "moved", "rescheduled (moved away)"),
    ("pending", "pend", "pending"),
    ("lateness_p50_ms", "p50ms", "lateness p50 ms"),
    ("lateness_p99_ms", "p99ms", "lateness p99 ms"),
    ("lateness_max_ms", "maxms", "lateness max ms"),
]
FINDING_COLUMNS = (
    "duplicate_dispatch",
    "duplicate_by_id",
    "overdue",
    "unverified",
    "late",
    "early",
    "unknown_record",
    "dispatched_after_cancel",
    "cancelled_after_dispatch",
    "copy_missing",
    "duplicate_send",
    "cancelled_id_delivered",
)


def utc(ms: int | None, *, seconds: bool = False) -> str:
    """Epoch ms as UTC text: ``2026-11-22 10:00`` (or with seconds and ms)."""
    if ms is None:
        return ""
    moment = _EPOCH + _dt.timedelta(milliseconds=ms)
    if seconds:
        return f"{moment:%Y-%m-%d %H:%M:%S}.{ms % 1000:03d}"
    return f"{moment:%Y-%m-%d %H:%M}"


def _duration(ms: int) -> str:
    return f"{ms / 1000:g}s"


def _has_findings(row: dict[str, Any]) -> bool:
    return any(row.get(name) for name in FINDING_COLUMNS)


def _label(row: dict[str, Any]) -> tuple[str, str]:
    server = "(all)" if row["server"] is None else row["server"]
    bucket = "(all)" if row["bucket_ms"] is None else utc(row["bucket_ms"])
    return server, bucket


def _cell(value: Any) -> str:
    return "" if value is None else str(value)


def headline(result: AuditResult) -> str:
    config = result.config
    buckets = len(result.bucket_rows())
    return (
        f"delayd audit as of {utc(config.as_of_ms, seconds=True)} UTC "
        f"(grace {_duration(config.grace_ms)}, late after {_duration(config.late_ms)}): "
        f"{len(config.servers)} server(s), {buckets} bucket(s), {result.seconds:.1f} s"
    )


def copies_read(result: AuditResult) -> list[str]:
    """Which copy of each group's logs was read, and why (groups.py), for the groups
    that had a choice or came from etcd."""
    return [f"{s.name}: read {s.copy}" for s in result.config.servers if s.copy]


def verdict(result: AuditResult) -> str:
    total = result.total_row() or {}
    if result.clean and not total.get("scheduled"):
        return "RESULT: clean - no scheduled messages were found"
    if result.clean:
        withdrawn = (total.get("cancelled") or 0) + (total.get("rescheduled") or 0)
        also = " or withdrawn (cancelled, moved) and not sent" if withdrawn else ""
        return f"RESULT: clean - every scheduled message judged was dispatched once, on time{also}"
    return f"RESULT: {result.errors} discrepancies (see {result.config.out})"


def _findings_text(result: AuditResult) -> list[str]:
    lines = []
    errors = sorted((k, n) for (k, s), n in result.counts.items() if s == ERROR)
    notices = sorted((k, n) for (k, s), n in result.counts.items() if s != ERROR)
    problems = sorted((f"{k} ({s})", n) for (k, s), n in result.problem_counts.items())
    lines.append("findings: " + (", ".join(f"{k} {n}" for k, n in errors) or "none"))
    if notices:
        lines.append("notices: " + ", ".join(f"{k} {n}" for k, n in notices))
    lines.append("corrupt records: " + (", ".join(f"{k} {n}" for k, n in problems) or "none"))
    total = result.total_row() or {}
    if result.message_log_checked:
        lines.append(
            f"message_log: {total.get('message_log_records') or 0} messages checked "
            f"(and {total.get('message_log_cancels') or 0} cancel, "
            f"{total.get('message_log_reschedules') or 0} reschedule tombstones), "
            f"{total.get('not_scheduled') or 0} not in schedule_log, "
            f"{total.get('scheduled_twice') or 0} in it more often than they can be, "
            f"{total.get('message_unverified') or 0} unverified"
        )
    else:
        lines.append("message_log: none left to check (deleted by retention?)")
    return lines


def console(result: AuditResult) -> str:
    """The report as plain text for a terminal."""
    rows = result.bucket_rows()
    shown = rows if len(rows) <= CONSOLE_BUCKETS else [r for r in rows if _has_findings(r)]
    hidden = len(rows) - len(shown[:CONSOLE_BUCKETS])
    shown = shown[:CONSOLE_BUCKETS]
    totals = result.server_rows() if len(result.config.servers) > 1 else []
    total = result.total_row()
    table = [_label(r) + tuple(_cell(r.get(c)) for c, _, _ in COLUMNS) for r in shown]
    table += [_label(r) + tuple(_cell(r.get(c)) for c, _, _ in COLUMNS) for r in totals]
    if total is not None:
        table.append(_label(total) + tuple(_cell(total.get(c)) for c, _, _ in COLUMNS))
    header = ("server", "bucket (UTC)", *(h for _, h, _ in COLUMNS))
    widths = [max(len(str(row[i])) for row in [header, *table]) for i in range(len(header))]
    widths[0] = min(widths[0], 24)

    def line(row: tuple) -> str:
        left = f"{str(row[0])[: widths[0]]:<{widths[0]}}  {row[1]:<{widths[1]}}"
        return left + "".join(f" {row[i]:>{widths[i]}}" for i in range(2, len(row)))

    lines = [headline(result), *copies_read(result), "", line(header)]
    lines += [line(row) for row in table]
    if hidden:
        lines.append(f"({hidden} more buckets without findings: summary/ and report.html)")
    lines.append("")
    lines += _findings_text(result)
    if result.discrepancies:
        lines.append("")
        lines.append(f"first {len(result.discrepancies)} findings:")
        for d in result.discrepancies:
            where = (
                f"{d['server']} {utc(d['bucket_ms'])} @{d['offset']}"
                if d["bucket_ms"] is not None
                else f"{d['server']} message_log @{d['message_log_offset']}"
            )
            lines.append(
                f"  {d['kind']:<24} {where}  id={d['message_id']}  "
                f"due {utc(d['due_ms'], seconds=True)}  {d['detail'] or ''}".rstrip()
            )
    if result.problems:
        lines.append("")
        lines.append("corrupt records (reading a file stops at its first bad frame):")
        for p in result.problems:
            lines.append(
                f"  {p['problem']:<9} {p['server']} {p['log']}/{p['file']} @{p['position']}: "
                f"{p['detail']}"
            )
    lines.append("")
    lines.append(verdict(result))
    return "\n".join(lines) + "\n"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(_cell(v))}</td>" for v in row) + "</tr>" for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _chart_columns(result: AuditResult) -> list[chart.Column]:
    """One column per bucket start, over all servers: counts added, lateness the worst
    server's (percentiles of different servers cannot be combined)."""
    by_bucket: dict[int, list[dict[str, Any]]] = {}
    for row in result.bucket_rows():
        by_bucket.setdefault(row["bucket_ms"], []).append(row)
    columns = []
    for bucket_ms in sorted(by_bucket):
        rows = by_bucket[bucket_ms]
        columns.append(
            chart.Column(
                label=utc(bucket_ms),
                scheduled=sum(r["scheduled"] or 0 for r in rows),
                dispatched=sum(r["dispatched"] or 0 for r in rows),
                p50_ms=chart.worst(r["lateness_p50_ms"] for r in rows),
                p99_ms=chart.worst(r["lateness_p99_ms"] for r in rows),
                max_ms=chart.worst(r["lateness_max_ms"] for r in rows),
            )
        )
    return columns


STYLE = """
body { font-family: sans-serif; margin: 2em; color: #1a202c; }
table { border-collapse: collapse; font-size: 12px; margin: 1em 0; }
th, td { border: 1px solid #cbd5e0; padding: 2px 6px; text-align: right; }
th { background: #edf2f7; }
td:first-child, td:nth-child(2) { text-align: left; }
.clean { color: #2f855a; } .dirty { color: #c53030; }
"""


def html(result: AuditResult) -> str:
    """The report as one HTML page with no external assets."""
    verdict_class = "clean" if result.clean else "dirty"
    summary_rows = [
        list(_label(r)) + [r.get(c) for c, _, _ in COLUMNS]
        for r in result.bucket_rows() + result.server_rows() + [result.total_row() or {}]
        if r
    ]
    findings = [
        [
            d["kind"],
            d["severity"],
            d["server"],
            utc(d["bucket_ms"]),
            d["offset"],
            d["message_log_offset"],
            d["message_id"],
            utc(d["due_ms"], seconds=True),
            utc(d["dispatched_ms"], seconds=True),
            d["detail"],
        ]
        for d in result.discrepancies
    ]
    problems = [
        [p["problem"], p["severity"], p["server"], p["log"], p["file"], p["position"], p["detail"]]
        for p in result.problems
    ]
    servers = ", ".join(f"{s.name} = {s.copy or s.data_dir}" for s in result.config.servers)
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>delayd audit</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>delayd audit</h1><p>{escape(headline(result))}</p>",
        f"<p>servers: {escape(servers)}</p>",
        f"<h2 class='{verdict_class}'>{escape(verdict(result))}</h2>",
        "<ul>" + "".join(f"<li>{escape(x)}</li>" for x in _findings_text(result)) + "</ul>",
        chart.svg(_chart_columns(result)),
        "<h2>Per bucket</h2>",
        _table(["server", "bucket (UTC)"] + [h for _, _, h in COLUMNS], summary_rows),
        f"<h2>Findings (first {len(findings)}; all in discrepancies/)</h2>",
        _table(
            [
                "kind",
                "severity",
                "server",
                "bucket",
                "offset",
                "message_log offset",
                "message id",
                "due (UTC)",
                "dispatched (UTC)",
                "detail",
            ],
            findings,
        ),
        f"<h2>Corrupt records (first {len(problems)}; all in corrupt_records/)</h2>",
        _table(["problem", "severity", "server", "log", "file", "position", "detail"], problems),
        "</body></html>",
    ]
    return "\n".join(parts)


def write(result: AuditResult) -> dict[str, str]:
    """report.txt and report.html under the output directory; returns their paths."""
    paths = {
        "report.txt": os.path.join(result.config.out, "report.txt"),
        "report.html": os.path.join(result.config.out, "report.html"),
    }
    os.makedirs(result.config.out, exist_ok=True)
    with open(paths["report.txt"], "w", encoding="utf-8") as file:
        file.write(console(result))
    with open(paths["report.html"], "w", encoding="utf-8") as file:
        file.write(html(result))
    return paths
