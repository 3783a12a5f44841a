"""Replay: message_log → schedule_log, exactly once across crashes (docs/replay.md).

``open_replayer`` checks segment_scale against the data directory, loads the checkpoint,
runs recovery and returns the Replayer; ``state`` holds the persisted files,
``recovery`` the crash repair, ``replayer`` the copying and its trio task,
``tombstone_index`` where message_log's tombstones are (what a take-over reads).
"""

from __future__ import annotations

from delayd.logs import layout
from delayd.logs.bucket_files import DEFAULT_MAX_OPEN, BucketFiles
from delayd.logs.id_index import IdIndex
from delayd.logs.schedule_reader import ScheduleReader
from delayd.replay.recovery import RecoveryReport, recover
from delayd.replay.replayer import (
    DEFAULT_BATCH_RECORDS,
    DEFAULT_CHECKPOINT_INTERVAL_S,
    DEFAULT_MAX_TAIL_BYTES,
    OnScheduled,
    Replayer,
)
from delayd.replay.state import (
    ReplayCheckpoint,
    SegmentScaleMismatchError,
    ensure_segment_scale,
    read_replay_checkpoint,
)
from storage.fs import REAL_FS, FileSystem
from storage.record_file import DEFAULT_MAX_UNSYNCED_BYTES
from storage.segmented_log import SegmentedLog

__all__ = [
    "RecoveryReport",
    "ReplayCheckpoint",
    "Replayer",
    "SegmentScaleMismatchError",
    "open_replayer",
]


def open_replayer(
    data_dir: str,
    log: SegmentedLog,
    *,
    segment_scale: int,
    fs: FileSystem = REAL_FS,
    on_scheduled: OnScheduled | None = None,
    max_open_buckets: int = DEFAULT_MAX_OPEN,
    bucket_max_unsynced_bytes: int = DEFAULT_MAX_UNSYNCED_BYTES,
    batch_records: int = DEFAULT_BATCH_RECORDS,
    checkpoint_interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S,
    poll_interval_s: float | None = None,
    max_tail_bytes: int = DEFAULT_MAX_TAIL_BYTES,
    index: bool = True,
) -> Replayer:
    """A Replayer for ``data_dir`` whose message_log ``log`` was just opened.

    ``index``: keep the id index (``<data>/delay/id_index``) that cancel and
    reschedule resolve ids with; off only for tools and tests that never cancel.

    Raises SegmentScaleMismatchError when the data was made with another
    segment_scale, CorruptionError when the logs contradict the checkpoint.
    """
    ensure_segment_scale(fs, data_dir, segment_scale)
    checkpoint = read_replay_checkpoint(fs, data_dir)
    buckets = BucketFiles(
        layout.schedule_log_dir(data_dir),
        fs=fs,
        max_open=max_open_buckets,
        max_unsynced_bytes=bucket_max_unsynced_bytes,
    )
    try:
        report = recover(log, buckets, checkpoint, segment_scale)
    except BaseException:
        buckets.close()
        raise
    id_index = None
    if index:
        try:
            id_index = IdIndex(
                layout.id_index_dir(data_dir),
                ScheduleReader(layout.schedule_log_dir(data_dir), fs=fs),
                fs=fs,
            )
        except BaseException:
            buckets.close()
            raise
    return Replayer(
        log,
        buckets,
        fs=fs,
        data_dir=data_dir,
        segment_scale=segment_scale,
        checkpoint=checkpoint,
        recovery=report,
        on_scheduled=on_scheduled,
        index=id_index,
        batch_records=batch_records,
        checkpoint_interval_s=checkpoint_interval_s,
        poll_interval_s=poll_interval_s,
        max_tail_bytes=max_tail_bytes,
    )
