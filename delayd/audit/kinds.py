"""Names shared by the readers, the reconciliation and the command line, in a module
that imports nothing (the command must load without pyarrow and pyspark)."""

from __future__ import annotations

# What a problem row is (the ``problem`` column; frames.py says how each is told apart).
TORN_TAIL = "torn_tail"  # the file ends inside a record: a crash, or a writer still writing
CORRUPT = "corrupt"  # a bad frame before the end: reading that file stopped there
FORMAT = "format"  # a frame whose CRC holds but whose payload this version cannot read
PROBLEMS = (TORN_TAIL, CORRUPT, FORMAT)

# How much of each record the readers decode (the ``verify`` option).
HEAD = "head"  # what the audit needs, head checked as the codec checks it
FULL = "full"  # every record through the codec, properties included
VERIFY_MODES = (HEAD, FULL)
