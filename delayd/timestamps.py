"""Points in time: the wall clock in epoch milliseconds, and as text (ISO-8601 with a
UTC offset <-> epoch milliseconds).

The one reading of a time for the command-line flags (``--at``, ``--as-of``), the
audit and the HTTP API, and the one way the commands print one. A leaf: it imports
nothing from delayd.
"""

from __future__ import annotations

import datetime as _dt
import time

EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)


def wall_ms() -> int:
    """The wall clock now, epoch milliseconds (UTC): receipt, due, store and
    registration times."""
    return time.time_ns() // 1_000_000


def parse_utc_ms(text: str) -> int:
    """``2026-11-22T10:00:00Z`` -> epoch ms (``+01:00`` and fractions of a second too).

    The time must carry its offset (``Z`` or ``+hh:mm``): a time without one would be
    read in whatever zone the machine is in. Raises ValueError.
    """
    try:
        moment = _dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not an ISO-8601 time such as 2026-11-22T10:00:00Z") from None
    if moment.tzinfo is None:
        raise ValueError(f"{text!r} has no time zone; add Z for UTC (2026-11-22T10:00:00Z)")
    return (moment - EPOCH) // _dt.timedelta(milliseconds=1)


def format_utc(ms: int) -> str:
    """Epoch ms -> ``2026-11-22T10:00:00.000Z``."""
    moment = EPOCH + _dt.timedelta(milliseconds=ms)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
