"""One writer per data directory: an exclusive ``flock`` on ``<data>/LOCK``.

Two processes writing the same logs corrupt them quietly (each recovers, replays and
checkpoints over the other), so every process that writes a data directory takes this
lock before it touches anything else there, and holds it until it exits. The lock is
the kernel's (``flock(2)``, as leveldb's ``LOCK`` file), not the file's existence: it is
released when the holder's descriptor closes, so an exit, a crash or ``kill -9`` frees
it and no stale lock ever needs removing by hand. The file's text only names the
holder (pid, host, start time, what runs) for the message a refused writer prints.

Readers (``delayd inspect``, ``delayd audit``) take no lock: they open files read-only.

flock is local to one machine; on NFS it is not a reliable mutual exclusion. A data
directory belongs on a local disk anyway (docs/operations.md).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from dataclasses import dataclass

from storage.errors import StorageError

LOCK_NAME = "LOCK"


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a data directory, as its LOCK file names it."""

    pid: int | None
    host: str
    started: str  # ISO 8601 UTC, when the holder took the lock
    command: str

    def describe(self) -> str:
        pid = "?" if self.pid is None else str(self.pid)
        return f"pid {pid} on host {self.host} ({self.command}, since {self.started})"

    def encode(self) -> bytes:
        return (
            f"pid={self.pid}\nhost={self.host}\nstarted={self.started}\ncommand={self.command}\n"
        ).encode()

    @classmethod
    def decode(cls, text: str) -> Holder | None:
        """The holder a LOCK file's text names; None when it names none (empty: being
        written this instant, or released)."""
        fields = dict(line.partition("=")[::2] for line in text.splitlines() if "=" in line)
        if not fields:
            return None
        pid = fields.get("pid", "")
        return cls(
            pid=int(pid) if pid.isdigit() else None,
            host=fields.get("host", "?"),
            started=fields.get("started", "?"),
            command=fields.get("command", "?"),
        )


class DirectoryLockedError(StorageError):
    """Another process holds the data directory's lock."""

    def __init__(self, directory: str, holder: Holder | None) -> None:
        self.directory = directory
        self.holder = holder
        who = holder.describe() if holder is not None else "another process (it names none)"
        super().__init__(
            f"data directory {directory} is in use by {who}: one process writes a data "
            "directory at a time. Stop that process first, or give this one another "
            "--data directory."
        )


class DirectoryLock:
    """The held lock of one data directory; ``release`` (or exiting) frees it."""

    def __init__(self, directory: str, fd: int, holder: Holder) -> None:
        self.directory = directory
        self.holder = holder
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, directory: str, command: str) -> DirectoryLock:
        """Take ``directory``'s lock (creating the directory and its LOCK file if need
        be) for this process, which runs ``command`` (e.g. "delayd serve"); at once.

        Raises DirectoryLockedError (naming the holder) when another process holds it,
        StorageError when the directory or LOCK file cannot be made or opened.
        """
        path = os.path.join(directory, LOCK_NAME)
        try:
            os.makedirs(directory, exist_ok=True)
            # O_CLOEXEC: a child process (taskset, a tool) must not inherit the lock.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot open the lock file {path}: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise DirectoryLockedError(directory, read_holder(directory)) from None
            raise StorageError(f"cannot lock {path}: {exc}") from None
        holder = Holder(
            pid=os.getpid(),
            host=socket.gethostname(),
            started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            command=command,
        )
        try:
            # Written over, then cut: the file never reads empty while held.
            text = holder.encode()
            os.pwrite(fd, text, 0)
            os.ftruncate(fd, len(text))
        except OSError as exc:
            os.close(fd)
            raise StorageError(f"cannot write the lock file {path}: {exc}") from None
        return cls(directory, fd, holder)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Free the lock (idempotent). The LOCK file stays, emptied: removing it would
        let a process that opened it just before lock a file nobody else can see."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass  # the name is only informative; the lock goes with the descriptor
        finally:
            os.close(fd)

    def __enter__(self) -> DirectoryLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def read_holder(directory: str) -> Holder | None:
    """Who the LOCK file of ``directory`` names (None: no file, or it names nobody).
    Informative only: whether the lock is held is the kernel's to say."""
    try:
        with open(os.path.join(directory, LOCK_NAME), encoding="utf-8", errors="replace") as f:
            return Holder.decode(f.read(4096))
    except FileNotFoundError:
        return None
