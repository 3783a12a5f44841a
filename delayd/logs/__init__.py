"""The delay server's on-disk formats, built on storage/ (DESIGN.md, "Layers").

``message_log`` (intake records in a SegmentedLog), ``tombstone`` (its cancel and
reschedule records), ``schedule_log`` (one RecordFile per UTC time bucket) and
``schedule_reader`` (reading it back), ``dispatch_log`` / ``dispatch_files`` (what was
delivered, per bucket), ``buckets`` (bucket arithmetic and names), ``bucket_files`` (the
open files of a per-bucket log, bounded), ``id_index`` (message id -> schedule_log
record), ``known_ids`` (is this id held? idempotent intake), ``layout`` (paths under a
data directory). docs/delay-formats.md is the grammar.
"""

from delayd.logs.bucket_files import BucketFiles
from delayd.logs.buckets import (
    DEFAULT_SEGMENT_SCALE,
    MAX_SEGMENT_SCALE,
    MIN_SEGMENT_SCALE,
    bucket_name,
    bucket_of,
    bucket_starts,
    bucket_width_ms,
    check_segment_scale,
    is_bucket_name,
    parse_bucket_name,
)
from delayd.logs.message_log import MessageRecord, RecordFormatError, decode_message
from delayd.logs.schedule_log import ScheduleRecord, decode_scheduled

__all__ = [
    "DEFAULT_SEGMENT_SCALE",
    "MAX_SEGMENT_SCALE",
    "MIN_SEGMENT_SCALE",
    "BucketFiles",
    "MessageRecord",
    "RecordFormatError",
    "ScheduleRecord",
    "bucket_name",
    "bucket_of",
    "bucket_starts",
    "bucket_width_ms",
    "check_segment_scale",
    "decode_message",
    "decode_scheduled",
    "is_bucket_name",
    "parse_bucket_name",
]
