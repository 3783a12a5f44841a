"""One send per id, and no CANCELLED answer that a delivery contradicts: decided by the
ids themselves, over the few records the hash ranges made candidates (spark/across_buckets.py).

Both are about the records of one message id on one server (schedule_log, which
outlives message_log: the checks hold after retention too).

* duplicate_send — the id's records carry more than one sequence number. The server
  gives every message it stores a sequence of its own (message_log order), and a
  reschedule's copy is the same MESSAGE payload with a new due time (docs/cancel.md),
  sequence included: so the sequences are the sends, and a moved message is one send
  however often it moved. Each send is its earliest record (lowest message_log offset:
  the MESSAGE's; a copy names its RESCHEDULE tombstone, later in message_log). The
  first send is the message; each later one is a finding, listing every send.
* cancelled_id_delivered — a record of the id was delivered (its fate DISPATCHED or
  DEAD_LETTERED) and another record of the id is cancelled (its fate CANCELLED): the
  client was told CANCELLED. Only a cancel writes CANCELLED, and only when it answers
  CANCELLED (delayd.server.cancels: a cancel acts on the id's current record — the
  highest message_log offset — and answers from its fate: a CANCELLED entry it writes
  or finds is CANCELLED, DISPATCHED or DEAD_LETTERED is ALREADY_DELIVERED and writes
  nothing, no record is UNKNOWN; every answer waits for its entry to be durable, and a
  cancel replayed after a crash finds that entry again). So a record whose fate is
  CANCELLED *is* a CANCELLED answer, read off the logs. A cancelled record that was
  sent all the same is ``dispatched_after_cancel`` (verdicts.py), not this.
"""

from __future__ import annotations

import datetime as _dt
from typing import Any

import pyarrow as pa

from delayd.audit.judge.findings import DISCREPANCIES, severity
from delayd.audit.kinds import CANCELLED_ID_DELIVERED, DUPLICATE_SEND
from delayd.logs.dispatch_log import EntryKind

_DELIVERED = (EntryKind.DISPATCHED.value, EntryKind.DEAD_LETTERED.value)
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)


def findings(records: pa.Table) -> pa.Table:
    """DISCREPANCIES rows of duplicate_send and cancelled_id_delivered among
    ``records`` (reconcile.SHOWN columns): for each (server, id) they hold, all its
    records on that server."""
    by_id: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for record in records.to_pylist():
        by_id.setdefault((record["server"], record["message_id"]), []).append(record)
    rows = []
    for same_id in by_id.values():
        rows += _later_sends(same_id)
        rows += _delivered_though_cancelled(same_id)
    rows.sort(key=lambda row: (row["kind"], row["server"], row["message_log_offset"]))
    return pa.Table.from_pylist(rows, schema=DISCREPANCIES)


def _later_sends(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A finding per send of the id but its first (the module docstring)."""
    sends: dict[int, dict[str, Any]] = {}
    for record in sorted(records, key=lambda r: r["message_log_offset"]):
        sends.setdefault(record["sequence"], record)
    if len(sends) < 2:
        return []
    ordered = sorted(sends.values(), key=lambda r: r["message_log_offset"])
    listed = ", ".join(
        f"message_log offset {r['message_log_offset']} (sequence {r['sequence']}, "
        f"due {_utc(r['due_ms'])})"
        for r in ordered
    )
    detail = f"id sent {len(ordered)} times: {listed}"
    return [_finding(DUPLICATE_SEND, record, detail) for record in ordered[1:]]


def _delivered_though_cancelled(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A finding per delivered record of an id with a cancelled record."""
    cancelled = [r for r in records if r["fate"] == EntryKind.CANCELLED.value]
    if not cancelled:
        return []
    first = min(cancelled, key=lambda r: r["message_log_offset"])
    detail = (
        "delivered, but a cancel of its id was answered CANCELLED: the record at "
        f"message_log offset {first['message_log_offset']} (due {_utc(first['due_ms'])}) "
        "is cancelled"
    )
    delivered = [r for r in records if r["fate"] in _DELIVERED]
    return [_finding(CANCELLED_ID_DELIVERED, record, detail) for record in delivered]


def _finding(kind: str, record: dict[str, Any], detail: str) -> dict[str, Any]:
    row = {name: record.get(name) for name in DISCREPANCIES.names}
    row.update(kind=kind, severity=severity(kind), detail=detail)
    return row


def _utc(ms: int) -> str:
    moment = _EPOCH + _dt.timedelta(milliseconds=ms)
    return f"{moment:%Y-%m-%d %H:%M:%S}.{ms % 1000:03d}"
