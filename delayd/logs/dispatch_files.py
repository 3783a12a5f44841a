"""DispatchFiles: the dispatch_log files of a data directory, for the delivery path.

One RecordFile per bucket, kept in a bounded LRU as schedule_log's (BucketFiles). The
first time this process touches a bucket its file is opened with ``trusted_end=0``: the
entries are written with the async flush policy, so after a crash any of the file's tail
may be torn, and the whole file is checked (it is small: 41 bytes per message). That
open is also where ``state`` reads what the file says, for recovery.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from delayd.logs.bucket_files import BucketFiles
from delayd.logs.dispatch_log import (
    BucketRoutes,
    DispatchState,
    EntryKind,
    RouteSet,
    decode_records,
    encode_entry,
    encode_route_set,
    read_state,
)
from storage.descriptor_limit import soft_descriptor_limit
from storage.fs import REAL_FS, FileSystem

DEFAULT_MAX_OPEN = 64
# Evicted files waiting open for the next group commit (BucketFiles). Cancels of
# messages due over hours write an entry into hundreds of buckets between two flushes;
# each one that must be synced on eviction costs an fdatasync (~1-2 ms) instead of a
# share of the next one. Capped at an eighth of the descriptor limit.
MAX_RETIRED = 1024


def retired_budget() -> int:
    """How many evicted files may wait for the flush under this process's ``ulimit -n``."""
    return max(1, min(MAX_RETIRED, soft_descriptor_limit() // 8))


class DispatchFiles:
    """Append dispatch_log entries and read a bucket's state; one thread at a time
    (``flush`` may run in a worker thread while nothing is appended)."""

    def __init__(
        self,
        directory: str,
        *,
        fs: FileSystem = REAL_FS,
        max_open: int = DEFAULT_MAX_OPEN,
        max_retired: int | None = None,
    ) -> None:
        if max_retired is None:
            max_retired = retired_budget()
        self.files = BucketFiles(directory, fs=fs, max_open=max_open, max_retired=max_retired)
        self._checked: set[int] = set()  # buckets whose file this process has scanned
        # What each bucket's file says of routing, kept from its first read (the
        # loader's, at begin) and brought up to date by what is recorded since.
        self._routes: dict[int, BucketRoutes] = {}
        self.entries_written = 0
        # Called on the event loop after a flush made entries durable (a group's leader
        # then sends them to its followers: delayd.replication.streams).
        self.on_durable: Callable[[], object] | None = None

    def _file(self, bucket_ms: int):
        if bucket_ms in self._checked:
            return self.files.get(bucket_ms)
        record_file = self.files.get(bucket_ms, trusted_end=0)
        self._checked.add(bucket_ms)
        return record_file

    def size(self, bucket_ms: int) -> int:
        """The bucket file's length (0 when it has none)."""
        if self.files.is_open(bucket_ms):
            return self.files.get(bucket_ms).end_offset
        return self.files.size(bucket_ms)

    def state(self, bucket_ms: int) -> DispatchState:
        """What the bucket's file says (nothing, when it has no file). Raises
        CorruptionError for damage a crash cannot explain."""
        if not self.files.exists(bucket_ms) and bucket_ms not in self._checked:
            state = read_state(())
        else:
            record_file = self._file(bucket_ms)
            state = read_state(decode_records(record_file.iter_from(0), record_file.path))
        self._routes[bucket_ms] = state.routes
        return state

    def routes(self, bucket_ms: int) -> BucketRoutes:
        """What the bucket's file says of routing (read once, then kept up to date by
        ``record_route_set`` and ``record`` of ROUTED). Raises CorruptionError as
        ``state`` does."""
        routes = self._routes.get(bucket_ms)
        if routes is None:
            routes = self.state(bucket_ms).routes
        return routes

    def known_routes(self, bucket_ms: int) -> BucketRoutes | None:
        """``routes`` when the bucket's file was read already, else None (no I/O)."""
        return self._routes.get(bucket_ms)

    def record_route_set(self, bucket_ms: int, route_set: RouteSet, at_ms: int) -> RouteSet:
        """Record ``route_set`` as the bucket's unless it has one; the bucket's set
        (durable after ``flush``). Raises ValueError as ``encode_route_set``."""
        routes = self.routes(bucket_ms)
        if routes.route_set is None:
            payloads = encode_route_set(route_set, at_ms)
            self._file(bucket_ms)
            self.files.append_batch(bucket_ms, payloads, EntryKind.ROUTE)
            self.entries_written += len(payloads)
            routes.route_set = route_set
        return routes.route_set

    def record(
        self, bucket_ms: int, kind: EntryKind, offsets: Sequence[int], at_ms: int, group: bytes
    ) -> None:
        """Append one entry per schedule_log offset (durable after ``flush``)."""
        payloads = [encode_entry(offset, at_ms, group) for offset in offsets]
        self._file(bucket_ms)  # a first touch checks the file: appends follow no torn tail
        if kind is EntryKind.ROUTED:
            self.routes(bucket_ms).deviations.update(dict.fromkeys(offsets, group.decode()))
        self.files.append_batch(bucket_ms, payloads, kind)
        self.entries_written += len(payloads)

    def mark_complete(self, bucket_ms: int, schedule_size: int, at_ms: int) -> None:
        """Append the COMPLETE mark: every record below ``schedule_size`` has an entry."""
        self._file(bucket_ms)
        self.files.append_batch(bucket_ms, [encode_entry(schedule_size, at_ms)], EntryKind.COMPLETE)

    def forget(self, bucket_ms: int) -> None:
        """Flush and close the bucket's file (before retention deletes it) and forget
        that it was checked: a file of that name created later is new."""
        self.files.close_bucket(bucket_ms)
        self._checked.discard(bucket_ms)
        self._routes.pop(bucket_ms, None)

    def forget_all(self) -> None:
        """Flush and close every file and forget which were checked: the files may have
        been written by someone else meanwhile (a follower copying the leader's)."""
        self.files.close()
        self._checked.clear()
        self._routes.clear()

    @property
    def dirty(self) -> bool:
        return bool(self.files.dirty)

    def flush(self) -> int:
        return self.files.flush()

    def close(self) -> None:
        self.files.close()
        self._routes.clear()
