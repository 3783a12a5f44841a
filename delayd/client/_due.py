"""When a message is due, said with Python values or in milliseconds: the ``at``,
``delay``, ``at_ms`` and ``delay_ms`` arguments of ``send``, of ``send_batch`` items
and of ``reschedule``, checked and turned into the protocol's integers.

``at`` is an aware ``datetime`` (a naive one is refused: its zone would be a guess),
``delay`` a ``timedelta``; ``at_ms`` is epoch milliseconds (UTC), ``delay_ms``
milliseconds. A value with a fraction of a millisecond is rounded up, so a message is
never due before the time given. Every error names the argument and says what to give
instead: TypeError for a value of the wrong type, ValueError for a wrong value.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
ONE_MS = timedelta(milliseconds=1)
MAX_MS = (1 << 63) - 1  # the wire's i64
ARGUMENTS = "at, delay, at_ms and delay_ms"


def send_times(
    at: datetime | None = None,
    delay: timedelta | None = None,
    at_ms: int | None = None,
    delay_ms: int | None = None,
) -> tuple[int | None, int | None]:
    """``(at_ms, delay_ms)`` of a message to send, at most one of them set: the delay
    counts from the server's receipt. Neither means "not delayed". Raises ValueError
    for more than one of the four arguments."""
    name, value = _one("at most", at=at, delay=delay, at_ms=at_ms, delay_ms=delay_ms)
    if name is None:
        return None, None
    milliseconds = _milliseconds(name, value)
    return (milliseconds, None) if name in ("at", "at_ms") else (None, milliseconds)


def reschedule_due_ms(
    now_ms: int,
    at: datetime | None = None,
    delay: timedelta | None = None,
    at_ms: int | None = None,
    delay_ms: int | None = None,
) -> int:
    """The absolute time (epoch ms) a RESCHEDULE carries: the time given, or ``now_ms``
    plus the delay given (the client's clock: the request names a time, not a delay).
    Raises ValueError unless exactly one of the four arguments is given."""
    name, value = _one("exactly", at=at, delay=delay, at_ms=at_ms, delay_ms=delay_ms)
    if name is None:
        raise ValueError(f"give exactly one of {ARGUMENTS}")
    milliseconds = _milliseconds(name, value)
    return milliseconds if name in ("at", "at_ms") else now_ms + milliseconds


def _one(how_many: str, **given: object) -> tuple[str | None, object]:
    """The one argument given (name, value), or (None, None); ValueError for more."""
    named = [name for name, value in given.items() if value is not None]
    if len(named) > 1:
        both = "both " if len(named) == 2 else ""
        raise ValueError(f"give {how_many} one of {ARGUMENTS}, not {both}{' and '.join(named)}")
    return (named[0], given[named[0]]) if named else (None, None)


def _milliseconds(name: str, value: object) -> int:
    if name == "at":
        if not isinstance(value, datetime):
            raise TypeError(
                f"at must be a datetime with a tzinfo, got {type(value).__name__}"
                + (" (for epoch milliseconds use at_ms=)" if isinstance(value, int) else "")
            )
        if value.utcoffset() is None:
            raise ValueError(
                f"at is a naive datetime ({value.isoformat()}): give it a tzinfo, e.g. "
                "datetime(..., tzinfo=timezone.utc), or use at_ms="
            )
        milliseconds = _ceil_ms(value - EPOCH)
    elif name == "delay":
        if not isinstance(value, timedelta):
            raise TypeError(
                f"delay must be a timedelta, got {type(value).__name__}"
                + (" (for milliseconds use delay_ms=)" if isinstance(value, int) else "")
            )
        milliseconds = _ceil_ms(value)
    else:
        if not isinstance(value, int) or isinstance(value, bool):
            hint = {timedelta: "delay=", datetime: "at="}.get(type(value))
            raise TypeError(
                f"{name} must be an int (milliseconds), got {type(value).__name__}"
                + (f"; for a {type(value).__name__} use {hint}" if hint else "")
            )
        milliseconds = value
    if milliseconds < 0:
        what = "a time before 1970" if name in ("at", "at_ms") else "a negative delay"
        raise ValueError(f"{name} is {value!r}: {what} is not a due time")
    if milliseconds > MAX_MS:
        raise ValueError(f"{name} is {value!r}: beyond what a message can carry")
    return milliseconds


def _ceil_ms(span: timedelta) -> int:
    whole, rest = divmod(span, ONE_MS)
    return whole + (rest > timedelta(0))
