"""IndexStore: a directory of IndexFiles (storage.indexfile) that reads as one index.

As RocketMQ's IndexService over its IndexFiles: puts go to the newest file, which rolls
to a new one when full; lookups walk the files newest first and ask the caller to
confirm every candidate (``key_matches``), so a hash collision never answers a wrong
record. Files are named by the commitlog offset of their first put; retention deletes
whole files, and ``truncate_beyond`` undoes what points past a cut commitlog.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from storage.errors import StorageError
from storage.fs import REAL_FS, FileSystem, create_dirs_durably
from storage.indexfile import (
    DEFAULT_MAX_ENTRIES,
    DEFAULT_SLOT_COUNT,
    TEMP_SUFFIX,
    HashFn,
    HashSource,
    IndexFile,
    default_hash,
    key_bytes,
)

FILE_NAME_DIGITS = 20
DEFAULT_MAX_RESULTS = 64

KeyMatches = Callable[[int, "bytes | str"], bool]


def file_name(offset: int) -> str:
    return f"{offset:0{FILE_NAME_DIGITS}d}"


def is_file_name(name: str) -> bool:
    return len(name) == FILE_NAME_DIGITS and name.isdigit()


class IndexStore:
    """A directory of IndexFiles, newest last, named by a 20-digit commitlog offset: that
    of the file's first put, or one more than the previous file's name when that is not
    greater (two keys of one record can straddle a roll). Use :meth:`open`."""

    def __init__(
        self,
        directory: str,
        fs: FileSystem,
        slot_count: int,
        max_entries: int,
        hash_fn: HashFn,
    ) -> None:
        self.directory = directory
        self.fs = fs
        self.slot_count = slot_count  # for files created from now on
        self.max_entries = max_entries
        self.hash_fn = hash_fn
        self.reindex_from: int | None = None
        """Lowest commitlog offset from which re-putting records restores every committed
        entry that recovery had to drop; None when it dropped none (a cut tail of an
        unfinished flush is refilled by the reput checkpoint and is not reported)."""
        self._files: list[IndexFile] = []

    @classmethod
    def open(
        cls,
        directory: str,
        *,
        fs: FileSystem = REAL_FS,
        slot_count: int = DEFAULT_SLOT_COUNT,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        hash_fn: HashFn = default_hash,
    ) -> IndexStore:
        """Open (creating if missing) the store in ``directory`` and recover its files.
        ``slot_count``, ``max_entries`` apply to files created from now on; existing files
        keep theirs. Raises CorruptionError as IndexFile.open does."""
        store = cls(directory, fs, slot_count, max_entries, hash_fn)
        create_dirs_durably(fs, directory)
        names = fs.listdir(directory)
        leftovers = [n for n in names if n.endswith(TEMP_SUFFIX)]
        for name in leftovers:  # creations a crash interrupted before their rename
            fs.unlink(os.path.join(directory, name))
        if leftovers:
            fs.fsync_dir(directory)
        index_names = sorted(n for n in names if is_file_name(n))
        try:
            for i, name in enumerate(index_names):
                store._files.append(
                    IndexFile.open(
                        os.path.join(directory, name),
                        fs=fs,
                        hash_fn=hash_fn,
                        active=i == len(index_names) - 1,
                    )
                )
        except BaseException:
            store.close()
            raise
        lost = [f.committed_begin_offset for f in store._files if f.lost_committed]
        store.reindex_from = min(lost) if lost else None
        return store

    @property
    def files(self) -> list[str]:
        """Paths of the index files, oldest first."""
        return [f.path for f in self._files]

    def put(self, key: bytes | str, commitlog_offset: int, timestamp_ms: int) -> None:
        """Index ``key`` (str is UTF-8 encoded) -> ``commitlog_offset``, stored at
        ``timestamp_ms``; rolls to a new file when the newest is full. Lookups see it at
        once; durable after flush()."""
        data = key_bytes(key)
        active = self._files[-1] if self._files else None
        if active is None or not active.put(data, commitlog_offset, timestamp_ms):
            active = self._roll(commitlog_offset)
            if not active.put(data, commitlog_offset, timestamp_ms):
                raise StorageError(f"a new index file refused a put ({active.path})")

    def put_batch(
        self, keys: Sequence[bytes], offsets: Sequence[int], timestamps_ms: int | Sequence[int]
    ) -> None:
        """:meth:`put` of ``keys[i]`` (bytes) -> ``offsets[i]`` for every ``i``, in order,
        stored at ``timestamps_ms`` (one for all, or one per key): the same entries as
        one put each (rolling where put would), a fraction of the time per key. Raises
        ValueError when the sequences differ in length or an offset is outside a u64."""
        total = len(keys)
        per_key = not isinstance(timestamps_ms, int)
        if len(offsets) != total or (per_key and len(timestamps_ms) != total):  # type: ignore[arg-type]
            raise ValueError(f"{total} keys, {len(offsets)} offsets: one each, and timestamps")
        done = 0
        active = self._files[-1] if self._files else None
        fresh = False  # active was created for this batch
        while done < total:
            put = 0
            if active is not None:
                if done:
                    stamps = timestamps_ms[done:] if per_key else timestamps_ms  # type: ignore[index]
                    put = active.put_batch(keys[done:], offsets[done:], stamps)
                else:
                    put = active.put_batch(keys, offsets, timestamps_ms)
            if not put and fresh:
                raise StorageError(f"a new index file refused a put ({active.path})")  # type: ignore[union-attr]
            done += put
            if done < total:
                active = self._roll(offsets[done])
                fresh = True

    def prepare(self, commitlog_offset: int) -> None:
        """Create the newest file now, named ``commitlog_offset`` (the end of the log),
        when there is none: creating one allocates its slot table and fsyncs the file and
        the directory, milliseconds better spent when the store opens than in the first
        put, on a server's event loop."""
        if not self._files:
            self._roll(commitlog_offset)

    def _roll(self, commitlog_offset: int) -> IndexFile:
        name = commitlog_offset
        if self._files:
            old = self._files[-1]
            # The sealed file must be durable before a newer one exists: recovery checks
            # only the newest file's slot table.
            old.seal()
            name = max(name, old.name_offset + 1)
        created = IndexFile.create(
            os.path.join(self.directory, file_name(name)),
            fs=self.fs,
            slot_count=self.slot_count,
            max_entries=self.max_entries,
            hash_fn=self.hash_fn,
        )
        self._files.append(created)
        return created

    def lookup(
        self,
        key: bytes | str,
        key_matches: KeyMatches,
        max_results: int = DEFAULT_MAX_RESULTS,
    ) -> list[int]:
        """Commitlog offsets of records holding ``key``, newest put first, each once, at
        most ``max_results``.

        Every candidate is passed to ``key_matches(offset, key)`` (``key`` as given), which
        must read the record there and return True only if it holds ``key`` — and False,
        not raise, for an offset that is not a record start or lies beyond the commitlog
        (possible after a truncation). Raises CorruptionError for a damaged chain.
        """
        data = key_bytes(key)
        found: list[int] = []
        seen: set[int] = set()
        for index in reversed(self._files):
            for offset in index.candidates(data):
                if offset in seen:
                    continue
                seen.add(offset)
                if key_matches(offset, key):
                    found.append(offset)
                    if len(found) >= max_results:
                        return found
        return found

    def hash_sources(self) -> list[HashSource]:
        """``IndexFile.hash_source`` of every file, oldest first."""
        return [index.hash_source() for index in self._files]

    def flush(self) -> None:
        """Make every put so far durable (older files were flushed when they were sealed).
        May run in a worker thread while puts go on."""
        if self._files:
            self._files[-1].flush()

    def truncate_beyond(self, commitlog_end: int) -> int:
        """Forget what points at or beyond ``commitlog_end``: unlink every file whose
        begin offset is ``>= commitlog_end``, then undo the newest file's trailing entries
        at or beyond it. Returns the number of entries dropped. The broker calls this at
        start, after the commitlog cut its torn tail. Durable when it returns."""
        dropped = 0
        keep: list[IndexFile] = []
        doomed: list[IndexFile] = []
        for index in self._files:
            begin = index.begin_offset if index.entry_count else index.name_offset
            (doomed if begin >= commitlog_end else keep).append(index)
        for index in doomed:
            dropped += index.entry_count
            index.close(flush=False)
            self.fs.unlink(index.path)
        if doomed:
            self.fs.fsync_dir(self.directory)
        self._files = keep
        if keep:
            newest = keep[-1]
            newest.activate()
            dropped += newest.truncate_beyond(commitlog_end)
        return dropped

    def delete_before(self, commitlog_offset: int) -> int:
        """Retention: unlink every file but the newest whose entries all point below
        ``commitlog_offset`` (end offset below it); returns how many."""
        doomed = [
            index
            for index in self._files[:-1]
            if index.entry_count == 0 or index.end_offset < commitlog_offset
        ]
        for index in doomed:
            index.close()
            self.fs.unlink(index.path)
        if doomed:
            self.fs.fsync_dir(self.directory)
            self._files = [f for f in self._files if f not in doomed]
        return len(doomed)

    def close(self) -> None:
        """Flush the newest file and close every file."""
        files, self._files = self._files, []
        try:
            for index in files[-1:]:
                index.close()
        finally:
            for index in files[:-1]:
                index.close()

    def __enter__(self) -> IndexStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
