"""What ``delayd top`` watches, as the refresh loop of delayd/cli/top.py drives it: a
Screen refreshes (scrapes) and draws a frame. ``Watcher`` is the per-server one: the
servers named on the command line; the cluster's is delayd/cli/top_cluster.py."""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from typing import Protocol

import trio
from rich.console import RenderableType

from delayd.timestamps import wall_ms
from delayd.top.model import Scrape, ServerView, TopModel, server_view
from delayd.top.render import render
from delayd.top.scrape import Snapshot, Target, fetch


class Screen(Protocol):
    """What the refresh loop drives."""

    prints_all_once: bool  # --once prints every line, not only the terminal's height

    @property
    def choices(self) -> int:
        """How many things the number keys select among (1: nothing to select)."""
        ...

    async def refresh(self) -> object:
        """Scrape again (and read whatever says what to scrape)."""
        ...

    def frame(
        self, selected: int, interval_s: float, width: int, height: int | None
    ) -> RenderableType:
        """The last refresh drawn in ``width`` x ``height`` (None: as tall as needed)."""
        ...


class Watcher:
    """The servers watched and the last scrape of each; ``refresh`` scrapes them all.
    ``targets`` may change between refreshes: a scrape is matched with the previous one
    of the same target."""

    prints_all_once = False  # --once draws to the terminal's height

    def __init__(
        self, targets: Sequence[Target], timeout_s: float, tls: ssl.SSLContext | None = None
    ) -> None:
        """``tls``: what an https target is verified with (None: the system's CAs)."""
        self.targets = list(targets)
        self.timeout_s = timeout_s
        self.tls = tls
        self.views: list[ServerView] = []
        self._last: dict[Target, Scrape] = {}

    @property
    def choices(self) -> int:
        return len(self.views)

    async def _scrape(self, target: Target, results: dict[Target, Scrape]) -> None:
        try:
            text = await trio.to_thread.run_sync(
                fetch, target.url, self.timeout_s, self.tls, abandon_on_cancel=True
            )
            results[target] = Scrape(trio.current_time(), Snapshot.parse(text))
        except (OSError, ValueError) as exc:
            results[target] = Scrape(trio.current_time(), error=str(exc) or type(exc).__name__)

    async def refresh(self) -> list[ServerView]:
        """Scrape every server concurrently; their views against the previous scrapes."""
        results: dict[Target, Scrape] = {}
        async with trio.open_nursery() as nursery:
            for target in set(self.targets):
                nursery.start_soon(self._scrape, target, results)
        self.views = [
            server_view(target.label, results[target], self._last.get(target))
            for target in self.targets
        ]
        self._last = results
        return self.views

    def frame(
        self, selected: int, interval_s: float, width: int, height: int | None
    ) -> RenderableType:
        model = TopModel(self.views, selected, wall_ms(), interval_s)
        return render(model, width, height or 24)
