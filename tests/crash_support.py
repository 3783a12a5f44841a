"""Power loss at every crash point (storage/crashfs.py): run a workload on the crash
simulator until its k-th mutating call, lose power, and check what a restart finds —
for every k, each failure collected and all reported together."""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from storage.crashfs import PAGE_SIZE, CrashSimFileSystem, crash_points, run_to_crash

Journal = TypeVar("Journal")


def check_crash_point(
    failures: dict[int, str], k: int, root: Path, check: Callable[[], None], context: str = ""
) -> bool:
    """Run ``check`` on what crash point ``k`` left in ``root``: a failure is recorded
    under ``k`` (``context`` before its message); a pass removes ``root``, so the disk
    holds only the failing points. Whether it passed."""
    try:
        check()
    except Exception as exc:
        failures[k] = f"{context}{type(exc).__name__}: {exc}"
        return False
    shutil.rmtree(root)
    return True


def assert_no_failures(failures: dict[int, str]) -> None:
    """One report for all failing crash points: which ones, and the first few in full."""
    if failures:
        details = "\n".join(f"crash point {k}: {why}" for k, why in list(failures.items())[:3])
        pytest.fail(f"failed at crash points {sorted(failures)}\n{details}", pytrace=False)


def power_loss_at_every_crash_point(
    new_journal: Callable[[], Journal],
    workload: Callable[[Journal], Callable[[CrashSimFileSystem], object]],
    check: Callable[[Path, Journal], None],
    scratch: Path,
    mode: str,
    *,
    seed_prefix: str = "",
    page_size: int = PAGE_SIZE,
) -> None:
    """For every crash point k of ``workload``: run it on a fresh journal until k, lose
    power as ``mode`` says (its randomness seeded by ``seed_prefix``, k and the mode),
    write the result under ``scratch``/k<k> and ``check`` it against the journal."""
    failures: dict[int, str] = {}
    for k in range(crash_points(workload(new_journal())) + 1):
        journal = new_journal()
        fs = run_to_crash(workload(journal), k, page_size)
        root = scratch / f"k{k}"
        fs.materialize(str(root), mode, random.Random(f"{seed_prefix}{k}:{mode}"))
        check_crash_point(failures, k, root, lambda: check(root, journal))  # noqa: B023
    assert_no_failures(failures)
