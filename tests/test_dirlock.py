"""storage.dirlock: one writer per data directory (flock on <data>/LOCK).

In one process: each ``acquire`` opens the file anew, and flock locks of two open files
conflict even in one process, so these tests see what a second process would. The
process tests (a second ``delayd serve`` / ``delayd broker``, kill -9) are in
test_serve_lifecycle.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from storage.dirlock import LOCK_NAME, DirectoryLock, DirectoryLockedError, Holder, read_holder
from storage.errors import StorageError


def test_the_lock_names_its_holder_and_refuses_a_second_writer(tmp_path):
    data = str(tmp_path / "data")  # made by acquire
    with DirectoryLock.acquire(data, "delayd serve") as lock:
        assert lock.held
        holder = read_holder(data)
        assert holder == lock.holder
        assert holder.pid == os.getpid()
        assert holder.host == socket.gethostname()
        assert holder.command == "delayd serve"
        with pytest.raises(DirectoryLockedError) as refused:
            DirectoryLock.acquire(data, "delayd broker")
        message = str(refused.value)
        assert f"pid {os.getpid()}" in message
        assert f"host {socket.gethostname()}" in message
        assert "delayd serve" in message
        assert "Stop that process" in message  # what to do
        assert refused.value.holder == holder
    assert not lock.held


def test_release_frees_the_lock_and_empties_the_name(tmp_path):
    data = str(tmp_path)
    lock = DirectoryLock.acquire(data, "delayd serve")
    lock.release()
    lock.release()  # idempotent
    assert (tmp_path / LOCK_NAME).read_bytes() == b""  # the file stays, naming nobody
    assert read_holder(data) is None
    with DirectoryLock.acquire(data, "delayd broker") as again:
        assert read_holder(data) == again.holder


def test_a_stale_name_does_not_hold_the_directory(tmp_path):
    """A holder killed with -9 leaves its name in LOCK; the kernel freed the lock, so
    the next writer takes it and writes its own name over the stale one."""
    stale = Holder(pid=999_999, host="elsewhere-and-much-longer", started="x", command="old")
    (tmp_path / LOCK_NAME).write_bytes(stale.encode() + b"padding=" + b"z" * 100 + b"\n")
    with DirectoryLock.acquire(str(tmp_path), "delayd serve") as lock:
        assert read_holder(str(tmp_path)) == lock.holder
        assert b"padding" not in (tmp_path / LOCK_NAME).read_bytes()


def test_a_killed_holder_frees_the_lock(tmp_path):
    """flock goes with the holder's descriptor: kill -9 of the holding process frees
    the directory at once, with nothing to clean up by hand."""
    code = (
        "import sys, time\n"
        "from storage.dirlock import DirectoryLock\n"
        f"DirectoryLock.acquire({str(tmp_path)!r}, 'holder')\n"
        "print('held', flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b"held\n"
        with pytest.raises(DirectoryLockedError) as refused:
            DirectoryLock.acquire(str(tmp_path), "second")
        assert refused.value.holder is not None
        assert refused.value.holder.pid == child.pid
        child.kill()
        child.wait(10)
        with DirectoryLock.acquire(str(tmp_path), "after the kill") as lock:
            assert lock.held
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        if child.stdout is not None:
            child.stdout.close()


def test_an_unnamed_holder_is_still_refused(tmp_path):
    """A lock file that names nobody (another tool's, or written this instant) still
    locks: the kernel's lock decides, the text only informs."""
    import fcntl

    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(DirectoryLockedError, match="another process"):
            DirectoryLock.acquire(str(tmp_path), "delayd serve")
    finally:
        os.close(fd)


def test_a_directory_that_cannot_be_made_is_a_storage_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(StorageError, match="cannot open the lock file") as failed:
        DirectoryLock.acquire(str(tmp_path / "file"), "delayd serve")
    assert not isinstance(failed.value, DirectoryLockedError)
