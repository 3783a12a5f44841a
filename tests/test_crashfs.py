"""The crash simulator itself: what it keeps and loses at a power loss, and a contract
test that it reads like the real file system (STYLE.md #10)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from storage.crashfs import (
    MODES,
    PAGE_SIZE,
    CrashSimFileSystem,
    SimulatedCrash,
    crash_points,
    run_to_crash,
)
from storage.fs import O_READ, O_WRITE, REAL_FS, FileSystem


def durable_dir(fs: CrashSimFileSystem, path: str) -> None:
    """A directory whose own entry is already durable (its parent was dir-synced)."""
    fs.mkdir(path)
    fs.fsync_dir(os.path.dirname(path))


def durable_file(fs: CrashSimFileSystem, data: bytes = b"") -> int:
    """A new /d/f in a durable /d, holding ``data`` synced, and its name durable (the
    directory synced after it was created); its descriptor."""
    durable_dir(fs, "/d")
    fd = fs.open("/d/f", O_WRITE)
    if data:
        fs.pwrite(fd, data, 0)
        fs.fsync(fd)
    fs.fsync_dir("/d")
    return fd


def write_file(fs: FileSystem, path: str, data: bytes, sync: bool) -> None:
    fd = fs.open(path, O_WRITE)
    fs.pwrite(fd, data, 0)
    if sync:
        fs.fsync(fd)
    fs.close(fd)


def after_power_loss(
    fs: CrashSimFileSystem, tmp_path: Path, mode: str = "drop", seed: int = 0
) -> Path:
    dest = tmp_path / f"crash-{mode}-{seed}"
    fs.materialize(str(dest), mode, random.Random(seed))
    return dest


def tree(root: Path) -> dict[str, bytes]:
    """Every file under root, by relative path."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


# -- what survives ---------------------------------------------------------------------


def test_unsynced_write_is_dropped_and_synced_write_survives(tmp_path: Path) -> None:
    fs = CrashSimFileSystem()
    fd = durable_file(fs, b"synced")
    fs.pwrite(fd, b"-lost", 6)
    assert fs.pread(fd, 100, 0) == b"synced-lost"  # readers see it before the crash
    assert tree(after_power_loss(fs, tmp_path)) == {"d/f": b"synced"}


def test_fdatasync_makes_data_durable(tmp_path: Path) -> None:
    fs = CrashSimFileSystem()
    fd = durable_file(fs)
    fs.pwrite(fd, b"data", 0)
    fs.fdatasync(fd)
    assert tree(after_power_loss(fs, tmp_path)) == {"d/f": b"data"}


def test_file_created_without_dir_fsync_vanishes_even_if_its_data_was_synced(
    tmp_path: Path,
) -> None:
    fs = CrashSimFileSystem()
    durable_dir(fs, "/d")
    write_file(fs, "/d/f", b"data", sync=True)
    assert fs.exists("/d/f")
    for mode in MODES:
        assert tree(after_power_loss(fs, tmp_path, mode)) == {}, mode
        assert (tmp_path / f"crash-{mode}-0" / "d").is_dir()


def test_new_directory_without_parent_fsync_vanishes_with_its_files(tmp_path: Path) -> None:
    fs = CrashSimFileSystem()
    fs.mkdir("/a/b")
    fs.fsync_dir("/a/b")
    write_file(fs, "/a/b/f", b"x", sync=True)
    fs.fsync_dir("/a/b")
    fs.fsync_dir("/a")  # "b" is durable in "a", but "a" is not durable in "/"
    assert list((after_power_loss(fs, tmp_path)).iterdir()) == []


def test_rename_without_dir_fsync_is_undone(tmp_path: Path) -> None:
    fs = CrashSimFileSystem()
    durable_dir(fs, "/d")
    write_file(fs, "/d/old", b"old", sync=True)
    write_file(fs, "/d/tmp", b"new", sync=True)
    fs.fsync_dir("/d")
    fs.replace("/d/tmp", "/d/old")
    assert fs.listdir("/d") == ["old"]
    assert tree(after_power_loss(fs, tmp_path, seed=1)) == {"d/old": b"old", "d/tmp": b"new"}
    fs.fsync_dir("/d")
    assert tree(after_power_loss(fs, tmp_path, seed=2)) == {"d/old": b"new"}


def test_inode_under_two_names_after_half_synced_rename_shows_same_bytes(
    tmp_path: Path,
) -> None:
    fs = CrashSimFileSystem()
    durable_dir(fs, "/a")
    durable_dir(fs, "/b")
    fd = fs.open("/a/f", O_WRITE)
    fs.fsync_dir("/a")
    fs.pwrite(fd, b"0123456789", 0)
    fs.replace("/a/f", "/b/f")
    fs.fsync_dir("/b")  # the new name is durable, the removal of the old one is not
    for seed in range(20):
        files = tree(after_power_loss(fs, tmp_path, "prefix", seed))
        assert files["a/f"] == files["b/f"]


def test_unlink_without_dir_fsync_reappears_with_durable_content(tmp_path: Path) -> None:
    fs = CrashSimFileSystem()
    fd = durable_file(fs, b"durable")
    fs.pwrite(fd, b"DURABLE+pending", 0)
    fs.unlink("/d/f")
    assert not fs.exists("/d/f")
    assert tree(after_power_loss(fs, tmp_path, seed=1)) == {"d/f": b"durable"}
    fs.fsync_dir("/d")
    assert tree(after_power_loss(fs, tmp_path, seed=2)) == {}


def test_pending_truncate_is_dropped_until_fsync(tmp_path: Path) -> None:
    fs = CrashSimFileSystem()
    fd = durable_file(fs)
    fs.pwrite(fd, b"0123456789", 0)
    fs.fsync(fd)
    fs.ftruncate(fd, 4)
    assert fs.fsize(fd) == 4
    assert tree(after_power_loss(fs, tmp_path, seed=1)) == {"d/f": b"0123456789"}
    fs.fsync(fd)
    assert tree(after_power_loss(fs, tmp_path, seed=2)) == {"d/f": b"0123"}


def test_restart_keeps_the_page_cache_but_not_durability(tmp_path: Path) -> None:
    fs = CrashSimFileSystem()
    durable_dir(fs, "/d")
    write_file(fs, "/d/f", b"cached", sync=False)
    fs.crash_after(fs.ops)
    with pytest.raises(SimulatedCrash):
        fs.fsync_dir("/d")
    fs.restart()
    fd = fs.open("/d/f", O_READ)
    assert fs.pread(fd, 100, 0) == b"cached"
    assert tree(after_power_loss(fs, tmp_path)) == {}


# -- the modes -------------------------------------------------------------------------


def pending_file(fs: CrashSimFileSystem, writes: list[tuple[int, bytes]]) -> None:
    """A durable, empty /d/f with ``writes`` pending on it."""
    fd = durable_file(fs)
    for offset, data in writes:
        fs.pwrite(fd, data, offset)


def test_prefix_mode_keeps_exactly_a_prefix_of_the_writes(tmp_path: Path) -> None:
    fs = CrashSimFileSystem()
    pending_file(fs, [(0, b"aaa"), (3, b"bbb"), (6, b"ccc")])
    seen = {tree(after_power_loss(fs, tmp_path, "prefix", seed))["d/f"] for seed in range(40)}
    assert seen == {b"", b"aaa", b"aaabbb", b"aaabbbccc"}


def test_pages_mode_can_keep_a_later_page_and_lose_an_earlier_one(tmp_path: Path) -> None:
    fs = CrashSimFileSystem()
    pages = [bytes([ord("A") + i]) * PAGE_SIZE for i in range(3)]
    pending_file(fs, [(0, b"".join(pages))])
    outcomes = set()
    for seed in range(40):
        data = tree(after_power_loss(fs, tmp_path, "pages", seed))["d/f"]
        # Page granular: each page is all new or all old (zeros, as the file was empty);
        # the file ends at the end of the last new page.
        assert len(data) % PAGE_SIZE == 0
        kept = tuple(
            data[i * PAGE_SIZE : (i + 1) * PAGE_SIZE] == pages[i] for i in range(len(pages))
        )
        for i in range(len(data) // PAGE_SIZE):
            assert data[i * PAGE_SIZE : (i + 1) * PAGE_SIZE] in (pages[i], bytes(PAGE_SIZE))
        outcomes.add(kept)
    assert (False, False, True) in outcomes  # the last page without the two before it
    assert (False, False, False) in outcomes
    assert (True, True, True) in outcomes


def test_torn_mode_keeps_all_but_a_torn_last_page(tmp_path: Path) -> None:
    fs = CrashSimFileSystem()
    new = b"x" * PAGE_SIZE + b"y" * 1000
    pending_file(fs, [(0, new)])
    tears = set()
    for seed in range(40):
        data = tree(after_power_loss(fs, tmp_path, "torn", seed))["d/f"]
        assert data[:PAGE_SIZE] == new[:PAGE_SIZE]
        tail = data[PAGE_SIZE:]
        kept = len(tail.rstrip(b"\0"))
        assert kept < 1000  # the last page is always torn
        assert tail in (b"y" * kept, b"y" * kept + bytes(1000 - kept))  # cut or zero-filled
        tears.add((kept, len(tail)))
    assert len({kept for kept, _ in tears}) > 5
    assert any(length == 1000 for _, length in tears)  # size kept, torn rest reads as zeros
    assert any(length < 1000 for _, length in tears)  # size update lost too


def test_torn_mode_rest_of_page_shows_old_bytes(tmp_path: Path) -> None:
    fs = CrashSimFileSystem()
    fd = durable_file(fs)
    fs.pwrite(fd, b"o" * 100, 0)
    fs.fsync(fd)
    fs.pwrite(fd, b"n" * 100, 0)
    for seed in range(10):
        data = tree(after_power_loss(fs, tmp_path, "torn", seed))["d/f"]
        kept = len(data) - len(data.lstrip(b"n"))
        assert data == b"n" * kept + b"o" * (100 - kept)
        assert kept < 100


def test_page_size_sets_the_unit_of_loss(tmp_path: Path) -> None:
    fs = CrashSimFileSystem(page_size=4)
    pending_file(fs, [(0, b"aaaabbbbcccc")])
    seen = {tree(after_power_loss(fs, tmp_path, "pages", seed))["d/f"] for seed in range(60)}
    assert b"\0\0\0\0bbbb" in seen
    assert b"aaaa\0\0\0\0cccc" in seen
    for data in seen:
        for i in range(0, len(data), 4):
            assert data[i : i + 4] in (b"aaaabbbbcccc"[i : i + 4], b"\0\0\0\0")


def test_materialize_leaves_the_simulator_as_it_was(tmp_path: Path) -> None:
    fs = CrashSimFileSystem()
    pending_file(fs, [(0, b"pending")])
    for mode in MODES:
        after_power_loss(fs, tmp_path, mode)
    fd = fs.open("/d/f", O_READ)
    assert fs.pread(fd, 100, 0) == b"pending"
    assert tree(after_power_loss(fs, tmp_path, "drop", seed=1)) == {"d/f": b""}


def test_materialize_rejects_an_unknown_mode(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown mode"):
        CrashSimFileSystem().materialize(str(tmp_path), "everything", random.Random(0))


# -- crash points ----------------------------------------------------------------------


def test_crash_after_raises_at_that_operation_and_ever_after(tmp_path: Path) -> None:
    fs = CrashSimFileSystem()
    fs.crash_after(3)
    fs.mkdir("/d")  # 1
    fs.fsync_dir("/")  # 2
    fd = fs.open("/d/f", O_WRITE)  # 3
    assert fs.ops == 3
    with pytest.raises(SimulatedCrash):
        fs.pwrite(fd, b"never", 0)  # 4: the power is out
    assert fs.crashed
    assert fs.ops == 3
    with pytest.raises(SimulatedCrash):
        fs.pread(fd, 5, 0)  # reads fail too: the machine is down
    with pytest.raises(SimulatedCrash):
        fs.exists("/d")
    with pytest.raises(SimulatedCrash):
        fs.fsync(fd)
    assert list(after_power_loss(fs, tmp_path).iterdir()) == [tmp_path / "crash-drop-0" / "d"]


def test_simulated_crash_is_not_an_exception_the_code_under_test_could_swallow() -> None:
    assert not issubclass(SimulatedCrash, Exception)


def test_only_mutating_calls_are_crash_points() -> None:
    fs = CrashSimFileSystem()
    fs.mkdir("/d")
    write_file(fs, "/d/f", b"abc", sync=True)  # open-create, pwrite, fsync
    assert fs.ops == 4
    fd = fs.open("/d/f", O_WRITE)  # exists already: not a mutation
    fs.pread(fd, 3, 0)
    fs.fsize(fd)
    fs.listdir("/d")
    fs.exists("/d/f")
    fs.close(fd)
    assert fs.ops == 4


def test_crash_points_and_run_to_crash_replay_a_workload(tmp_path: Path) -> None:
    def workload(fs: CrashSimFileSystem) -> None:
        durable_dir(fs, "/d")
        for i in range(3):
            fd = fs.open(f"/d/{i}", O_WRITE)
            fs.pwrite(fd, b"x" * (i + 1), 0)
            fs.fsync(fd)
            fs.close(fd)
            fs.fsync_dir("/d")

    n = crash_points(workload)
    assert n == 2 + 3 * 4
    survivors = []
    for k in range(n + 1):
        fs = run_to_crash(workload, k)
        assert fs.crashed == (k < n)
        survivors.append(len(tree(after_power_loss(fs, tmp_path, seed=k))))
    # A file counts only after its data fsync and its directory fsync: the 4th op of its step.
    assert survivors == [0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


# -- contract: the simulator reads like the real file system --------------------------


@pytest.fixture(params=["real", "sim"])
def fs_root(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[FileSystem, str]:
    if request.param == "real":
        return REAL_FS, str(tmp_path)
    return CrashSimFileSystem(), "/root"


def test_contract_reads_and_writes(fs_root: tuple[FileSystem, str]) -> None:
    fs, root = fs_root
    fs.mkdir(f"{root}/a/b")
    fs.mkdir(f"{root}/a/b")  # exist_ok
    fd = fs.open(f"{root}/a/b/f", O_WRITE)
    assert fs.fsize(fd) == 0
    assert fs.pwrite(fd, b"hello", 0) == 5
    assert fs.pwrite(fd, memoryview(b"world"), 8) == 5
    assert fs.pread(fd, 100, 0) == b"hello\0\0\0world"  # a hole reads as zeros
    assert fs.pread(fd, 3, 2) == b"llo"
    assert fs.pread(fd, 10, 100) == b""
    fs.ftruncate(fd, 4)
    assert fs.fsize(fd) == 4
    fs.ftruncate(fd, 6)
    assert fs.pread(fd, 10, 0) == b"hell\0\0"
    fs.fsync(fd)
    fs.fdatasync(fd)
    fs.close(fd)
    fd = fs.open(f"{root}/a/b/f", O_WRITE)  # O_WRITE never truncates
    assert fs.fsize(fd) == 6
    fs.close(fd)
    fd = fs.open(f"{root}/a/b/f", O_READ)
    assert fs.pread(fd, 10, 0) == b"hell\0\0"
    with pytest.raises(OSError):
        fs.pwrite(fd, b"x", 0)  # read-only descriptor
    fs.close(fd)
    fs.fsync_dir(f"{root}/a/b")
    assert fs.listdir(f"{root}/a") == ["b"]


def test_contract_names(fs_root: tuple[FileSystem, str]) -> None:
    fs, root = fs_root
    fs.mkdir(root)
    write_file(fs, f"{root}/x", b"x", sync=False)
    write_file(fs, f"{root}/y", b"y", sync=False)
    fs.replace(f"{root}/x", f"{root}/y")
    assert sorted(fs.listdir(root)) == ["y"]
    assert not fs.exists(f"{root}/x")
    fd = fs.open(f"{root}/y", O_READ)
    fs.unlink(f"{root}/y")
    assert fs.pread(fd, 10, 0) == b"x"  # an open fd outlives its name
    fs.close(fd)
    assert fs.listdir(root) == []
    assert fs.exists(root) and not fs.exists(f"{root}/y")
    with pytest.raises(FileNotFoundError):
        fs.open(f"{root}/y", O_READ)
    with pytest.raises(FileNotFoundError):
        fs.unlink(f"{root}/y")
    with pytest.raises(FileNotFoundError):
        fs.replace(f"{root}/y", f"{root}/z")
    with pytest.raises(FileNotFoundError):
        fs.listdir(f"{root}/nowhere")
    with pytest.raises(FileNotFoundError):
        fs.open(f"{root}/nowhere/f", O_WRITE)
    with pytest.raises(OSError):
        fs.close(12345)
