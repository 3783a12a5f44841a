"""The delay server's on-disk formats, built on storage/ (DESIGN.md, "Layers").

``message_log`` (intake records in a SegmentedLog), ``schedule_log`` (one RecordFile
per UTC time bucket), ``buckets`` (bucket arithmetic and names), ``bucket_files`` (the
open files of a per-bucket log, bounded), ``layout`` (paths under a data directory).
dispatch_log joins them in the delivery issue. docs/delay-formats.md is the grammar.
"""

from delayd.logs.bucket_files import BucketFiles
from delayd.logs.buckets import (
    DEFAULT_SEGMENT_SCALE,
    MAX_SEGMENT_SCALE,
    MIN_SEGMENT_SCALE,
    bucket_name,
    bucket_of,
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
    "bucket_width_ms",
    "check_segment_scale",
    "decode_message",
    "decode_scheduled",
    "is_bucket_name",
    "parse_bucket_name",
]
