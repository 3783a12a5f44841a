"""The report's chart, as inline SVG: scheduled vs dispatched per bucket, and lateness.

Self-contained (no script, no fonts or styles from the network), so the page opens
anywhere, including from a mail attachment. Buckets are drawn in time order, evenly
spaced; beyond MAX_COLUMNS buckets, consecutive ones are merged into one column
(counts added, lateness the worst of the merged buckets).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from html import escape

MAX_COLUMNS = 240
WIDTH = 960
LEFT = 64  # room for the axis labels
RIGHT = 16
COUNTS_HEIGHT = 200
LATENESS_HEIGHT = 160
GAP = 48
SCHEDULED_COLOR = "#c7d3e0"
DISPATCHED_COLOR = "#2b6cb0"
P50_COLOR = "#2f855a"
P99_COLOR = "#dd6b20"
MAX_COLOR = "#c53030"
LATENESS_TICKS_MS = (0, 10, 100, 1_000, 10_000, 60_000, 600_000, 3_600_000)


@dataclass(frozen=True, slots=True)
class Column:
    """One bucket (or several merged) of the chart. Lateness in ms, None when nothing
    was dispatched."""

    label: str
    scheduled: int
    dispatched: int
    p50_ms: int | None
    p99_ms: int | None
    max_ms: int | None


def merge(columns: list[Column], limit: int = MAX_COLUMNS) -> list[Column]:
    """At most ``limit`` columns: runs of consecutive ones merged, labelled by the first."""
    if len(columns) <= limit:
        return columns
    size = math.ceil(len(columns) / limit)
    merged = []
    for start in range(0, len(columns), size):
        run = columns[start : start + size]
        merged.append(
            Column(
                label=f"{run[0].label} (+{len(run) - 1})",
                scheduled=sum(c.scheduled for c in run),
                dispatched=sum(c.dispatched for c in run),
                p50_ms=worst(c.p50_ms for c in run),
                p99_ms=worst(c.p99_ms for c in run),
                max_ms=worst(c.max_ms for c in run),
            )
        )
    return merged


def worst(values: Iterable[int | None]) -> int | None:
    """The greatest of the values present (None when there are none)."""
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _lateness_y(ms: float, top: float) -> float:
    """Lateness on a log scale (log10 of 1 + ms), early dispatches drawn at 0."""
    top_value = math.log10(1 + LATENESS_TICKS_MS[-1])
    value = math.log10(1 + max(ms, 0)) / top_value
    return top + LATENESS_HEIGHT * (1 - min(value, 1.0))


def _format_ms(ms: int) -> str:
    if ms >= 3_600_000:
        return f"{ms // 3_600_000} h"
    if ms >= 60_000:
        return f"{ms // 60_000} min"
    if ms >= 1_000:
        return f"{ms // 1_000} s"
    return f"{ms} ms"


def svg(columns: list[Column]) -> str:
    """The chart of ``columns`` (in time order) as an ``<svg>`` element."""
    columns = merge(columns)
    height = COUNTS_HEIGHT + GAP + LATENESS_HEIGHT + 40
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11" role="img">'
    ]
    if not columns:
        parts.append('<text x="10" y="20">no buckets</text></svg>')
        return "".join(parts)
    plot_width = WIDTH - LEFT - RIGHT
    step = plot_width / len(columns)
    top = 20
    peak = max(max(c.scheduled, c.dispatched) for c in columns) or 1
    parts.append(
        f'<text x="{LEFT}" y="12" font-weight="bold">scheduled '
        f'<tspan fill="{SCHEDULED_COLOR}">&#9632;</tspan> vs dispatched '
        f'<tspan fill="{DISPATCHED_COLOR}">&#9632;</tspan> per bucket</text>'
    )
    for value in (0, peak // 2, peak):
        y = top + COUNTS_HEIGHT * (1 - value / peak)
        parts.append(_axis_line(y, str(value)))
    for i, column in enumerate(columns):
        x = LEFT + i * step
        for value, color, inset in (
            (column.scheduled, SCHEDULED_COLOR, 0.05),
            (column.dispatched, DISPATCHED_COLOR, 0.25),
        ):
            bar = COUNTS_HEIGHT * value / peak
            parts.append(
                f'<rect x="{x + step * inset:.2f}" y="{top + COUNTS_HEIGHT - bar:.2f}" '
                f'width="{max(step * (1 - 2 * inset), 0.5):.2f}" height="{bar:.2f}" '
                f'fill="{color}"><title>{escape(column.label)}: {column.scheduled} scheduled, '
                f"{column.dispatched} dispatched</title></rect>"
            )
    parts.append(_lateness(columns, top + COUNTS_HEIGHT + GAP, step))
    parts.append(
        f'<text x="{LEFT}" y="{height - 4}">{escape(columns[0].label)}</text>'
        f'<text x="{WIDTH - RIGHT}" y="{height - 4}" text-anchor="end">'
        f"{escape(columns[-1].label)}</text></svg>"
    )
    return "".join(parts)


def _axis_line(y: float, label: str) -> str:
    return (
        f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.2f}" y2="{y:.2f}" stroke="#e2e8f0"/>'
        f'<text x="{LEFT - 6}" y="{y + 4:.2f}" text-anchor="end">{escape(label)}</text>'
    )


def _lateness(columns: list[Column], top: float, step: float) -> str:
    parts = [
        f'<text x="{LEFT}" y="{top - 10}" font-weight="bold">lateness (dispatched - due, log '
        f'scale): <tspan fill="{P50_COLOR}">p50</tspan> <tspan fill="{P99_COLOR}">p99</tspan> '
        f'<tspan fill="{MAX_COLOR}">max</tspan></text>'
    ]
    for tick in LATENESS_TICKS_MS:
        parts.append(_axis_line(_lateness_y(tick, top), _format_ms(tick)))
    for attribute, color in (("p50_ms", P50_COLOR), ("p99_ms", P99_COLOR)):
        points = [
            f"{LEFT + (i + 0.5) * step:.2f},{_lateness_y(value, top):.2f}"
            for i, column in enumerate(columns)
            if (value := getattr(column, attribute)) is not None
        ]
        if points:
            parts.append(
                f'<polyline points="{" ".join(points)}" fill="none" stroke="{color}" '
                'stroke-width="1.5"/>'
            )
    for i, column in enumerate(columns):
        if column.max_ms is not None:
            parts.append(
                f'<circle cx="{LEFT + (i + 0.5) * step:.2f}" '
                f'cy="{_lateness_y(column.max_ms, top):.2f}" r="2.5" fill="{MAX_COLOR}">'
                f"<title>{escape(column.label)}: max {column.max_ms} ms</title></circle>"
            )
    return "".join(parts)
