"""Torn tail or corruption: the one rule that tells them apart, for every reader.

Recovery (SegmentedLog.open, RecordFile.open) applies it to the first invalid frame it
meets and cuts what it calls a torn tail; ``delayd inspect`` and the audit, which never
cut, apply the same rule to say what recovery would do. Pure arithmetic: no I/O.

Why the rule is positional. A power loss can leave any mix of the bytes written since
the last fsync: a short file, zero pages, even a later page without an earlier one, so
a bad crc with valid records after it is no proof of damage. What bounds that region is
the writer: it never lets more than ``max_unsynced_bytes`` sit unsynced (an append
flushes first when it would), and bytes below a durable mark (the recovery checkpoint,
a trusted length) were synced. So the first invalid frame is a torn tail exactly when

* it starts at or after the durable mark, and
* it starts within ``max_unsynced_bytes`` of the end of the *log* — for a segmented log
  the end of its last segment, not of the segment the frame is in: the unsynced window
  spans a roll, so the end of a sealed segment is torn only when the segments after it
  hold less than the window;

anything else is corruption, reported with its file and offset and never cut (leveldb's
log_reader drops a bad tail the same way and reports a bad record before it). The same
holds for a seam between segments (no end-of-segment marker though a later segment
exists, bytes after the marker, a gap): recovery meets it as the first invalid frame.
"""

from __future__ import annotations

DEFAULT_MAX_UNSYNCED_BYTES = 32 << 20  # what a writer leaves unsynced at most, by default


def is_torn_tail(
    position: int,
    log_end: int,
    *,
    durable_end: int = 0,
    max_unsynced_bytes: int = DEFAULT_MAX_UNSYNCED_BYTES,
) -> bool:
    """Whether the first invalid frame of a log, at ``position``, is a torn tail (cut
    quietly) rather than corruption (module docstring).

    ``position``, ``log_end`` and ``durable_end`` are offsets in one coordinate: logical
    offsets for a segmented log, byte positions for a single file. ``durable_end`` is
    what the log's owner knows was synced (0 when it knows nothing).
    """
    return durable_end <= position and log_end - position <= max_unsynced_bytes
