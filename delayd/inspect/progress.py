"""A progress bar on stderr for inspect's long scans, only where someone watches it."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

MIN_PROGRESS_BYTES = 16 << 20  # smaller scans finish before a bar is worth drawing


@contextlib.contextmanager
def byte_progress(
    total_bytes: int, description: str, stream: TextIO | None = None
) -> Iterator[Callable[[int], None] | None]:
    """A callback that advances a bar of ``total_bytes`` by the bytes it is given, drawn
    on ``stream`` (stderr) and erased at the end; None — draw nothing — when the stream
    is not a terminal or the scan is small. Output on stdout is never touched."""
    stream = sys.stderr if stream is None else stream
    if not stream.isatty() or total_bytes < MIN_PROGRESS_BYTES:
        yield None
        return
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=Console(file=stream), transient=True) as progress:
        task = progress.add_task(description, total=total_bytes)
        yield lambda n: progress.advance(task, n)
