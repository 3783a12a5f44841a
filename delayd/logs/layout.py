"""Where the delay server keeps each log under a data directory (DESIGN.md, "On disk")::

    <data>/delay/message_log/00000000000000000000   SegmentedLog segments
    <data>/delay/schedule_log/202611221530           one RecordFile per UTC bucket
    <data>/delay/dispatch_log/202611221530           what became of each scheduled record
    <data>/delay/id_index/00000000000000000000       message id -> schedule_log location
    <data>/delay/checkpoint/meta                     segment_scale the data was made with
    <data>/delay/checkpoint/replay                   the replayer's checkpoint
    <data>/delay/replication/epochs                  the member's epoch history
    <data>/delay/snapshot/                           a snapshot received, until installed
    <data>/delay/snapshots/<n>/                      a snapshot being sent (hard links)

The server, ``delayd inspect`` and the audit take paths from here, never spell them.
"""

from __future__ import annotations

import os

DELAY = "delay"
MESSAGE_LOG = "message_log"
SCHEDULE_LOG = "schedule_log"
DISPATCH_LOG = "dispatch_log"
ID_INDEX = "id_index"
CHECKPOINT = "checkpoint"
META_CHECKPOINT = "meta"
REPLAY_CHECKPOINT = "replay"
REPLICATION = "replication"
EPOCH_HISTORY = "epochs"
RECEIVED_SNAPSHOT = "snapshot"
OUTGOING_SNAPSHOTS = "snapshots"


def delay_dir(data_dir: str) -> str:
    return os.path.join(data_dir, DELAY)


def message_log_dir(data_dir: str) -> str:
    return os.path.join(data_dir, DELAY, MESSAGE_LOG)


def schedule_log_dir(data_dir: str) -> str:
    return os.path.join(data_dir, DELAY, SCHEDULE_LOG)


def dispatch_log_dir(data_dir: str) -> str:
    return os.path.join(data_dir, DELAY, DISPATCH_LOG)


def id_index_dir(data_dir: str) -> str:
    return os.path.join(data_dir, DELAY, ID_INDEX)


def checkpoint_dir(data_dir: str) -> str:
    return os.path.join(data_dir, DELAY, CHECKPOINT)


def meta_checkpoint_path(data_dir: str) -> str:
    return os.path.join(checkpoint_dir(data_dir), META_CHECKPOINT)


def replay_checkpoint_path(data_dir: str) -> str:
    return os.path.join(checkpoint_dir(data_dir), REPLAY_CHECKPOINT)


def epoch_history_path(data_dir: str) -> str:
    return os.path.join(data_dir, DELAY, REPLICATION, EPOCH_HISTORY)


def received_snapshot_dir(data_dir: str) -> str:
    return os.path.join(data_dir, DELAY, RECEIVED_SNAPSHOT)


def outgoing_snapshots_dir(data_dir: str) -> str:
    return os.path.join(data_dir, DELAY, OUTGOING_SNAPSHOTS)
