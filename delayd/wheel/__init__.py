"""The wheel: due entries kept in memory until their millisecond, and the cursors that
say how much of schedule_log is in it (docs/wheel.md).

``timer``   TimingWheel (pure: now_ms is an argument)
``ticker``  Ticker: the trio task that sleeps until the next due entry
``cursor``  LoadCursors: loading / loaded positions and the canAdd rule
"""

from delayd.wheel.cursor import NO_BUCKET, Cursor, LoadCursors
from delayd.wheel.ticker import Ticker, TickerStatistics
from delayd.wheel.timer import (
    DueEntries,
    TimingWheel,
    WheelStatistics,
    pack_ref,
    unpack_ref,
)

__all__ = [
    "NO_BUCKET",
    "Cursor",
    "DueEntries",
    "LoadCursors",
    "Ticker",
    "TickerStatistics",
    "TimingWheel",
    "WheelStatistics",
    "pack_ref",
    "unpack_ref",
]
