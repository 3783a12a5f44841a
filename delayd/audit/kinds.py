"""Names shared by the readers, the reconciliation and the command line, in a module
that imports nothing (the command must load without pyarrow and pyspark)."""

from __future__ import annotations

# What a problem row is (the ``problem`` column; read/frames.py says how each is told apart).
TORN_TAIL = "torn_tail"  # the file ends inside a record: a crash, or a writer still writing
CORRUPT = "corrupt"  # a bad frame before the end: reading that file stopped there
FORMAT = "format"  # a frame whose CRC holds but whose payload this version cannot read
PROBLEMS = (TORN_TAIL, CORRUPT, FORMAT)

# How much of each record the readers decode (the ``verify`` option).
HEAD = "head"  # what the audit needs, head checked as the codec checks it
FULL = "full"  # every record through the codec, properties included
VERIFY_MODES = (HEAD, FULL)

# What a finding is (the ``kind`` column of discrepancies/; docs/audit.md defines each).
DEAD_LETTERED = "dead_lettered"  # as dispatch_log's kind column names DEAD_LETTERED
OVERDUE = "overdue"
DUPLICATE_DISPATCH = "duplicate_dispatch"
DUPLICATE_ID = "duplicate_id"
EARLY = "early"
LATE = "late"
UNKNOWN_RECORD = "unknown_record"
DISPATCHED_AFTER_CANCEL = "dispatched_after_cancel"
CANCELLED_AFTER_DISPATCH = "cancelled_after_dispatch"
COPY_MISSING = "copy_missing"
NOT_SCHEDULED = "not_scheduled"
SCHEDULED_TWICE = "scheduled_twice"
DUPLICATE_SEND = "duplicate_send"
CANCELLED_ID_DELIVERED = "cancelled_id_delivered"
NOTICES = frozenset({DEAD_LETTERED, TORN_TAIL})  # listed; every other kind fails the audit

# A finding's or a corrupt record's ``severity``.
ERROR = "error"  # fails the audit
NOTICE = "notice"  # reported, does not fail it (dead-lettered, torn tail)
