"""A delay member's snapshot: what a member that lacks records retention deleted needs
to start as a restart from the leader's replay checkpoint does (docs/replication.md,
"Resync from a snapshot").

The replay checkpoint (``<data>/delay/checkpoint/replay``) says every message_log record
below its ``position`` P is durably in schedule_log, and gives each open bucket's
durable length. A restart from it reads: that checkpoint, ``checkpoint/meta``
(segment_scale), message_log from P on (recovery scans it, the replayer resumes there),
and the schedule_log files below P (recovery cuts the records at or past P). The id
index and the known ids are derived from schedule_log. So a snapshot is

* message_log from the leader's first segment S up to P (every segment, the last cut
  at P), byte-identical at the same offsets: the follower then copies from P on by the
  ordinary path, and its message_log begins at S as a follower's does after RETAINED;
* each schedule_log bucket file cut to the length the checkpoint gives it, or (a bucket
  it does not name) to its first record at or past P;
* ``checkpoint/meta`` and ``checkpoint/replay`` as they are.

dispatch_log buckets are streams (the follower copies them as any follower does), and
so are the embedded broker's, whose commitlog no retention deletes: neither is in a
snapshot. The id index is built again from the installed schedule_log.

Leader side, ``DelaySnapshots.take``: every file is hard-linked into
``<data>/delay/snapshots/<n>/`` (the message_log listing taken after the checkpoint is
read, so the segment holding P exists in it; a segment deleted between the listing and
its link makes it take the snapshot again), so retention may delete the originals
while the snapshot is sent; the links go when it was sent. Bucket files and segments
are append-only, so the bytes below the shipped lengths never change.

A bucket retired after P may still be needed by the replay from P (a reschedule of
one of its messages copies it from there), so the snapshot must hold every bucket
that was there when P was read. The replay of a retirement writes a checkpoint at the
record before it deletes the bucket's files (delayd.replay.replayer), so a deletion
after P was read replaces the checkpoint file first: the snapshot lists schedule_log,
then checks that the checkpoint is still the file it linked, and links every bucket
it listed; a checkpoint replaced by then, or a listed bucket gone, makes it take the
snapshot again (it then reads the newer checkpoint, which needs no deleted bucket).

Follower side: ``SnapshotReceived`` stops the server once the snapshot is whole in
``<data>/delay/snapshot/`` (delayd.replication.snapshot), and every start installs a
whole one first (``install_received_snapshot``), with nothing open: a crash during the
install installs it again at the next start; a snapshot cut short is discarded, and the
member, which then holds what it held before, is sent a snapshot again.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil

from delayd.logs import layout, message_log, schedule_log
from delayd.logs.buckets import bucket_name, bucket_starts
from delayd.logs.id_index import IdIndex, scheduled_id
from delayd.logs.schedule_reader import ScheduleReader
from delayd.replay.state import decode_replay_checkpoint
from delayd.replication.snapshot import (
    Snapshot,
    SnapshotError,
    SnapshotFile,
    discard_partial,
    manifest_files,
    read_manifest,
    received_file,
)
from delayd.server.rebuild import RebuildNeeded
from storage.checkpoint import read_checkpoint
from storage.fs import (
    O_READ,
    REAL_FS,
    FileSystem,
    create_dirs_durably,
    empty_directory_durably,
    remove_durably,
)
from storage.record_file import RecordFile
from storage.scan import BadFrame, scan_frames
from storage.segmented_log import is_segment_name

log = logging.getLogger(__name__)

REPLAY = f"{layout.CHECKPOINT}/{layout.REPLAY_CHECKPOINT}"
META = f"{layout.CHECKPOINT}/{layout.META_CHECKPOINT}"
# The directories of <data>/delay a snapshot replaces whole.
REPLACED = (layout.MESSAGE_LOG, layout.SCHEDULE_LOG, layout.ID_INDEX, layout.CHECKPOINT)
# Retention may delete the segment holding P, or a retirement a bucket, while it links.
TAKE_ATTEMPTS = 3


class SnapshotReceived(RebuildNeeded):
    """A whole snapshot of the leader's state arrived: ``delayd serve`` stops the
    server and starts again; the start installs it (``DelayServer.open``, as every
    start installs a whole snapshot it finds), and counts it."""

    after = "starting again from it (installed first; the replayer resumes at its checkpoint)"

    def __init__(self, data_dir: str, manifest: dict) -> None:
        self.data_dir = data_dir
        self.manifest = manifest
        meta = manifest.get("meta", {})
        Exception.__init__(
            self,
            f"a snapshot of the leader's state arrived (message_log from "
            f"{meta.get('message_log_start')}, replayed to {meta.get('position')})",
        )

    def rebuild(self, *, fs: FileSystem = REAL_FS, segment_size: int = 0) -> None:
        """Nothing before the start: the start installs the snapshot."""


class DelaySnapshots:
    """The leader's SnapshotSource over the data directory ``data_dir`` (module
    docstring). What an earlier process left in the snapshots directory goes now."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        self.directory = layout.outgoing_snapshots_dir(data_dir)
        self._numbers = itertools.count()
        shutil.rmtree(self.directory, ignore_errors=True)

    def take(self) -> Snapshot:
        """Hard-link a consistent set of files (blocking). Raises SnapshotError when
        the data directory has no replay checkpoint yet, or retention keeps deleting
        what it links, or the checkpoint names a bucket whose file is gone."""
        for _attempt in range(TAKE_ATTEMPTS):
            root = os.path.join(self.directory, str(next(self._numbers)))
            os.makedirs(root)
            try:
                files, meta = self._link(root)
            except BaseException:
                shutil.rmtree(root, ignore_errors=True)
                raise
            if files is not None:
                return Snapshot(files, meta, release=lambda root=root: shutil.rmtree(root))
            shutil.rmtree(root, ignore_errors=True)
        raise SnapshotError(
            f"no snapshot of {self.data_dir}: retention deleted the message_log segment "
            f"holding the replay checkpoint, or a bucket it needs, while it was taken, "
            f"{TAKE_ATTEMPTS} times"
        )

    def _link(self, root: str) -> tuple[list[SnapshotFile] | None, dict]:
        delay = layout.delay_dir(self.data_dir)

        def link(name: str) -> str | None:
            target = os.path.join(root, name.replace("/", "_"))
            try:
                os.link(os.path.join(delay, name), target)
            except FileNotFoundError:
                return None
            return target

        meta_path, replay_path = link(META), link(REPLAY)
        if meta_path is None or replay_path is None:
            raise SnapshotError(f"{self.data_dir} has no replay checkpoint yet: no snapshot")
        replay_bytes = read_checkpoint(REAL_FS, replay_path)
        assert replay_bytes is not None
        checkpoint = decode_replay_checkpoint(replay_bytes, replay_path)
        position = checkpoint.position
        # Listed after the checkpoint was read: the segment holding P exists by then.
        names = sorted(os.listdir(layout.message_log_dir(self.data_dir)))
        schedule_dir = layout.schedule_log_dir(self.data_dir)
        buckets = bucket_starts(os.listdir(schedule_dir))
        if not _same_file(replay_path, os.path.join(delay, REPLAY)):
            return None, {}  # a retirement may have deleted a bucket P needs: read again
        _check_named(checkpoint.bucket_sizes, buckets, self.data_dir)
        files: list[SnapshotFile] = []
        start = end = None
        for name in filter(is_segment_name, names):
            base = int(name)
            if base > position:
                break
            path = link(f"{layout.MESSAGE_LOG}/{name}")
            if path is None:
                if files:
                    return None, {}  # deleted past the first one linked: list again
                continue  # deleted below: the log begins later
            start = base if start is None else start
            end = base + os.path.getsize(path)
            size = min(end, position) - base
            files.append(SnapshotFile(f"{layout.MESSAGE_LOG}/{name}", size, path))
        if start is None or end is None or end < position:
            return None, {}  # retention passed P meanwhile: a newer checkpoint covers it
        for bucket in buckets:
            name = f"{layout.SCHEDULE_LOG}/{bucket_name(bucket)}"
            path = link(name)
            if path is None:
                return None, {}  # retired since the listing: the checkpoint is newer
            size = checkpoint.bucket_sizes.get(bucket)
            if size is None:
                size = _below(path, position)
                if size == 0:
                    continue  # only records past P: the follower's replay writes them
            files.append(SnapshotFile(name, size, path))
        files.append(SnapshotFile(META, os.path.getsize(meta_path), meta_path))
        files.append(SnapshotFile(REPLAY, os.path.getsize(replay_path), replay_path))
        return files, {"position": position, "message_log_start": start}


def _same_file(link: str, path: str) -> bool:
    """Whether ``path`` is still the file ``link`` links (a checkpoint is replaced by
    a rename, never written in place)."""
    try:
        return os.path.samefile(link, path)
    except FileNotFoundError:
        return False


def _check_named(named: dict[int, int], listed: list[int], data_dir: str) -> None:
    """Raise SnapshotError when the checkpoint names a bucket whose file is not there
    (checked while the checkpoint is the current one): the replay deletes a bucket
    only after a checkpoint that no longer names it, so this one went another way — by
    hand, or by the replay of a version that deleted first — and the replay from the
    checkpoint could need its records."""
    missing = sorted(named.keys() - set(listed))
    if missing:
        raise SnapshotError(
            f"no snapshot of {data_dir}: its replay checkpoint names schedule_log bucket "
            f"{bucket_name(missing[0])}, whose file is gone, and a member replaying from "
            "that checkpoint could need its records; a snapshot is taken once a newer "
            "checkpoint no longer names the bucket (the replayer's next, once it replays "
            "more records; if the file was removed by hand, after a restart of the server)"
        )


def _below(path: str, position: int) -> int:
    """The length of the schedule_log file ``path`` up to its first record from
    message_log offset ``position`` or later (a torn tail, being written, ends it)."""
    fd = REAL_FS.open(path, O_READ)
    end = 0
    try:
        size = REAL_FS.fsize(fd)
        for record in scan_frames(REAL_FS, fd, path, 0, 0, size):
            if schedule_log.message_log_offset_of(record.payload) >= position:
                break
            end = record.next_offset
    except BadFrame:
        pass
    finally:
        REAL_FS.close(fd)
    return end


def install_received_snapshot(data_dir: str, fs: FileSystem = REAL_FS) -> dict | None:
    """Install the whole snapshot in ``<data>/delay/snapshot/``, if there is one, with
    nothing open; return its manifest (None: none). A snapshot cut short is removed.
    Every step can run again after a crash: files the snapshot names are never removed,
    a file is moved in place only while its received copy is there, and the received
    snapshot goes last."""
    directory = layout.received_snapshot_dir(data_dir)
    if discard_partial(directory, fs):
        log.warning("%s: removed a snapshot cut short (the leader sends it again)", directory)
    try:
        manifest = read_manifest(directory, fs)
        if manifest is None:
            return None
        files = manifest_files(manifest)
        replay = [i for i, file in enumerate(files) if file.name == REPLAY]
        if len(replay) != 1 or META not in {file.name for file in files}:
            raise SnapshotError("it holds no replay checkpoint")
    except SnapshotError as exc:
        raise SnapshotError(
            f"{directory} is not a snapshot this member can install ({exc}): remove the "
            "directory, and the member starts from what it held before (its leader sends "
            "it a snapshot again)"
        ) from None
    delay = layout.delay_dir(data_dir)
    names = {file.name for file in files}
    if fs.exists(received_file(directory, replay[0])):
        # The old checkpoint first: until the new one is in place no start resumes.
        remove_durably(fs, layout.replay_checkpoint_path(data_dir))
    for sub in REPLACED:
        here = os.path.join(delay, sub)
        create_dirs_durably(fs, here)
        empty_directory_durably(fs, here, keep=lambda name, sub=sub: f"{sub}/{name}" in names)
    for index in sorted(range(len(files)), key=lambda i: i == replay[0]):
        received = received_file(directory, index)
        if fs.exists(received):
            target = os.path.join(delay, files[index].name)
            fs.replace(received, target)
            fs.fsync_dir(os.path.dirname(target))
    index_schedule_log(data_dir, fs)
    discard_partial(directory, fs, whole_too=True)
    meta = manifest.get("meta", {})
    log.info(
        "installed a snapshot of the leader's state: %d file(s), %d bytes; message_log "
        "from %s, replayed to %s",
        len(files),
        sum(file.size for file in files),
        meta.get("message_log_start"),
        meta.get("position"),
    )
    return manifest


def index_schedule_log(data_dir: str, fs: FileSystem = REAL_FS) -> int:
    """Put every schedule_log record of ``data_dir`` in its id index, as the replayer
    did when it appended them, and flush; returns how many."""
    schedule_dir = layout.schedule_log_dir(data_dir)
    index = IdIndex(layout.id_index_dir(data_dir), ScheduleReader(schedule_dir, fs=fs), fs=fs)
    count = 0
    try:
        for bucket in bucket_starts(fs.listdir(schedule_dir)):
            path = os.path.join(schedule_dir, bucket_name(bucket))
            file = RecordFile.open(path, fs=fs)
            try:
                for record in file.iter_from(0):
                    schedule_log.check_type(record.type, path, record.offset)
                    receive_ms = message_log.receive_ms_of(record.payload, schedule_log.PREFIX_SIZE)
                    index.put(scheduled_id(record.payload), bucket, record.offset, receive_ms)
                    count += 1
            finally:
                file.close()
        index.flush()
    finally:
        index.reader.close()
        index.close()
    return count
