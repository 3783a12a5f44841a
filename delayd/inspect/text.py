"""``delayd inspect`` for people: the reports of ``report.py`` as lines of at most 80
columns (longer values are cut with "…"; ``--json`` has them whole)."""

from __future__ import annotations

import datetime as _dt
import os

from delayd.inspect.files import Damage
from delayd.inspect.report import (
    CANCELLED,
    DEAD_LETTERED,
    DISPATCHED,
    NOT_MOVED,
    NOT_REPLAYED,
    OVERDUE,
    RESCHEDULED,
    WAITING,
    CheckpointInfo,
    DispatchReport,
    FindResult,
    FoundMessage,
    Listing,
    MessageRow,
    ScheduleRow,
    Summary,
)
from delayd.logs.buckets import bucket_name
from delayd.logs.dispatch_log import DispatchEntry, EntryKind
from delayd.logs.message_log import MessageRecord
from delayd.wheel.cursor import NO_BUCKET, LoadCursors

WIDTH = 80
PREVIEW_BYTES = 40  # of a body, in record listings
KIND_WORDS = {
    EntryKind.DISPATCHED: "dispatched",
    EntryKind.DEAD_LETTERED: "dead-lettered",
    EntryKind.CANCELLED: "cancelled",
    EntryKind.COMPLETE: "complete",
    EntryKind.RESCHEDULED: "rescheduled",
    EntryKind.NOT_MOVED: "not moved",
    EntryKind.ROUTE: "route set",
    EntryKind.ROUTED: "routed",
}


# ---------------------------------------------------------------- small formats


def iso_ms(ms: int) -> str:
    """``2026-11-22T10:00:00.000Z`` (UTC), or the bare number when it is no date."""
    try:
        moment = _dt.datetime.fromtimestamp(ms / 1000, _dt.UTC)
    except (OverflowError, OSError, ValueError):
        return f"{ms} ms"
    return f"{moment:%Y-%m-%dT%H:%M:%S}.{ms % 1000:03d}Z"


def safe_bucket_name(start_ms: int) -> str:
    """The bucket's file name, or the raw number when no bucket starts there."""
    try:
        return bucket_name(start_ms)
    except ValueError:
        return f"{start_ms} ms"


def duration_ms(ms: int) -> str:
    """``850 ms``, ``12.5 s``, ``3m 20s``, ``5h 2m``, ``2d 3h``."""
    sign, ms = ("-", -ms) if ms < 0 else ("", ms)
    if ms < 1000:
        return f"{sign}{ms} ms"
    if ms < 60_000:
        return f"{sign}{ms / 1000:.1f} s"
    seconds = ms // 1000
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60)):
        if seconds >= size:
            return f"{sign}{seconds // size}{unit} {seconds % size // sub_size}{sub}"
    return f"{sign}{seconds // 60}m {seconds % 60}s"


def fit(line: str, width: int = WIDTH) -> str:
    """``line`` without trailing blanks, cut to ``width`` columns."""
    line = line.rstrip()
    return line if len(line) <= width else line[: width - 1] + "…"


def _n(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _preview(body: bytes) -> str:
    try:
        text = body[:PREVIEW_BYTES].decode()
    except UnicodeDecodeError:
        return "(binary)"
    quoted = repr(text)
    return quoted if len(body) <= PREVIEW_BYTES else quoted[:-1] + "…" + quoted[-1]


def _message_lines(m: MessageRecord, head: str) -> list[str]:
    first = f"{head}  seq {m.sequence}  due {iso_ms(m.due_ms)}"
    first += f"  (+{duration_ms(m.due_ms - m.receive_ms)})"
    second = f"    id {m.message_id}  subject {m.subject}"
    if m.key is not None:
        second += f"  key {m.key}"
    if m.properties:
        second += "  props " + ",".join(f"{k}={v}" for k, v in m.properties.items())
    second += f"  body {len(m.body):,} B {_preview(m.body)}"
    return [fit(first), fit(second)]


def _entry_line(e: DispatchEntry, due_ms: int | None = None) -> str:
    line = f"{KIND_WORDS[e.kind]} {iso_ms(e.at_ms)}"
    if e.group:
        line += f" to group {e.group}" if e.kind is EntryKind.DISPATCHED else f" group {e.group}"
    if due_ms is not None and e.kind is EntryKind.DISPATCHED:
        line += f" ({duration_ms(e.at_ms - due_ms)} after due)"
    return line


def damage_lines(damages: list[Damage], data_dir: str | None = None) -> list[str]:
    """Two lines per damage: what and where, then the reason."""
    lines = []
    for d in damages:
        where = os.path.relpath(d.path, data_dir) if data_dir else d.path
        lines.append(fit(f"  {d.kind:<9}  {where} @ {d.position:,} ({d.length:,} B to the end)"))
        lines.append(fit(f"             {d.reason}"))
    return lines


# ---------------------------------------------------------------- reports


def _cursor_text(cursors: LoadCursors) -> str:
    if cursors.loading.bucket_ms == NO_BUCKET:
        return "nothing loaded yet"
    state = "complete" if cursors.complete else "loading"
    return (
        f"bucket {safe_bucket_name(cursors.loading.bucket_ms)} loaded "
        f"{cursors.loaded.offset:,} of {cursors.loading.offset:,} B ({state})"
    )


def checkpoint_lines(c: CheckpointInfo) -> list[str]:
    lines = [fit(f"checkpoints  {c.directory}")]
    meta = c.meta
    if meta is not None:
        fields = ", ".join(f"{k} {v}" for k, v in sorted(meta.items()))
        lines.append(fit(f"  meta    {fields}"))
    replay = c.replay
    if replay is not None:
        lines.append(
            fit(
                f"  replay  position {replay.position:,}  next_sequence "
                f"{replay.next_sequence:,}  open buckets {len(replay.bucket_sizes)}"
            )
        )
        lines.extend(
            fit(f"          {safe_bucket_name(start)}  {size:,} B")
            for start, size in sorted(replay.bucket_sizes.items())
        )
    if c.wheel is not None:
        lines.append(fit(f"  wheel   {_cursor_text(c.wheel)}"))
    for name in ("meta", "replay", "wheel"):
        if name in c.errors:
            lines.append(fit(f"  {name:<6}  UNREADABLE: {c.errors[name]}"))
        elif getattr(c, name) is None:
            lines.append(f"  {name:<6}  none")
    return lines


def _mark(damaged: bool) -> str:
    """The two columns before a row's name: ``! `` for a file listed under damage."""
    return "! " if damaged else "  "


def summary_lines(s: Summary) -> list[str]:
    lines = [fit(f"data directory {s.data_dir}"), ""]
    total_bytes = sum(x.bytes for x in s.message_log)
    total_records = sum(x.records for x in s.message_log)
    lines.append(
        f"message_log  {len(s.message_log)} segment(s), {total_bytes:,} B, "
        f"{total_records:,} records"
    )
    if s.message_log:
        lines.append(f"  {'segment':<20} {'base offset':>15} {'bytes':>14} {'records':>11}")
        for x in s.message_log:
            lines.append(
                fit(
                    f"{_mark(x.damage is not None)}{x.name:<20} {x.base_offset:>15,} "
                    f"{x.bytes:>14,} {x.records:>11,}{'  sealed' if x.sealed else ''}"
                )
            )
    lines += ["", f"buckets  {len(s.buckets)} (schedule_log and dispatch_log)"]
    if s.buckets:
        lines.append(
            f"  {'bucket':<12} {'bytes':>11} {'records':>9} {'dispatched':>10} {'dead':>5} "
            f"{'cancel':>6} {'undisp':>8} {'complete':>8}"
        )
        for b in s.buckets:
            counts = b.dispatch.entries if b.dispatch else {}
            damaged = b.damage is not None or (
                b.dispatch is not None and b.dispatch.damage is not None
            )
            lines.append(
                fit(
                    f"{_mark(damaged)}{b.name:<12} {_n(b.bytes):>11} {b.records:>9,} "
                    f"{_n(counts.get('dispatched')):>10} {_n(counts.get('dead_lettered')):>5} "
                    f"{_n(counts.get('cancelled')):>6} {b.undispatched:>8,} "
                    f"{'yes' if b.complete else 'no':>8}"
                )
            )
        lines.append("  undisp: schedule records no dispatch_log entry names")
    if s.damages:
        lines.append("  !: a file listed under damage (its records after the damage not counted)")
    lines += ["", *checkpoint_lines(s.checkpoints)]
    damages = s.damages
    lines += ["", f"damage  {len(damages) or 'none'}", *damage_lines(damages, s.data_dir)]
    return lines


def _listing_tail(listing: Listing, what: str, data_dir: str) -> list[str]:
    if listing.next_offset is not None:
        tail = [f"more: --from {listing.next_offset}"]
    else:
        tail = [f"end of {what}"]
    if listing.damages:
        tail += ["damage", *damage_lines(listing.damages, data_dir)]
    return tail


def message_listing_lines(listing: Listing[MessageRow], data_dir: str) -> list[str]:
    lines = [f"message_log from offset {listing.start:,}: {len(listing.rows)} record(s)"]
    for row in listing.rows:
        if row.message is not None:
            lines += _message_lines(row.message, f"@{row.offset}")
        elif row.retired_bucket is not None:
            lines.append(fit(f"@{row.offset}  {row.type}  bucket {row.retired_bucket}"))
        else:
            lines.append(fit(f"@{row.offset}  {row.type}  {row.error or ''}".rstrip()))
    return lines + _listing_tail(listing, "message_log", data_dir)


def bucket_listing_lines(name: str, listing: Listing[ScheduleRow], data_dir: str) -> list[str]:
    lines = [f"schedule_log {name} from offset {listing.start:,}: {len(listing.rows)} record(s)"]
    for row in listing.rows:
        if row.record is None:
            lines.append(fit(f"@{row.offset}  {row.error}"))
            continue
        message = row.record.message
        head = f"@{row.offset}  message_log @{row.record.message_log_offset}"
        lines += _message_lines(message, head)
        if not row.dispatch:
            lines.append("    no dispatch_log entry")
        lines.extend(fit("    " + _entry_line(e, message.due_ms)) for e in row.dispatch)
    return lines + _listing_tail(listing, f"bucket {name}", data_dir)


def dispatch_lines(report: DispatchReport, data_dir: str) -> list[str]:
    info = report.info
    if info is None:
        lines = [f"dispatch_log {report.bucket}: no file (nothing dispatched yet)"]
    else:
        counts = ", ".join(  # the kinds present: a line wide enough for all of them
            f"{n:,} {KIND_WORDS[EntryKind[kind.upper()]]}" for kind, n in info.entries.items() if n
        )
        lines = [
            f"dispatch_log {report.bucket}: {len(report.entries):,} entries, {info.bytes:,} B",
            fit(f"  {counts}"),
        ]
        if info.complete_up_to is None:
            lines.append("no COMPLETE mark")
        else:
            lines.append(f"COMPLETE mark covers schedule_log up to {info.complete_up_to:,} B")
    undone = report.undispatched
    shown = ", ".join(f"@{o}" for o in undone[:8]) + (", …" if len(undone) > 8 else "")
    lines.append(
        fit(
            f"schedule_log records {report.schedule_records:,}, undispatched {len(undone):,}"
            + (f": {shown}" if undone else "")
        )
    )
    if report.entries:
        lines.append(f"  {'position':>8}  {'kind':<13} {'offset':>10}  {'at':<24}  group")
        for position, e in report.entries:
            lines.append(
                fit(
                    f"  {position:>8}  {KIND_WORDS[e.kind]:<13} {e.offset:>10}  "
                    f"{iso_ms(e.at_ms):<24}  {e.group}"
                )
            )
    if report.damages:
        lines += ["damage", *damage_lines(report.damages, data_dir)]
    return lines


def _found_lines(f: FoundMessage, now_ms: int) -> list[str]:
    m = f.message
    where = (
        f"message_log @{f.message_log_offset} (segment {f.segment})"
        if f.segment is not None
        else f"message_log @{f.message_log_offset} (no longer in message_log)"
    )
    lines = [
        fit(f"{where}  seq {m.sequence}  subject {m.subject}"),
        fit(f"  received {iso_ms(m.receive_ms)}  due {iso_ms(m.due_ms)}"),
    ]
    if f.bucket is not None:
        lines.append(f"  schedule_log {f.bucket} @{f.bucket_offset}")
    if f.status == NOT_REPLAYED:
        lines.append("  not in schedule_log: replay has not copied it yet")
    elif f.status == WAITING:
        lines.append(f"  not dispatched yet: due in {duration_ms(m.due_ms - now_ms)}")
    elif f.status == OVERDUE:
        lines.append(f"  NOT DISPATCHED, overdue by {duration_ms(now_ms - m.due_ms)}")
    else:
        assert f.status in (DISPATCHED, DEAD_LETTERED, CANCELLED, RESCHEDULED, NOT_MOVED)
        lines.extend(fit("  " + _entry_line(e, m.due_ms)) for e in f.dispatch)
    return lines


def find_lines(result: FindResult, now_ms: int, data_dir: str) -> list[str]:
    if not result.found:
        lines = [f"message {result.message_id}: not found in message_log or schedule_log"]
    else:
        lines = [f"message {result.message_id}: {len(result.found)} record(s)"]
        for f in result.found:
            lines += _found_lines(f, now_ms)
    if result.damages:
        lines += ["damage (the scan of these files stopped early)"]
        lines += damage_lines(result.damages, data_dir)
    return lines
