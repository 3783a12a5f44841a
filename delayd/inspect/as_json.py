"""``delayd inspect --json``: the reports of ``report.py`` as JSON-ready values.

Times appear twice: as epoch milliseconds (``due_ms``) and as UTC ISO text (``due``).
A body is ``body`` when it is UTF-8 text and ``body_base64`` otherwise.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

from delayd.inspect.files import Damage
from delayd.inspect.report import (
    BucketInfo,
    CheckpointInfo,
    DispatchReport,
    FindResult,
    Listing,
    MessageRow,
    ScheduleRow,
    SegmentInfo,
    Summary,
)
from delayd.inspect.text import iso_ms, safe_bucket_name
from delayd.logs.dispatch_log import DispatchEntry
from delayd.logs.message_log import MessageRecord
from delayd.wheel.cursor import NO_BUCKET, Cursor, LoadCursors

JSON = dict[str, Any]


def damage(d: Damage | None) -> JSON | None:
    if d is None:
        return None
    return {
        "kind": d.kind,
        "file": d.path,
        "position": d.position,
        "bytes_to_end": d.length,
        "reason": d.reason,
    }


def message(m: MessageRecord) -> JSON:
    out: JSON = {
        "message_id": m.message_id,
        "sequence": m.sequence,
        "due_ms": m.due_ms,
        "due": iso_ms(m.due_ms),
        "receive_ms": m.receive_ms,
        "received": iso_ms(m.receive_ms),
        "subject": m.subject,
        "key": m.key,
        "properties": m.properties,
        "body_bytes": len(m.body),
    }
    try:
        out["body"] = m.body.decode()
    except UnicodeDecodeError:
        out["body_base64"] = base64.b64encode(m.body).decode()
    return out


def entry(e: DispatchEntry) -> JSON:
    return {
        "kind": e.kind.name.lower(),
        "offset": e.offset,
        "at_ms": e.at_ms,
        "at": iso_ms(e.at_ms),
        "group": e.group,
    }


def _fields(value: Any, **replaced: object) -> JSON:
    """The fields of the dataclass ``value`` by name, those in ``replaced`` replaced."""
    return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)} | replaced


def _segment(s: SegmentInfo) -> JSON:
    return _fields(s, damage=damage(s.damage))


def _bucket(b: BucketInfo) -> JSON:
    dispatch = None
    if b.dispatch is not None:
        dispatch = _fields(b.dispatch, damage=damage(b.dispatch.damage))
    return {
        "name": b.name,
        "schedule_log": None
        if b.bytes is None
        else {"bytes": b.bytes, "records": b.records, "damage": damage(b.damage)},
        "dispatch_log": dispatch,
        "undispatched": b.undispatched,
        "complete": b.complete,
    }


def _cursor(c: Cursor) -> JSON:
    named = None if c.bucket_ms == NO_BUCKET else safe_bucket_name(c.bucket_ms)
    return {"bucket_ms": c.bucket_ms, "bucket": named, "offset": c.offset}


def _wheel(cursors: LoadCursors | None) -> JSON | None:
    if cursors is None:
        return None
    return {
        "loading": _cursor(cursors.loading),
        "loaded": _cursor(cursors.loaded),
        "complete": cursors.complete,
    }


def checkpoints(c: CheckpointInfo) -> JSON:
    replay = None
    if c.replay is not None:
        sizes = sorted(c.replay.bucket_sizes.items())
        replay = _fields(c.replay, bucket_sizes={safe_bucket_name(s): n for s, n in sizes})
    return {
        "directory": c.directory,
        "meta": c.meta,
        "replay": replay,
        "wheel": _wheel(c.wheel),
        "errors": c.errors,
    }


def summary(s: Summary) -> JSON:
    return {
        "data_dir": s.data_dir,
        "message_log": [_segment(x) for x in s.message_log],
        "buckets": [_bucket(x) for x in s.buckets],
        "checkpoints": checkpoints(s.checkpoints),
        "damages": [damage(d) for d in s.damages],
    }


def _message_row(row: MessageRow) -> JSON:
    return _fields(row, message=None if row.message is None else message(row.message))


def _schedule_row(row: ScheduleRow) -> JSON:
    return {
        "offset": row.offset,
        "next_offset": row.next_offset,
        "message_log_offset": None if row.record is None else row.record.message_log_offset,
        "message": None if row.record is None else message(row.record.message),
        "dispatch": [entry(e) for e in row.dispatch],
        "error": row.error,
    }


def message_listing(listing: Listing[MessageRow]) -> JSON:
    return {
        "from": listing.start,
        "records": [_message_row(r) for r in listing.rows],
        "next_offset": listing.next_offset,
        "damages": [damage(d) for d in listing.damages],
    }


def bucket_listing(name: str, listing: Listing[ScheduleRow]) -> JSON:
    return {
        "bucket": name,
        "from": listing.start,
        "records": [_schedule_row(r) for r in listing.rows],
        "next_offset": listing.next_offset,
        "damages": [damage(d) for d in listing.damages],
    }


def dispatch(report: DispatchReport) -> JSON:
    info = report.info
    return {
        "bucket": report.bucket,
        "bytes": None if info is None else info.bytes,
        "entries_by_kind": None if info is None else info.entries,
        "complete_up_to": None if info is None else info.complete_up_to,
        "entries": [{"position": p, **entry(e)} for p, e in report.entries],
        "schedule_records": report.schedule_records,
        "undispatched": report.undispatched,
        "damages": [damage(d) for d in report.damages],
    }


def find(result: FindResult) -> JSON:
    return {
        "message_id": result.message_id,
        "found": [
            {
                "status": f.status,
                "message_log_offset": f.message_log_offset,
                "segment": f.segment,
                "bucket": f.bucket,
                "bucket_offset": f.bucket_offset,
                "dispatch": [entry(e) for e in f.dispatch],
                "message": message(f.message),
            }
            for f in result.found
        ],
        "damages": [damage(d) for d in result.damages],
    }
