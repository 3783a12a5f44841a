"""Drawing a TopModel with rich, to fit the terminal (80x24 at the least).

``render(model, width, height)`` is pure: it returns a renderable no taller than
``height`` lines, which the command hands to ``rich.live.Live`` and the tests to a
recording Console. Layout, top to bottom:

* a title line (what is watched, the time, the keys);
* with several servers, a table with one row each (the selected one marked);
* for the selected server: "throughput" and "wheel" side by side (the wheel panel
  holds the pending messages by horizon as bars);
* "groups": one row per broker group with its circuit state, OPEN ones first, cut to
  the lines left (the last row then says how many more, and how many of them are open).
"""

from __future__ import annotations

import datetime as _dt
import math

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from delayd.logs.buckets import bucket_name
from delayd.top.model import HORIZONS, GroupView, ServerView, TopModel

UNKNOWN = "—"
DETAIL_LINES = 9  # throughput / wheel panels: 7 lines inside, 2 of border
GROUP_PANEL_MIN_LINES = 4  # border, header, one row, border
HORIZON_LABELS = {"1m": "≤ 1m", "10m": "1m-10m", "1h": "10m-1h", "1d": "1h-1d", "later": "> 1d"}
CIRCUIT_STYLES = {"OPEN": "bold white on red", "half-open": "bold yellow", "closed": "green"}


# ---------------------------------------------------------------- number formats


def fmt_count(value: float | None) -> str:
    if value is None:
        return UNKNOWN
    if abs(value) >= 10_000_000:
        return f"{value / 1_000_000:,.1f}M"
    return f"{value:,.0f}"


def fmt_rate(value: float | None) -> str:
    if value is None:
        return UNKNOWN
    if value >= 1_000_000:
        return f"{value / 1_000_000:.2f}M/s"
    if value >= 100_000:
        return f"{value / 1000:.1f}k/s"
    return f"{value:,.1f}/s"


def fmt_seconds(value: float | None) -> str:
    """A duration in the unit that suits it: µs, ms, s, then m/h/d pairs."""
    if value is None or math.isnan(value):
        return UNKNOWN
    if value < 0:  # the wheel loaded less far than now: the loader is behind
        return "-" + fmt_seconds(-value)
    if value < 0.001:
        return f"{value * 1e6:.0f} µs"
    if value < 1:
        ms = value * 1000
        return f"{ms:.1f} ms" if ms < 10 else f"{ms:.0f} ms"
    if value < 60:
        return f"{value:.2f} s"
    seconds = int(value)
    for unit, size, sub, sub_size in (("d", 86400, "h", 3600), ("h", 3600, "m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} {seconds % size // sub_size}{sub}"
    return f"{seconds // 60}m {seconds % 60}s"


def fmt_bytes(value: float | None) -> str:
    if value is None:
        return UNKNOWN
    if abs(value) < 1024:
        return f"{value:.0f} B"
    for unit in ("KiB", "MiB"):
        value /= 1024
        if abs(value) < 1024:
            return f"{value:.1f} {unit}"
    return f"{value / 1024:.1f} GiB"


def fmt_progress(done: float | None, total: float | None) -> str:
    """``done/total`` bytes, the unit written once when both share it: ``1.1/1.2 MiB``."""
    done_text, total_text = fmt_bytes(done), fmt_bytes(total)
    done_value, _, done_unit = done_text.partition(" ")
    total_value, _, total_unit = total_text.partition(" ")
    if done_unit and done_unit == total_unit:
        return f"{done_value}/{total_value} {total_unit}"
    return f"{done_text}/{total_text}"


def fmt_bucket(start_ms: int | None) -> str:
    if start_ms is None or start_ms < 0:
        return UNKNOWN
    try:
        return bucket_name(start_ms)
    except ValueError:
        return str(start_ms)


# ---------------------------------------------------------------- panels


def _pairs(rows: list[tuple[str, str]]) -> Table:
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(justify="right", no_wrap=True)
    for label, value in rows:
        grid.add_row(label, value)
    return grid


def _throughput(view: ServerView) -> Panel:
    lateness = " (all)" if view.lateness_since_start else ""
    lag = UNKNOWN
    if view.replay_lag_records is not None:
        lag = f"{fmt_count(view.replay_lag_records)} · {fmt_bytes(view.replay_lag_bytes)}"
    rows = [
        ("in", fmt_rate(view.in_per_s)),
        ("refused", fmt_rate(view.refused_per_s)),
        ("out", fmt_rate(view.out_per_s)),
        ("batch mean", UNKNOWN if view.batch_mean is None else f"{view.batch_mean:.1f}"),
        (f"lateness p50{lateness}", fmt_seconds(view.lateness_p50_s)),
        (f"lateness p99{lateness}", fmt_seconds(view.lateness_p99_s)),
        ("replay lag", lag),
    ]
    return Panel(_pairs(rows), title="throughput", title_align="left", box=box.ROUNDED)


def _bar(count: float, largest: float, width: int) -> str:
    if count <= 0 or largest <= 0:
        return ""
    return "█" * max(1, round(width * count / largest))


def _wheel(view: ServerView, inner_width: int) -> Panel:
    lines = Table.grid(padding=(0, 1), expand=True)
    lines.add_column(no_wrap=True)
    head = f"entries {fmt_count(view.wheel_entries)} · ahead {fmt_seconds(view.loaded_ahead_s)}"
    lines.add_row(Text(head, overflow="ellipsis"))
    loading = f"loading {fmt_bucket(view.loading_bucket_ms)}"
    if view.loading_bucket_ms is not None:
        loading += f" {fmt_progress(view.loaded_offset_bytes, view.loading_offset_bytes)}"
    lines.add_row(Text(loading, overflow="ellipsis"))
    bars = Table.grid(padding=(0, 1), expand=True)
    bars.add_column(no_wrap=True, width=6)
    bars.add_column(no_wrap=True, ratio=1, style="cyan")
    bars.add_column(justify="right", no_wrap=True, width=9)
    largest = max(view.pending.values(), default=0.0)
    bar_width = max(1, inner_width - 6 - 9 - 2)
    for horizon in HORIZONS:
        count = view.pending.get(horizon)
        bar = "" if count is None else _bar(count, largest, bar_width)
        bars.add_row(HORIZON_LABELS[horizon], bar, fmt_count(count))
    lines.add_row(bars)
    return Panel(lines, title="wheel · pending by horizon", title_align="left", box=box.ROUNDED)


def _detail(view: ServerView, width: int) -> RenderableType:
    if view.error is not None:
        text = Text(f"{view.label}: unreachable — {view.error}", style="bold red")
        return Panel(text, title="server", title_align="left", box=box.ROUNDED)
    left_width = width // 2
    grid = Table.grid(expand=True)
    grid.add_column(width=left_width)
    grid.add_column(width=width - left_width)
    grid.add_row(_throughput(view), _wheel(view, width - left_width - 4))
    return grid


def _circuit(state: str | None) -> Text:
    if state is None:
        return Text(UNKNOWN)
    return Text(state, style=CIRCUIT_STYLES.get(state, ""))


def _groups(groups: list[GroupView], lines: int) -> Panel:
    """The groups table in at most ``lines`` lines (border and header included)."""
    table = Table(box=None, expand=True, padding=(0, 1), show_edge=False)
    table.add_column("group", no_wrap=True, overflow="ellipsis", ratio=1)
    table.add_column("circuit", no_wrap=True)
    for heading in ("sent/s", "failed/s", "retried/s", "dead/s"):
        table.add_column(heading, justify="right", no_wrap=True)
    if not groups:
        table.add_row(Text("no delivery metrics", style="dim"), "", "", "", "", "")
        return Panel(table, title="groups", title_align="left", box=box.ROUNDED)
    room = max(1, lines - 3)
    shown = groups if len(groups) <= room else groups[: room - 1]
    for group in shown:
        table.add_row(
            group.name,
            _circuit(group.circuit),
            *(
                fmt_rate(rate).removesuffix("/s")
                for rate in (
                    group.sent_per_s,
                    group.failed_per_s,
                    group.retried_per_s,
                    group.dead_lettered_per_s,
                )
            ),
        )
    hidden = groups[len(shown) :]
    if hidden:
        still_open = sum(1 for g in hidden if g.circuit == "OPEN")
        more = f"… {len(hidden)} more" + (f", {still_open} OPEN" if still_open else "")
        table.add_row(Text(more, style="dim"), "", "", "", "", "")
    title = f"groups · {len(groups)}"
    return Panel(table, title=title, title_align="left", box=box.ROUNDED)


def _servers(model: TopModel, rows: int) -> Table:
    """One row per server, a window of ``rows`` around the selected one."""
    table = Table(box=box.SIMPLE_HEAD, expand=True, padding=(0, 1), show_edge=False)
    table.add_column("#", no_wrap=True, width=3)
    table.add_column("server", no_wrap=True, overflow="ellipsis", ratio=1)
    for heading in ("in/s", "out/s", "p99", "lag", "open"):
        table.add_column(heading, justify="right", no_wrap=True)
    first = min(max(0, model.selected - rows + 1), max(0, len(model.servers) - rows))
    for index in range(first, min(len(model.servers), first + rows)):
        view = model.servers[index]
        marker = f"{'▶' if index == model.selected else ' '}{index + 1}"
        style = "reverse" if index == model.selected else ""
        if view.error is not None:
            table.add_row(marker, view.label, Text("unreachable", style="red"), "", "", "", "")
        else:
            table.add_row(
                marker,
                view.label,
                fmt_rate(view.in_per_s).removesuffix("/s"),
                fmt_rate(view.out_per_s).removesuffix("/s"),
                fmt_seconds(view.lateness_p99_s),
                fmt_count(view.replay_lag_records),
                _circuit("OPEN") if view.open_circuits else Text("0"),
                style=style,
            )
    return table


def _title(model: TopModel, width: int) -> Text:
    moment = _dt.datetime.fromtimestamp(model.now_ms / 1000, _dt.UTC)
    keys = "q quit" if len(model.servers) == 1 else "1-9/tab select · q quit"
    watched = (
        model.servers[model.selected].label
        if len(model.servers) == 1
        else (f"{len(model.servers)} servers")
    )
    text = Text.assemble(
        ("delayd top", "bold"),
        f"  {watched}  {moment:%Y-%m-%d %H:%M:%S}Z  {model.interval_s:g} s  ",
        (keys, "dim"),
    )
    text.truncate(width, overflow="ellipsis")
    return text


def render(model: TopModel, width: int = 80, height: int = 24) -> RenderableType:
    """The frame for ``model`` in a ``width`` x ``height`` terminal (designed for 80x24
    and up: never taller than ``height``)."""
    parts: list[RenderableType] = [_title(model, width)]
    left = height - 1
    if len(model.servers) > 1:
        # header and rule take 2 lines; keep room for the detail and one group row.
        rows = max(1, min(len(model.servers), left - DETAIL_LINES - GROUP_PANEL_MIN_LINES - 2))
        parts.append(_servers(model, rows))
        left -= rows + 2
    view = model.servers[model.selected]
    parts.append(_detail(view, width))
    if view.error is None:
        left -= DETAIL_LINES
        if left >= GROUP_PANEL_MIN_LINES:
            parts.append(_groups(view.groups, left))
    return Group(*parts)
