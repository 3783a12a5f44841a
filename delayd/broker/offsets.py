"""Committed consumer offsets per (group, subject, queue): an append-only log of commits.

An offset is the next queue offset the group will read: everything before it is
consumed. The log is what replication ships for them (a stream per file, as the
commitlog is one; docs/replication.md "Broker streams"), so it is only ever appended to
and cut back, never rewritten in place.

On disk, ``<broker>/offsets/<20-digit generation>``: RecordFiles of storage-framed
records, each generation starting with a SNAPSHOT of the whole table followed by the
COMMITs made after it::

    SNAPSHOT (type 3)  {"version": 1, "offsets": {"<group>": {"<subject>": {"<queue>": <offset>}}}}
    COMMIT   (type 4)  ["<group>", "<subject>", <queue>, <offset>]

The table is the newest generation that starts with a snapshot, with its commits (and
those of any later generation) applied in order; older generations are superseded, since
a generation is closed for appends before the next one's snapshot is taken. *Compaction*
(``compact``, from the broker's checkpoint once a generation has grown past
``COMPACT_BYTES``) starts the next generation with a snapshot, makes it durable, then
deletes the older ones: a crash at any point leaves a table equal to the one before.

Durability is as it always was: a commit is written to the file at once (it survives a
``kill -9``) and made durable by ``flush``, which the broker runs every
``checkpoint_interval_ms`` and at shutdown, so a power loss forgets at most that interval
of commits and those messages are delivered again (at-least-once; RocketMQ's
ConsumerOffsetManager persists every 5 s the same way). A durable COMMIT_OFFSET (the
consumers' ``commit="sync"``) does not wait for that: the broker flushes at once and
answers after ``saved_version`` covers the commit.

A follower's store (``following``) never writes: it receives the leader's records raw
(``file``), applies them with ``apply_appended`` and, after a truncation, rebuilds the
table from disk with ``reload``, the code ``open`` uses.

A data directory of an older release holds ``offsets.json`` (the snapshot alone, JSON
above); ``open`` migrates it into generation 0 and then removes it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable

from storage.errors import CorruptionError, DiskFullError
from storage.fs import REAL_FS, FileSystem, create_dirs_durably
from storage.record_file import RecordFile
from storage.scan import Record

log = logging.getLogger(__name__)

DIR_NAME = "offsets"
LEGACY_FILE = "offsets.json"
VERSION = 1
SNAPSHOT_TYPE = 3
COMMIT_TYPE = 4
# A generation longer than this is compacted at the next checkpoint (when the table's
# snapshot is well smaller than it).
COMPACT_BYTES = 4 << 20

OffsetKey = tuple[str, str, int]  # (group, subject, queue)


def generation_name(generation: int) -> str:
    return f"{generation:020d}"


def is_generation_name(name: str) -> bool:
    return len(name) == 20 and name.isdigit()


class OffsetStore:
    """The committed offsets; see the module docstring. Use :meth:`open`."""

    def __init__(self, directory: str, fs: FileSystem, compact_bytes: int) -> None:
        self.directory = directory  # the offsets/ directory
        self.fs = fs
        self.compact_bytes = compact_bytes
        self.following = False  # a follower's copy: written by replication only
        # Called on the event loop after every append and every flush: replication's
        # growth signal (BrokerStreams.grew).
        self.on_grew: Callable[[], None] = lambda: None
        self._offsets: dict[OffsetKey, int] = {}
        self._files: dict[int, RecordFile] = {}  # generation -> file, ascending
        self._table_generation: int | None = None  # the snapshot the table starts from
        self._applied: dict[int, int] = {}  # generation -> end of what the table holds
        self._version = 0  # bumped by every change
        self._saved_version = 0
        self._unlogged = False  # a commit the log lacks (its disk was full)

    @classmethod
    def open(
        cls, broker_dir: str, *, fs: FileSystem = REAL_FS, compact_bytes: int = COMPACT_BYTES
    ) -> OffsetStore:
        """Open ``<broker_dir>/offsets/`` (none yet: empty), migrating an older
        ``<broker_dir>/offsets.json`` into it.

        Raises CorruptionError when a file is not what this module writes.
        """
        store = cls(os.path.join(broker_dir, DIR_NAME), fs, compact_bytes)
        create_dirs_durably(fs, store.directory)
        for name in sorted(fs.listdir(store.directory)):
            if is_generation_name(name):
                store.file(int(name))
        store.reload()
        legacy = os.path.join(broker_dir, LEGACY_FILE)
        if fs.exists(legacy):
            if store._table_generation is None:
                # No snapshot made it to disk: any generation file is a migration that
                # a crash cut short.
                for generation in store.generations():
                    store._discard(generation)
                store._migrate(legacy)
                store.reload()
            fs.unlink(legacy)
            fs.fsync_dir(broker_dir)
        return store

    def _migrate(self, legacy: str) -> None:
        fd = self.fs.open(legacy, os.O_RDONLY)
        try:
            raw = self.fs.pread(fd, self.fs.fsize(fd), 0)
        finally:
            self.fs.close(fd)
        self._offsets = _parse(legacy, raw)
        first = self.file(0)
        first.append(self._snapshot_payload(), SNAPSHOT_TYPE)
        first.flush()
        log.info("offsets: %s migrated into %s", legacy, first.path)

    # ------------------------------------------------------------------ files (streams)

    def generations(self) -> list[int]:
        return sorted(self._files)

    def file(self, generation: int) -> RecordFile:
        """The file of ``generation``, opened (created empty when missing: a follower
        receiving a generation's first records). Raises ValueError for a generation
        this leader compacted away (a late reader must not bring it back)."""
        found = self._files.get(generation)
        if found is None:
            if not self.following and self._files and generation < max(self._files):
                raise ValueError(
                    f"offsets generation {generation} was compacted away: the newest is "
                    f"{max(self._files)}"
                )
            path = os.path.join(self.directory, generation_name(generation))
            found = self._files[generation] = RecordFile.open(path, fs=self.fs)
        return found

    def position(self) -> tuple[int, int]:
        """(generation, end offset) of the newest commit: what a replicated durable
        commit waits to be acknowledged."""
        if not self._files:
            return 0, 0
        generation = max(self._files)
        return generation, self._files[generation].end_offset

    # ------------------------------------------------------------------ the table

    def get(self, group: str, subject: str, queue: int) -> int | None:
        return self._offsets.get((group, subject, queue))

    def set(self, group: str, subject: str, queue: int, offset: int) -> None:
        """Commit ``offset``: in memory at once, appended to the log (not durable until
        :meth:`flush`). A full disk keeps it in memory only; the next compaction's
        snapshot writes it."""
        if self.following:
            raise RuntimeError("a follower's offsets change only by replication")
        key = (group, subject, queue)
        if self._offsets.get(key) == offset:
            return
        self._offsets[key] = offset
        self._version += 1
        try:
            current = self._writable()
            current.append(json.dumps([group, subject, queue, offset]).encode(), COMMIT_TYPE)
        except DiskFullError as exc:
            if not self._unlogged:
                log.warning("offsets: commits kept in memory until space returns: %s", exc)
            self._unlogged = True
            return
        self._applied[max(self._files)] = current.end_offset
        self.on_grew()

    def items(self) -> list[tuple[OffsetKey, int]]:
        return list(self._offsets.items())

    @property
    def dirty(self) -> bool:
        return self._version != self._saved_version

    @property
    def version(self) -> int:
        """Bumped by every change: a flush that began at this version or later holds
        them all."""
        return self._version

    @property
    def saved_version(self) -> int:
        """The version last made durable."""
        return self._saved_version

    def _writable(self) -> RecordFile:
        if not self._files:
            self._start_generation(0)
        return self._files[max(self._files)]

    def _start_generation(self, generation: int) -> RecordFile:
        created = self.file(generation)
        created.append(self._snapshot_payload(), SNAPSHOT_TYPE)
        self._table_generation = generation
        self._applied[generation] = created.end_offset
        self.on_grew()
        return created

    def _snapshot_payload(self) -> bytes:
        nested: dict[str, dict[str, dict[str, int]]] = {}
        for (group, subject, queue), offset in sorted(self._offsets.items()):
            nested.setdefault(group, {}).setdefault(subject, {})[str(queue)] = offset
        return json.dumps({"version": VERSION, "offsets": nested}, sort_keys=True).encode()

    # ------------------------------------------------------------------ durability

    def flush(self, version: int | None = None) -> None:
        """Make every commit made so far durable (blocking: run it in a worker thread);
        ``version``: the ``version`` read on the event loop before the call."""
        if version is None:
            version = self._version
        for generation in self.generations():
            self._files[generation].flush()
        if version > self._saved_version and not self._unlogged:
            self._saved_version = version

    def needs_compaction(self) -> bool:
        if self.following or not self._files:
            return self._unlogged
        return self._unlogged or self._files[max(self._files)].end_offset > self.compact_bytes

    def compact(self) -> None:
        """Start the next generation with a snapshot of the table, make it durable and
        delete the older ones (blocking, on the event loop: the commits that follow go
        to the new generation). Raises DiskFullError (the old generations stand)."""
        version = self._version
        generation = max(self._files, default=-1) + 1
        table_generation = self._table_generation
        try:
            self._start_generation(generation).flush()
        except DiskFullError:
            if generation in self._files:
                self._discard(generation)
            self._applied.pop(generation, None)
            self._table_generation = table_generation
            raise
        self._unlogged = False
        self._saved_version = max(self._saved_version, version)
        self.drop_superseded()
        self.on_grew()

    def drop_superseded(self) -> None:
        """Delete the generations older than the one the table starts from, once that
        one's snapshot is durable (a follower's copy too: its leader did the same)."""
        base = self._table_generation
        if base is None or self._files[base].durable_offset == 0:
            return
        doomed = [g for g in self._files if g < base]
        for generation in doomed:
            self._discard(generation)
            self._applied.pop(generation, None)
        if doomed:
            self.fs.fsync_dir(self.directory)

    def _discard(self, generation: int) -> None:
        self._files.pop(generation).close()
        self.fs.unlink(os.path.join(self.directory, generation_name(generation)))

    # ------------------------------------------------------------------ deriving

    def reload(self) -> None:
        """Rebuild the table from the files on disk: the newest generation that starts
        with a snapshot, then every commit after it (module docstring)."""
        self._offsets = {}
        self._applied = {}
        self._table_generation = None
        for generation in reversed(self.generations()):
            first = next(iter(self._files[generation].iter_from(0)), None)
            if first is not None and first.type == SNAPSHOT_TYPE:
                self._table_generation = generation
                break
        self.apply_appended()
        self._version += 1
        self._saved_version = self._version

    def apply_appended(self) -> bool:
        """Apply the records appended to the files since the table last saw them (a
        follower, after each group commit); whether the table changed. A generation
        older than the table's snapshot is skipped: that snapshot holds all of it."""
        changed = False
        for generation in self.generations():
            source = self._files[generation]
            start = self._applied.get(generation, 0)
            if start >= source.end_offset:
                continue
            for record in source.iter_from(start):
                if record.type == SNAPSHOT_TYPE and record.offset == 0:
                    if self._table_generation is None or generation >= self._table_generation:
                        self._offsets = _parse(source.path, record.payload)
                        self._table_generation = generation
                        changed = True
                elif record.type == COMMIT_TYPE:
                    if self._table_generation is not None and generation >= self._table_generation:
                        group, subject, queue, offset = _commit(source.path, record)
                        self._offsets[(group, subject, queue)] = offset
                        changed = True
                else:
                    raise CorruptionError(
                        source.path, record.offset, len(record.payload), "not an offsets record"
                    )
            self._applied[generation] = source.end_offset
        if changed:
            self._version += 1
            if self.following:
                self._saved_version = self._version  # replication flushed them first
        return changed

    def close(self) -> None:
        for generation in self.generations():
            self._files.pop(generation).close()


def _commit(path: str, record: Record) -> tuple[str, str, int, int]:
    try:
        group, subject, queue, offset = json.loads(record.payload)
        if not (isinstance(queue, int) and isinstance(offset, int) and offset >= 0):
            raise ValueError(f"queue {queue!r} offset {offset!r}")
        return str(group), str(subject), queue, offset
    except (ValueError, TypeError) as exc:
        raise CorruptionError(
            path, record.offset, len(record.payload), f"not an offsets commit: {exc}"
        ) from None


def _parse(path: str, raw: bytes) -> dict[OffsetKey, int]:
    try:
        doc = json.loads(raw)
        if doc.get("version") != VERSION:
            raise ValueError(f"version {doc.get('version')!r}, expected {VERSION}")
        offsets: dict[OffsetKey, int] = {}
        for group, subjects in doc["offsets"].items():
            for subject, queues in subjects.items():
                for queue, offset in queues.items():
                    if not isinstance(offset, int) or offset < 0:
                        raise ValueError(f"offset {offset!r} of {group}/{subject}/{queue}")
                    offsets[(group, subject, int(queue))] = offset
        return offsets
    except (ValueError, KeyError, AttributeError, TypeError) as exc:
        raise CorruptionError(path, 0, len(raw), f"not a delayd offsets snapshot: {exc}") from None
