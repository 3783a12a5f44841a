"""RebuildNeeded: a member of a delay group whose message_log its leader cut must
derive everything again (docs/replication.md, "Wiring the data path"). Its own module:
``delayd serve`` catches it without importing the group's etcd and HTTP stack."""

from __future__ import annotations

import shutil

from delayd.errors import DelaydError
from delayd.logs import layout


class RebuildNeeded(DelaydError):
    """The follower cut message_log: what the member derived may hold cut records.
    ``delayd serve`` stops the server, ``remove_derived_state()``, and starts again in
    the same process, replaying message_log from the start (a restart without
    checkpoint)."""

    def __init__(self, data_dir: str, offset: int) -> None:
        self.data_dir = data_dir
        super().__init__(
            f"message_log was cut back to {offset} (records the group never acknowledged)"
        )

    def remove_derived_state(self) -> None:
        """schedule_log, the id index and the checkpoints (replay, wheel cursors): a
        start then derives them again from message_log. Call with nothing running."""
        for directory in (
            layout.schedule_log_dir(self.data_dir),
            layout.id_index_dir(self.data_dir),
            layout.checkpoint_dir(self.data_dir),
        ):
            shutil.rmtree(directory, ignore_errors=True)
