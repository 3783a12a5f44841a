"""The epoch history of a member: for every epoch it led or followed, where each stream
ended when that epoch began on this member (Kafka's leader-epoch cache, KIP-101).

It answers the truncation question: a member that last followed (or led) epoch ``E``
may keep of each stream what the leader had when the epoch after ``E`` began there —
``end_of(E)`` — and must cut the rest. Its last entry is also the highest epoch the
member has seen, which fences an older leader (a member refuses its frames).

A member records the ends of its *own* streams when it takes an epoch (as leader: its
ends then; as follower: its ends after the truncation that epoch's leader asked for).
For a follower that joined an epoch late these starts are lower than the leader's, so
``end_of`` may answer less than the leader really had: a member asking then cuts more
than it had to and fetches it again, never less.

On disk: one RecordFile (storage framing, CRC, torn tail cut on open), one record per
``begin``, a JSON object ``{"epoch": E, "starts": {stream: offset}}``, fsynced before
``begin`` returns. A power loss during ``begin`` leaves the entry whole or absent.
Beside it, ``<path>.founding`` (written atomically, once) says the member campaigned as
a new group's first leader (``claim_founding``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from delayd.errors import DelaydError
from delayd.logs import layout
from storage.checkpoint import write_checkpoint
from storage.fs import REAL_FS, FileSystem
from storage.record_file import RecordFile

FOUNDING_SUFFIX = ".founding"


class EpochHistoryError(DelaydError):
    """An epoch was begun out of order, or the history file holds what it cannot."""


@dataclass(frozen=True, slots=True)
class EpochStart:
    epoch: int
    starts: dict[str, int]  # stream -> offset where the epoch began; absent: 0


class EpochHistory:
    """The history in ``path`` (use ``open``); entries in ascending epoch order."""

    def __init__(
        self, file: RecordFile, entries: list[EpochStart], fs: FileSystem = REAL_FS
    ) -> None:
        self._file = file
        self._fs = fs
        self.entries = entries
        self._founding_path = file.path + FOUNDING_SUFFIX

    @classmethod
    def open(cls, path: str, fs: FileSystem = REAL_FS) -> EpochHistory:
        """Open (creating when missing) the history at ``path``. Raises
        EpochHistoryError for an entry that is not what ``begin`` writes,
        CorruptionError for damage a crash cannot explain."""
        file = RecordFile.open(path, fs=fs)
        entries = []
        try:
            for record in file.iter_from(0):
                entries.append(_decode(record.payload, path, record.offset))
        except BaseException:
            file.close()
            raise
        return cls(file, entries, fs)

    @classmethod
    def open_in(cls, data_dir: str, fs: FileSystem = REAL_FS) -> EpochHistory:
        """The history of the delay data directory ``data_dir``."""
        return cls.open(layout.epoch_history_path(data_dir), fs)

    def last_epoch(self) -> int:
        """The highest epoch begun here; 0 when none was."""
        return self.entries[-1].epoch if self.entries else 0

    def begin(self, epoch: int, starts: dict[str, int]) -> None:
        """Record that ``epoch`` began with the streams ending at ``starts``; durable
        when it returns. Raises EpochHistoryError unless ``epoch`` is above
        ``last_epoch()`` (epochs only grow: an older one is a fenced leader's)."""
        if epoch <= self.last_epoch():
            raise EpochHistoryError(
                f"cannot begin epoch {epoch}: epoch {self.last_epoch()} was already begun "
                "here, and epochs only grow"
            )
        entry = EpochStart(epoch, dict(starts))
        payload = json.dumps({"epoch": epoch, "starts": entry.starts}, sort_keys=True)
        self._file.append(payload.encode())
        self._file.flush()
        self.entries.append(entry)

    def end_of(self, epoch: int) -> dict[str, int] | None:
        """Where each stream ended when ``epoch`` ended on this member: the starts of
        the first epoch begun here after it (a stream absent there had not begun: 0).
        None when no later epoch began here: ``epoch`` is current (or newer than any
        known), and it ends at the streams' ends."""
        for entry in self.entries:
            if entry.epoch > epoch:
                return dict(entry.starts)
        return None

    def claim_founding(self) -> None:
        """Durably note that this member is about to campaign as a new group's first
        leader (the txn that would make it leader also writes the in-sync set with it
        alone). Should it die before it begins its epoch, the set names only a member
        without history, which may not campaign (``knows_group``): nobody would lead.
        The claim lets it lead again; it acknowledged nothing before its epoch began."""
        if not self._fs.exists(self._founding_path):
            write_checkpoint(self._fs, self._founding_path, b"founding\n")

    def knows_group(self) -> bool:
        """Whether this member has led or followed an epoch of its group, or claimed to
        found it: false for a new member and for one whose data directory was wiped,
        which hold nothing the group acknowledged (docs/replication.md, "Eligibility")."""
        return self.last_epoch() > 0 or self._fs.exists(self._founding_path)

    def close(self) -> None:
        self._file.close()


def _decode(payload: bytes, path: str, offset: int) -> EpochStart:
    try:
        value = json.loads(payload)
        epoch, starts = value["epoch"], value["starts"]
        if not isinstance(epoch, int) or not isinstance(starts, dict):
            raise TypeError("epoch must be an integer and starts an object")
        if not all(isinstance(k, str) and isinstance(v, int) for k, v in starts.items()):
            raise TypeError("starts must map stream names to integer offsets")
    except (ValueError, KeyError, TypeError) as exc:
        raise EpochHistoryError(
            f"{path}: the entry at byte {offset} is not an epoch start ({exc}); the file "
            "is written by delayd only: restore it from a backup or remove it (the member "
            "then follows from scratch)"
        ) from None
    return EpochStart(epoch, starts)
