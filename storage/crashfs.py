"""An in-memory file system that can lose power: the crash simulator for storage/ tests.

:class:`CrashSimFileSystem` implements :class:`storage.fs.FileSystem` in memory and
remembers, beside what a reader sees now, what a power loss would leave on disk. It is
the idea of leveldb's FaultInjectionTestEnv (``util/fault_injection_test_env.cc``: drop
unsynced data, delete files created since the last directory sync) and SQLite's crash
VFS (``src/test6.c``: after a crash, each unsynced sector is independently written,
lost or garbled).

The durability model — conservative ext4, stricter than most real file systems:

* File data belongs to the inode. ``fsync``/``fdatasync`` make the inode's current
  bytes and size durable; until then every ``pwrite`` and ``ftruncate`` is pending.
* Directory entries belong to the directory. Creating a file or directory, ``replace``
  and ``unlink`` change only the current entries; ``fsync_dir`` of that directory makes
  them durable. Fsyncing a file does not persist its name, and a rename is undone unless
  the directories involved are synced.
* After a power loss the tree is rebuilt from the root through durable entries only: a
  file created but never dir-synced vanishes (with its synced bytes), an unlinked file
  whose unlink was never dir-synced reappears, and every reachable inode shows its
  durable content plus some of its pending changes, chosen by the mode:

  ``drop``    none of them (leveldb's DropUnsyncedFileData);
  ``prefix``  the first k pending writes/truncates, k random (writes reach disk in order);
  ``pages``   each page (4 KiB unless set) that differs from the durable bytes is
              independently new or old (SQLite's crash VFS); a pending shrink is one
              more independent coin; the length is the durable one, extended to the end
              of the last new page;
  ``torn``    everything except the last differing page, of which only a random prefix
              is new; its rest reads as old bytes or zeros, and if it extended the file
              the size update may be lost as well.

Two faults short of a power loss can be injected as well: a disk of ``capacity`` bytes
(a ``pwrite`` that would grow the files past it writes what fits, as a real write to a
filling disk does, and fails with ENOSPC; ``capacity = None`` is unlimited) and failing
fsyncs (:meth:`CrashSimFileSystem.fail_fsyncs`: the next ones raise EIO and make
nothing durable).

Every mutating call is a crash point; :meth:`CrashSimFileSystem.crash_after` makes one
of them raise :class:`SimulatedCrash`, and :func:`crash_points` / :func:`run_to_crash`
drive a workload through all of them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import threading
from collections.abc import Callable
from typing import Any

PAGE_SIZE = 4096
MODES = ("drop", "prefix", "pages", "torn")


class SimulatedCrash(BaseException):
    """The power went out. Derives from BaseException, like KeyboardInterrupt, so that an
    ``except Exception`` (or ``except OSError``) in the code under test cannot swallow it.
    """


class _File:
    __slots__ = ("data", "durable", "pending")

    def __init__(self) -> None:
        self.data = bytearray()  # what a reader sees now
        self.durable = b""  # what the last fsync made durable
        # Changes since that fsync, in order: ("w", offset, bytes) or ("t", size).
        self.pending: list[tuple[Any, ...]] = []


class _Dir:
    __slots__ = ("durable", "entries")

    def __init__(self) -> None:
        self.entries: dict[str, _File | _Dir] = {}  # what a reader sees now
        self.durable: dict[str, _File | _Dir] = {}  # what the last fsync_dir made durable


def _os_error(code: int, path: str) -> OSError:
    # OSError(errno, ...) picks the matching subclass (FileNotFoundError, ...), as os does.
    return OSError(code, os.strerror(code), path)


def _apply(content: bytearray, op: tuple[Any, ...]) -> None:
    if op[0] == "t":
        size = op[1]
        if size < len(content):
            del content[size:]
        else:
            content.extend(bytes(size - len(content)))
        return
    _, offset, data = op
    if offset > len(content):
        content.extend(bytes(offset - len(content)))  # a hole reads as zeros
    content[offset : offset + len(data)] = data


class CrashSimFileSystem:
    """A :class:`storage.fs.FileSystem` in memory that records what fsync made durable.

    The root directory ``/`` exists and is durable; paths are normalised with
    :func:`os.path.normpath`, and relative paths are taken from the root. Thread-safe:
    one lock around every call, because the trio layers fsync from worker threads.

    ``page_size`` is the unit of the "pages" and "torn" modes (SQLite's crash VFS makes
    its sector size a parameter too): a test with small files picks a small one so that
    a file holds several pages that can be lost independently.
    """

    def __init__(self, page_size: int = PAGE_SIZE) -> None:
        self.page_size = page_size  # the unit "pages" and "torn" keep, lose or tear
        self._lock = threading.Lock()
        self._root = _Dir()
        self._fds: dict[int, tuple[_File, bool]] = {}  # fd -> (inode, writable)
        self._next_fd = 3
        self._ops = 0
        self._crash_at: int | None = None
        self._crashed = False
        # Bytes the files may hold in all (None: unlimited); set it to fill the disk,
        # raise it (or delete files) to free space.
        self.capacity: int | None = None
        self._fsync_failures = 0
        self._fsync_errno = errno.EIO

    # -- crash control ----------------------------------------------------------------

    @property
    def ops(self) -> int:
        """Mutating calls performed so far: the crash points a workload has passed."""
        return self._ops

    @property
    def crashed(self) -> bool:
        return self._crashed

    def crash_after(self, n: int) -> None:
        """Let the first ``n`` mutating calls (counted from the creation of this file
        system) succeed; the next one, and every call after it, raises
        :class:`SimulatedCrash` without taking effect."""
        self._crash_at = n

    def restart(self) -> None:
        """The process died (kill -9) but the machine did not: the page cache survives,
        so every file and entry stays as it is now, still unsynced. Open fds are gone
        and the crash point is disarmed, so a new "process" can reopen the store here
        (and a later :meth:`materialize` shows a power loss after that restart)."""
        with self._lock:
            self._fds.clear()
            self._crash_at = None
            self._crashed = False

    def fail_fsyncs(self, count: int = 1, code: int = errno.EIO) -> None:
        """Make the next ``count`` fsyncs/fdatasyncs (of files; not of directories) raise
        OSError(``code``) without making anything durable."""
        with self._lock:
            self._fsync_failures = count
            self._fsync_errno = code

    def used_bytes(self) -> int:
        """Bytes held by every file reachable from the root or open: what ``capacity``
        is measured against."""
        with self._lock:
            return self._used()

    def _used(self) -> int:
        seen: dict[int, int] = {id(inode): len(inode.data) for inode, _ in self._fds.values()}
        stack = [self._root]
        while stack:
            node = stack.pop()
            for child in node.entries.values():
                if isinstance(child, _Dir):
                    stack.append(child)
                else:
                    seen[id(child)] = len(child.data)
        return sum(seen.values())

    def _check(self) -> None:
        if self._crashed:
            raise SimulatedCrash("the file system lost power earlier")

    def _mutation(self) -> None:
        self._check()
        if self._crash_at is not None and self._ops >= self._crash_at:
            self._crashed = True
            raise SimulatedCrash(f"power lost at mutating call {self._ops + 1}")
        self._ops += 1

    # -- paths ------------------------------------------------------------------------

    @staticmethod
    def _parts(path: str) -> list[str]:
        parts = [p for p in os.path.normpath(path).split("/") if p not in ("", ".")]
        if ".." in parts:
            raise ValueError(f"path escapes the root: {path!r}")
        return parts

    def _lookup(self, path: str) -> _File | _Dir | None:
        node: _File | _Dir = self._root
        for name in self._parts(path):
            if not isinstance(node, _Dir) or name not in node.entries:
                return None
            node = node.entries[name]
        return node

    def _parent(self, path: str) -> tuple[_Dir, str]:
        parts = self._parts(path)
        if not parts:
            raise _os_error(errno.EBUSY, path)  # the root cannot be created or moved
        return self._dir("/".join(parts[:-1]), named=path), parts[-1]

    def _dir(self, path: str, named: str | None = None) -> _Dir:
        """The directory at ``path``; ENOENT or ENOTDIR (naming ``named``, by default
        ``path``) when there is none."""
        node = self._lookup(path)
        if node is None:
            raise _os_error(errno.ENOENT, named or path)
        if not isinstance(node, _Dir):
            raise _os_error(errno.ENOTDIR, named or path)
        return node

    def _file(self, fd: int, write: bool = False) -> _File:
        if fd not in self._fds:
            raise _os_error(errno.EBADF, f"fd {fd}")
        inode, writable = self._fds[fd]
        if write and not writable:
            raise _os_error(errno.EBADF, f"fd {fd}")
        return inode

    # -- FileSystem -------------------------------------------------------------------

    def open(self, path: str, flags: int) -> int:
        with self._lock:
            self._check()
            parent, name = self._parent(path)
            node = parent.entries.get(name)
            if isinstance(node, _Dir):
                raise _os_error(errno.EISDIR, path)
            if node is not None and flags & os.O_CREAT and flags & os.O_EXCL:
                raise _os_error(errno.EEXIST, path)
            if node is None:
                if not flags & os.O_CREAT:
                    raise _os_error(errno.ENOENT, path)
                self._mutation()
                node = parent.entries[name] = _File()
            writable = flags & (os.O_WRONLY | os.O_RDWR) != 0
            if flags & os.O_TRUNC and writable:
                self._mutation()
                self._truncate(node, 0)
            fd = self._next_fd
            self._next_fd += 1
            self._fds[fd] = (node, writable)
            return fd

    def close(self, fd: int) -> None:
        with self._lock:
            self._check()
            self._file(fd)
            del self._fds[fd]

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        with self._lock:
            self._check()
            return bytes(self._file(fd).data[offset : offset + size])

    def pwrite(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        with self._lock:
            self._check()
            inode = self._file(fd, write=True)
            data = bytes(data)
            fits = len(data)
            if self.capacity is not None:
                room = self.capacity - self._used()
                growth = offset + len(data) - len(inode.data)
                if growth > room:
                    # A filling disk takes the part that still fits, then refuses.
                    fits = max(0, min(len(data), len(inode.data) + max(room, 0) - offset))
            self._mutation()
            if fits:
                op = ("w", offset, data[:fits])
                _apply(inode.data, op)
                inode.pending.append(op)
            if fits < len(data):
                raise _os_error(errno.ENOSPC, f"fd {fd}")
            return fits

    def fsync(self, fd: int) -> None:
        with self._lock:
            self._check()
            inode = self._file(fd)
            self._mutation()
            if self._fsync_failures:
                self._fsync_failures -= 1
                raise _os_error(self._fsync_errno, f"fd {fd}")
            inode.durable = bytes(inode.data)
            inode.pending.clear()

    # Nothing here models metadata beyond size, which fdatasync persists too.
    fdatasync = fsync

    def ftruncate(self, fd: int, size: int) -> None:
        with self._lock:
            self._check()
            inode = self._file(fd, write=True)
            self._mutation()
            self._truncate(inode, size)

    @staticmethod
    def _truncate(inode: _File, size: int) -> None:
        op = ("t", size)
        _apply(inode.data, op)
        inode.pending.append(op)

    def fsize(self, fd: int) -> int:
        with self._lock:
            self._check()
            return len(self._file(fd).data)

    def replace(self, src: str, dst: str) -> None:
        with self._lock:
            self._check()
            src_dir, src_name = self._parent(src)
            dst_dir, dst_name = self._parent(dst)
            node = src_dir.entries.get(src_name)
            if node is None:
                raise _os_error(errno.ENOENT, src)
            if isinstance(dst_dir.entries.get(dst_name), _Dir):
                raise _os_error(errno.EISDIR, dst)
            self._mutation()
            del src_dir.entries[src_name]
            dst_dir.entries[dst_name] = node

    def unlink(self, path: str) -> None:
        with self._lock:
            self._check()
            parent, name = self._parent(path)
            node = parent.entries.get(name)
            if node is None:
                raise _os_error(errno.ENOENT, path)
            if isinstance(node, _Dir):
                raise _os_error(errno.EISDIR, path)
            self._mutation()
            del parent.entries[name]

    def mkdir(self, path: str) -> None:
        with self._lock:
            self._check()
            self._mutation()
            node = self._root
            for name in self._parts(path):
                child = node.entries.get(name)
                if child is None:
                    # Like any new entry, durable only once ``node`` is fsync_dir'ed.
                    child = node.entries[name] = _Dir()
                if not isinstance(child, _Dir):
                    raise _os_error(errno.EEXIST, path)
                node = child

    def listdir(self, path: str) -> list[str]:
        with self._lock:
            self._check()
            return sorted(self._dir(path).entries)

    def exists(self, path: str) -> bool:
        with self._lock:
            self._check()
            return self._lookup(path) is not None

    def fsync_dir(self, path: str) -> None:
        with self._lock:
            self._check()
            node = self._dir(path)
            self._mutation()
            node.durable = dict(node.entries)

    def free_bytes(self, path: str) -> int:
        with self._lock:
            self._check()
            if self.capacity is None:
                return 1 << 50  # unlimited: a number no test comes near
            return max(0, self.capacity - self._used())

    # -- power loss -------------------------------------------------------------------

    def materialize(self, dest_dir: str, mode: str, rng: random.Random) -> None:
        """Write under ``dest_dir`` (which maps to ``/``) a real tree that a power loss
        now could leave, per ``mode`` (one of :data:`MODES`). Changes nothing here, so
        one crashed file system can be materialised in every mode."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
        with self._lock:
            os.makedirs(dest_dir, exist_ok=True)
            # An inode reachable under two names (a rename synced in one directory only)
            # must show the same bytes under both.
            contents: dict[int, bytes] = {}
            self._write_tree(self._root, dest_dir, mode, rng, contents)

    def _write_tree(
        self, node: _Dir, dest: str, mode: str, rng: random.Random, contents: dict[int, bytes]
    ) -> None:
        for name, child in sorted(node.durable.items()):
            target = os.path.join(dest, name)
            if isinstance(child, _Dir):
                os.mkdir(target)
                self._write_tree(child, target, mode, rng, contents)
                continue
            if id(child) not in contents:
                contents[id(child)] = _after_power_loss(child, mode, rng, self.page_size)
            with open(target, "wb") as f:
                f.write(contents[id(child)])


def _after_power_loss(inode: _File, mode: str, rng: random.Random, page: int) -> bytes:
    if not inode.pending or mode == "drop":
        return inode.durable
    if mode == "prefix":
        out = bytearray(inode.durable)
        for op in inode.pending[: rng.randint(0, len(inode.pending))]:
            _apply(out, op)
        return bytes(out)
    if mode == "pages":
        return _pages(inode, rng, page)
    return _torn(inode, rng, page)


def _dirty_pages(old: bytes, new: bytes, page: int) -> list[int]:
    last = (max(len(old), len(new)) + page - 1) // page
    return [
        p for p in range(last) if old[p * page : (p + 1) * page] != new[p * page : (p + 1) * page]
    ]


def _pages(inode: _File, rng: random.Random, page: int) -> bytes:
    new = bytes(inode.data)
    base = bytearray(inode.durable)
    # The smallest size a pending ftruncate set: if that shrink reached the disk, bytes
    # past it are gone and read as zeros unless a later page rewrote them.
    low = min([len(base)] + [op[1] for op in inode.pending if op[0] == "t"])
    if low < len(base) and rng.random() < 0.5:
        del base[low:]
    out = bytearray(base)
    end = len(base)
    for p in _dirty_pages(bytes(base), new, page):
        if rng.random() < 0.5:
            continue  # this page never left the page cache
        start = p * page
        kept = new[start : start + page]
        if len(out) < start + len(kept):
            out.extend(bytes(start + len(kept) - len(out)))
        out[start : start + len(kept)] = kept
        end = max(end, start + len(kept))
    return bytes(out[:end])


def _torn(inode: _File, rng: random.Random, page: int) -> bytes:
    old, new = inode.durable, bytes(inode.data)
    dirty = _dirty_pages(old, new, page)
    if not dirty:
        return new
    start = dirty[-1] * page
    page_end = min(start + page, len(new))
    if page_end <= start:
        # The last difference is a pending shrink, and a shrink cannot tear: either it
        # reached the disk or the old page is still there.
        return new if rng.random() < 0.5 else new + old[len(new) :]
    tear = start + rng.randrange(page_end - start)
    out = bytearray(new)
    # Past the tear the page holds what was there before: old bytes, or zeros where the
    # write extended the file.
    kept_old = old[tear:page_end]
    out[tear:page_end] = kept_old + bytes(page_end - tear - len(kept_old))
    if page_end == len(new) > len(old) and rng.random() < 0.5:
        del out[max(tear, len(old)) :]  # the size update was lost with the data
    return bytes(out)


def crash_points(workload: Callable[[CrashSimFileSystem], object]) -> int:
    """Run ``workload`` on a fresh simulator without crashing; return its crash points
    (its mutating calls). ``workload`` must be deterministic for the count to mean
    anything when it is replayed with :func:`run_to_crash`."""
    fs = CrashSimFileSystem()
    workload(fs)
    return fs.ops


def run_to_crash(
    workload: Callable[[CrashSimFileSystem], object], k: int, page_size: int = PAGE_SIZE
) -> CrashSimFileSystem:
    """Run ``workload`` on a fresh simulator that loses power at its ``k+1``-th mutating
    call (or not at all if it makes no more than ``k``); return the simulator, ready for
    :meth:`CrashSimFileSystem.materialize`."""
    fs = CrashSimFileSystem(page_size)
    fs.crash_after(k)
    with contextlib.suppress(SimulatedCrash):
        workload(fs)
    return fs
