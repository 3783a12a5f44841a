"""RebuildNeeded: a member of a delay group whose message_log its leader cuts must
derive everything again (docs/replication.md, "Wiring the data path"). Its own module:
``delayd serve`` catches it without importing the group's etcd and HTTP stack.

The derived state goes durably *before* the cut (``cut_message_log``): the replay
checkpoint first, so that from the first step on a start replays message_log from its
beginning, then schedule_log, the id index and the other checkpoints, then the cut. A
power loss at any step leaves a data directory that opens and replays (a replay
checkpoint past the log's end, which the other order could leave, stops a start); the
member then follows again, is told to cut again, and finishes the work.
"""

from __future__ import annotations

from delayd.errors import DelaydError
from delayd.logs import layout
from storage.fs import REAL_FS, FileSystem, empty_directory_durably, remove_durably
from storage.segmented_log import DEFAULT_SEGMENT_SIZE, SegmentedLog


class RebuildNeeded(DelaydError):
    """The leader told this follower to cut message_log back to ``offset``: what the
    member derived may hold records that go. Raised before anything is cut; ``delayd
    serve`` stops the server, runs ``cut_message_log`` with nothing running, and starts
    again in the same process, replaying message_log from the start."""

    after = (
        "derived state removed, message_log cut, starting again (message_log is "
        "replayed from the start)"
    )

    def __init__(self, data_dir: str, offset: int) -> None:
        self.data_dir = data_dir
        self.offset = offset
        super().__init__(
            f"message_log is to be cut back to {offset} (records the group never acknowledged)"
        )

    def rebuild(
        self, *, fs: FileSystem = REAL_FS, segment_size: int = DEFAULT_SEGMENT_SIZE
    ) -> None:
        """``cut_message_log`` at this offset. Call with nothing running."""
        cut_message_log(self.data_dir, self.offset, fs=fs, segment_size=segment_size)


def cut_message_log(
    data_dir: str,
    offset: int,
    *,
    fs: FileSystem = REAL_FS,
    segment_size: int = DEFAULT_SEGMENT_SIZE,
) -> None:
    """Remove the derived state durably, then cut message_log back to ``offset`` (see
    the module docstring). An offset at or past the log's end (a torn tail lost since
    the leader said it) cuts nothing. Raises ValueError when ``offset`` is not a record
    boundary of the log."""
    remove_derived_state(data_dir, fs=fs)
    log = SegmentedLog.open(layout.message_log_dir(data_dir), fs=fs, segment_size=segment_size)
    try:
        if offset < log.end_offset:
            log.truncate(offset)
    finally:
        log.close()


def remove_derived_state(data_dir: str, *, fs: FileSystem = REAL_FS) -> None:
    """Remove, durably, what a start derives again from message_log: the replay
    checkpoint first (a start then replays from the beginning, whatever else is left),
    then schedule_log, the id index and the other checkpoints (wheel cursors,
    segment_scale). The directories stay, empty."""
    remove_durably(fs, layout.replay_checkpoint_path(data_dir))
    for directory in (
        layout.schedule_log_dir(data_dir),
        layout.id_index_dir(data_dir),
        layout.checkpoint_dir(data_dir),
    ):
        empty_directory_durably(fs, directory)
