"""The streams of a group's data directory: what replication copies, byte for byte.

A *stream* is an append-only sequence of storage-framed records with byte offsets
(docs/replication.md, "Replication protocol"). ``StreamSet`` is what the leader and the
follower use of a group's streams, whatever the group; a delay group has
(``DelayStreams``)

* ``message_log``: the SegmentedLog of messages and tombstones (its END_OF_SEGMENT
  markers are part of the stream, so a copy rolls its segments where the source did);
* ``dispatch_log/<yyyyMMddHHmm>``: one RecordFile per dispatch_log bucket, new ones
  appearing as buckets are first written.

and a broker group has (``BrokerStreams``)

* ``commitlog``: the broker's SegmentedLog of message records;
* ``offsets/<20-digit generation>``: the committed consumer offsets, one RecordFile per
  generation of their log (delayd/broker/offsets.py), a new one appearing at each
  compaction and the older ones deleted.

Everything else in the data directory (schedule_log, the id index, checkpoints; consume
queues, the broker's index, the dedupe window) each member derives from these with the
code a restart uses, so it is never shipped.

A ``StreamSet`` gives them one interface (``Stream``) and a growth signal: whoever
appends to a stream calls ``grew()`` (as intake calls the replayer's ``notify``), and a
leader waiting in ``wait_growth`` sends the new records at once, without polling.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import trio

from delayd.logs import layout
from delayd.logs.bucket_files import BucketFiles
from delayd.logs.buckets import parse_bucket_name
from storage.framing import HEADER_SIZE
from storage.fs import O_READ, REAL_FS, FileSystem
from storage.raw_frames import whole_frames
from storage.record_file import RecordFile
from storage.segmented_log import DEFAULT_SEGMENT_SIZE, SegmentedLog

MESSAGE_LOG = layout.MESSAGE_LOG
DISPATCH_PREFIX = layout.DISPATCH_LOG + "/"


class Stream(Protocol):
    """One stream, as SegmentedLog and RecordFile both offer it."""

    @property
    def end_offset(self) -> int: ...

    @property
    def durable_offset(self) -> int: ...

    def read_raw(self, offset: int, max_bytes: int) -> bytes: ...

    def append_raw(self, offset: int, data: bytes) -> int: ...

    def flush(self) -> int: ...

    def truncate(self, offset: int) -> None: ...

    def close(self) -> None: ...


def dispatch_stream(bucket_name: str) -> str:
    """The stream name of the dispatch_log bucket file ``bucket_name``."""
    return DISPATCH_PREFIX + bucket_name


def check_stream_name(name: str) -> str:
    """``name`` if it names a delay stream; raises ValueError saying what names are."""
    if name == MESSAGE_LOG:
        return name
    if name.startswith(DISPATCH_PREFIX):
        try:
            parse_bucket_name(name[len(DISPATCH_PREFIX) :])
        except ValueError:
            pass
        else:
            return name
    raise ValueError(
        f"{name!r} is not a stream of a delay data directory: the streams are "
        f"{MESSAGE_LOG!r} and {DISPATCH_PREFIX}<yyyyMMddHHmm>"
    )


class StreamSet:
    """A group's streams as the leader and the follower see them, and their growth
    signal. Subclasses say which streams there are (``names``, ``get``)."""

    def __init__(self) -> None:
        self._growth = trio.Event()
        self.version = 0  # bumped by every grew()

    def names(self) -> list[str]:
        """Every stream on disk now, in the order the leader sends them."""
        raise NotImplementedError

    def get(self, name: str) -> Stream:
        """The stream ``name``, created empty when it does not exist yet (a follower
        receiving its first records). Raises ValueError for a bad name."""
        raise NotImplementedError

    def find(self, name: str) -> Stream | None:
        """The stream ``name`` if it exists now, else None (never creates one: the
        leader reading a stream deleted since it listed the names)."""
        return self.get(name)

    def copies(self, name: str) -> bool:
        """Whether a follower copies the leader's records of ``name``: False for a
        stream this member deleted by the leader's word, which the leader deletes too
        (records of it still in flight are dropped, never a new empty copy)."""
        return True

    def _opened(self) -> list[tuple[str, Stream]]:
        """The streams open now (what ``flush_all`` flushes)."""
        return [(name, self.get(name)) for name in self.names()]

    def starts(self) -> dict[str, int]:
        """Where each stream that retention thins begins (its first record's offset):
        what a follower lacking the records below can no longer copy."""
        return {}

    def ends(self) -> dict[str, int]:
        """Where each stream ends (its next record's offset)."""
        return {name: self.get(name).end_offset for name in self.names()}

    def durable_ends(self) -> dict[str, int]:
        """How much of each stream survives a power loss."""
        return {name: self.get(name).durable_offset for name in self.names()}

    def flush_all(self) -> dict[str, int]:
        """Make every stream durable; their durable ends, for the ones that had grown."""
        flushed = {}
        for name, stream in self._opened():
            if stream.durable_offset < stream.end_offset:
                flushed[name] = stream.flush()
        return flushed

    def grew(self) -> None:
        """Say that a stream grew (records appended or made durable): wakes every task
        in ``wait_growth``."""
        self.version += 1
        self._growth.set()
        self._growth = trio.Event()

    async def wait_growth(self, seen: int) -> int:
        """Wait until ``version`` differs from ``seen`` (returns at once if it does
        already); returns the version."""
        while self.version == seen:
            await self._growth.wait()
        return self.version

    def close(self) -> None:
        """Close what this object opened itself."""


class WrittenBucket:
    """A dispatch_log bucket file the server itself writes, as its group's leader sends
    it: through the writer's open RecordFile when it has one, and only as far as the
    writer made it durable (a follower must never hold an entry the leader could still
    lose); a file the writer closed was flushed first, so all of it. Read only."""

    def __init__(self, files: BucketFiles, start_ms: int) -> None:
        self.files = files
        self.start_ms = start_ms
        self.path = files.path(start_ms)

    @property
    def end_offset(self) -> int:
        writer = self.files.opened(self.start_ms)
        if writer is not None:
            return writer.durable_offset
        return self.files.size(self.start_ms)

    @property
    def durable_offset(self) -> int:
        return self.end_offset

    def read_raw(self, offset: int, max_bytes: int) -> bytes:
        end = self.end_offset
        if offset >= end:
            return b""
        # Whole records below the durable end only: it is a record boundary.
        limit = min(max_bytes, end - offset)
        writer = self.files.opened(self.start_ms)
        if writer is not None:
            return writer.read_raw(offset, limit)
        # Read only: opening a RecordFile would check (and could cut) the tail of a file
        # the writer may be opening again in a worker thread.
        fs = self.files.fs
        fd = fs.open(self.path, O_READ)
        try:
            data = fs.pread(fd, max(limit, HEADER_SIZE), offset)
            return whole_frames(fs, fd, self.path, offset, end, data)
        finally:
            fs.close(fd)

    def append_raw(self, offset: int, data: bytes) -> int:
        raise RuntimeError(f"{self.path} is the server's own: a leader never copies into it")

    def flush(self) -> int:
        return self.durable_offset  # the writer's flushes make it durable

    def truncate(self, offset: int) -> None:
        raise RuntimeError(f"{self.path} is the server's own: a leader never cuts it")

    def close(self) -> None:
        """Nothing to close: the writer's files are the writer's."""


class DelayStreams(StreamSet):
    """The streams of the data directory ``data_dir``, opened on first use.

    ``message_log``: the server's own SegmentedLog when it has one open (then this
    object does not close it); else it is opened here with ``segment_size``.
    ``with_dispatch_log`` False: message_log is the only stream (the server's
    DispatchFiles keep the bucket files to themselves). With it, the bucket files are
    this object's own (a follower copies into them) until ``share_dispatch``: then
    they are read through the server's writer (``WrittenBucket``), as a leader sends
    them.
    One trio thread uses it; flushes run on that thread too (a follower's group
    commit calls ``flush_all`` in a worker thread while nothing appends).
    """

    def __init__(
        self,
        data_dir: str,
        *,
        fs: FileSystem = REAL_FS,
        message_log: SegmentedLog | None = None,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
        with_dispatch_log: bool = True,
    ) -> None:
        super().__init__()
        self.data_dir = data_dir
        self.with_dispatch_log = with_dispatch_log
        self.fs = fs
        self._owns_message_log = message_log is None
        if message_log is None:
            message_log = SegmentedLog.open(
                layout.message_log_dir(data_dir), fs=fs, segment_size=segment_size
            )
        self.message_log = message_log
        self._buckets: dict[str, RecordFile] = {}
        self._dispatch_dir = layout.dispatch_log_dir(data_dir)
        self._written: Callable[[], BucketFiles] | None = None  # share_dispatch's
        self._retired: set[str] = set()  # dispatch_log buckets a replay deleted

    def share_dispatch(self, files: Callable[[], BucketFiles] | None) -> None:
        """Read the dispatch_log buckets through the server's writer, ``files()`` (its
        BucketFiles of the moment), as a leader does; None: copy into files of this
        object's own, as a follower does. Either way the copies opened before are
        closed: the writer opens and checks the files again itself."""
        for bucket in self._buckets.values():
            bucket.close()
        self._buckets.clear()
        self._written = files

    # ------------------------------------------------------------------ the set

    def names(self) -> list[str]:
        """Every stream on disk now: message_log first, then the dispatch_log buckets in
        time order."""
        buckets = set(self._buckets)
        if self.with_dispatch_log and self.fs.exists(self._dispatch_dir):
            for name in self.fs.listdir(self._dispatch_dir):
                try:
                    parse_bucket_name(name)
                except ValueError:
                    continue  # a temp file or anything else that is not a bucket
                buckets.add(dispatch_stream(name))
        return [MESSAGE_LOG, *sorted(buckets)]

    def get(self, name: str) -> Stream:
        """The stream ``name``, created empty when it does not exist yet (a follower
        receiving a bucket's first records). Raises ValueError for a bad name."""
        if name == MESSAGE_LOG:
            return self.message_log
        if self._written is not None:
            check_stream_name(name)
            return WrittenBucket(self._written(), parse_bucket_name(name[len(DISPATCH_PREFIX) :]))
        bucket = self._buckets.get(name)
        if bucket is None:
            check_stream_name(name)
            path = os.path.join(self._dispatch_dir, name[len(DISPATCH_PREFIX) :])
            bucket = self._buckets[name] = RecordFile.open(path, fs=self.fs)
        return bucket

    def find(self, name: str) -> Stream | None:
        if self._written is not None and name != MESSAGE_LOG:
            bucket = self.get(name)
            assert isinstance(bucket, WrittenBucket)
            if not bucket.files.exists(bucket.start_ms):
                return None  # deleted by retention since it was listed
            return bucket
        return self.get(name)

    def _opened(self) -> list[tuple[str, Stream]]:
        return [(MESSAGE_LOG, self.message_log), *self._buckets.items()]

    def retire_dispatch(self, bucket_names: list[str]) -> None:
        """The replay of a bucket retirement is about to delete these dispatch_log
        buckets (delayd.logs.retirement): close this object's copies of them, and copy
        no more of them (``copies``), as the leader deletes them too."""
        for name in map(dispatch_stream, bucket_names):
            bucket = self._buckets.pop(name, None)
            if bucket is not None:
                bucket.close()
            self._retired.add(name)

    def copies(self, name: str) -> bool:
        return name not in self._retired

    def starts(self) -> dict[str, int]:
        return {MESSAGE_LOG: self.message_log.min_offset}

    def close(self) -> None:
        for bucket in self._buckets.values():
            bucket.close()
        self._buckets.clear()
        if self._owns_message_log:
            self.message_log.close()


COMMITLOG = "commitlog"
OFFSETS_PREFIX = "offsets/"
# A delay group member's set holds its embedded broker's streams under this prefix
# (JoinedStreams): ``broker/commitlog``, ``broker/offsets/<generation>``.
EMBEDDED_BROKER_PREFIX = "broker/"


class OffsetFiles(Protocol):
    """The files of the committed-offsets log, as delayd.broker.offsets keeps them."""

    def generations(self) -> list[int]: ...

    def file(self, generation: int) -> Stream: ...


def offsets_stream(generation: int) -> str:
    """The stream name of the committed-offsets generation ``generation``."""
    return f"{OFFSETS_PREFIX}{generation:020d}"


def offsets_generation(name: str) -> int:
    """The generation the stream ``name`` holds; raises ValueError saying what the
    broker's stream names are."""
    tail = name[len(OFFSETS_PREFIX) :]
    if name.startswith(OFFSETS_PREFIX) and len(tail) == 20 and tail.isdigit():
        return int(tail)
    raise ValueError(
        f"{name!r} is not a stream of a broker data directory: the streams are "
        f"{COMMITLOG!r} and {OFFSETS_PREFIX}<20-digit generation>"
    )


class BrokerStreams(StreamSet):
    """A broker's streams: its commitlog and its committed-offsets generations.

    Both belong to the broker, which opens and closes them; ``commitlog`` may be an
    adapter of the broker's SegmentedLog (a truncation must cut what the broker derived
    from the records first). One trio thread uses it, as DelayStreams.
    """

    def __init__(self, commitlog: Stream, offsets: OffsetFiles) -> None:
        super().__init__()
        self.commitlog = commitlog
        self.offsets = offsets

    def names(self) -> list[str]:
        return [COMMITLOG, *map(offsets_stream, self.offsets.generations())]

    def get(self, name: str) -> Stream:
        if name == COMMITLOG:
            return self.commitlog
        return self.offsets.file(offsets_generation(name))

    def find(self, name: str) -> Stream | None:
        if name != COMMITLOG and offsets_generation(name) not in self.offsets.generations():
            return None  # compacted away
        return self.get(name)


class JoinedStreams(StreamSet):
    """Several stream sets replicated as one (one Leader or Follower, one connection,
    one epoch): each part's streams under its prefix, ``""`` for at most one part. A
    delay group joins its embedded broker's streams to its own this way
    (``{"": DelayStreams, "broker/": BrokerStreams}``: ``broker/commitlog``,
    ``broker/offsets/<generation>``). Appenders call this set's ``grew``.
    """

    def __init__(self, parts: dict[str, StreamSet]) -> None:
        super().__init__()
        if list(parts).count("") > 1 or any(p and not p.endswith("/") for p in parts):
            raise ValueError(f"prefixes end with '/', and one at most is empty: {list(parts)}")
        # Longest prefix first: a name is its part's whatever the parts' own names.
        self.parts = dict(sorted(parts.items(), key=lambda item: -len(item[0])))

    def _part(self, name: str) -> tuple[StreamSet, str]:
        for prefix, part in self.parts.items():
            if name.startswith(prefix):
                return part, name[len(prefix) :]
        raise ValueError(
            f"{name!r} is not a stream of this group: its prefixes are {list(self.parts)}"
        )

    def names(self) -> list[str]:
        ordered = sorted(self.parts.items(), key=lambda item: len(item[0]))  # "" first
        return [prefix + name for prefix, part in ordered for name in part.names()]

    def get(self, name: str) -> Stream:
        part, own = self._part(name)
        return part.get(own)

    def find(self, name: str) -> Stream | None:
        part, own = self._part(name)
        return part.find(own)

    def copies(self, name: str) -> bool:
        part, own = self._part(name)
        return part.copies(own)

    def _opened(self) -> list[tuple[str, Stream]]:
        return [
            (prefix + name, stream)
            for prefix, part in self.parts.items()
            for name, stream in part._opened()
        ]

    def starts(self) -> dict[str, int]:
        return {
            prefix + name: start
            for prefix, part in self.parts.items()
            for name, start in part.starts().items()
        }

    def close(self) -> None:
        for part in self.parts.values():
            part.close()
