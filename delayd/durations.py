"""Durations as people write them: ``250ms``, ``90s``, ``15m``, ``2h``, ``7d``,
``1h30m``, ``1.5h`` -> milliseconds.

The one reading of a duration for the command-line flags (``--delay``, ``--grace``),
the audit and the HTTP API. A leaf: it imports nothing from delayd.
"""

from __future__ import annotations

import re
from decimal import Decimal

# Largest first: the order a compound duration must be written in (1h30m, not 30m1h).
UNITS_MS = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1000, "ms": 1}
EXAMPLES = "250ms, 90s, 15m, 2h, 7d or 1h30m"

# ASCII digits only: int() would read full-width ones too.
_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|d|h|m|s)")
_ORDER = list(UNITS_MS)


def parse_duration_ms(text: str) -> int:
    """``90s`` -> 90000, ``1h30m`` -> 5400000.

    Each part is a number and a unit (ms, s, m, h, d), largest unit first, each unit at
    most once; a decimal part is allowed when the whole comes to whole milliseconds
    (``1.5s``, not ``0.5ms``). Raises ValueError saying what is wrong and giving
    examples of the right form.
    """
    stripped = text.strip()
    total = Decimal(0)
    position = 0
    last_unit = -1
    for part in _PART.finditer(stripped):
        if part.start() != position:
            break
        unit = _ORDER.index(part.group(2))
        if unit <= last_unit:
            raise ValueError(
                f"{text!r}: write each unit once, the largest first (for example 1h30m)"
            )
        last_unit = unit
        total += Decimal(part.group(1)) * UNITS_MS[part.group(2)]
        position = part.end()
    if position == 0 or position != len(stripped):
        raise ValueError(
            f"{text!r} is not a duration; use a number and a unit: ms, s, m, h or d "
            f"(for example {EXAMPLES})"
        )
    if total != total.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number of milliseconds")
    return int(total)


def format_duration_ms(ms: int) -> str:
    """Milliseconds -> the largest units, in whole seconds rounded up (``1h30m``,
    ``23h59m5s``, ``0s``): a wait said this way is never shorter than the real one.
    ``parse_duration_ms`` reads it back."""
    left_s = -(-max(ms, 0) // 1000)
    parts = []
    for unit, unit_ms in UNITS_MS.items():
        if unit == "ms":
            break
        amount, left_s = divmod(left_s, unit_ms // 1000)
        if amount:
            parts.append(f"{amount}{unit}")
    return "".join(parts) or "0s"
