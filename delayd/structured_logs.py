"""Process logging: one line per record on stderr, ``key=value`` or JSON, with levels.

``configure_logging(log_format, level)`` is called once by a long-running command (``delayd
serve``, ``delayd broker``) before anything logs; everything below it keeps using plain
``logging.getLogger(__name__)``. A record becomes one line::

    kv:    ts=2026-11-22T10:00:00.123Z level=info logger=delayd.server.app msg="replay
           recovery done" next_sequence=43
    json:  {"ts": "2026-11-22T10:00:00.123Z", "level": "info", "logger": "...",
            "msg": "replay recovery done", "next_sequence": 43}

Structured fields ride on ``extra``: ``log.info("cut a torn tail", extra=fields(bytes=n,
offset=o))``. Printf-style calls (``log.info("%d records", n)``) keep working; ``msg`` is
the formatted message. A traceback goes into the ``exc`` field (newlines escaped in kv),
so a record is always exactly one line, which is what log shippers split on.

What a process prints as its public ready signal (``delayd serve listening on H:P`` on
stdout) is not a log record and does not go through here.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import sys
from collections.abc import Mapping
from typing import Any, TextIO

LOG_FORMATS = ("kv", "json")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_LOG_FORMAT = "kv"
DEFAULT_LOG_LEVEL = "info"
FIELDS_ATTR = "fields"  # the LogRecord attribute ``extra=fields(...)`` sets
RESERVED_KEYS = frozenset({"ts", "level", "logger", "msg", "exc"})


def fields(**values: Any) -> dict[str, dict[str, Any]]:
    """``extra=`` for a log call carrying structured fields (names are kv keys).

    A field named like a fixed key (ts, level, logger, msg, exc) is written as
    ``field.<name>`` so that it never hides the fixed one.
    """
    return {FIELDS_ATTR: values}


def _timestamp(record: logging.LogRecord) -> str:
    moment = _dt.datetime.fromtimestamp(record.created, _dt.UTC)
    return f"{moment:%Y-%m-%dT%H:%M:%S}.{moment.microsecond // 1000:03d}Z"


def _items(record: logging.LogRecord, formatter: logging.Formatter) -> list[tuple[str, Any]]:
    """The ordered key/value pairs of one record, shared by both formats."""
    items: list[tuple[str, Any]] = [
        ("ts", _timestamp(record)),
        ("level", record.levelname.lower()),
        ("logger", record.name),
        ("msg", record.getMessage()),
    ]
    extra = getattr(record, FIELDS_ATTR, None)
    if isinstance(extra, Mapping):
        items.extend(
            (f"field.{key}" if key in RESERVED_KEYS else str(key), value)
            for key, value in extra.items()
        )
    trace = [formatter.formatException(record.exc_info)] if record.exc_info else []
    if record.stack_info:
        trace.append(formatter.formatStack(record.stack_info))
    if trace:
        items.append(("exc", "\n".join(trace)))
    return items


def _kv_value(value: Any) -> str:
    """A value as logfmt writes it: bare when it is a simple token, else quoted."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    if text and not any(c in text for c in ' "=\\') and text.isprintable():
        return text
    escaped = (
        text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r")
    )
    return f'"{escaped}"'


class KeyValueFormatter(logging.Formatter):
    """``key=value`` lines (logfmt): values with spaces, quotes or ``=`` are quoted."""

    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{key}={_kv_value(value)}" for key, value in _items(record, self))


class JsonFormatter(logging.Formatter):
    """One JSON object per line; values JSON cannot hold are written as their str()."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(dict(_items(record, self)), default=str, ensure_ascii=False)


def check_log_format(name: str) -> str:
    """``name`` when it is a log format (kv, json); ValueError otherwise."""
    if name not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}; got {name!r}")
    return name


def check_log_level(name: str) -> str:
    """``name`` lowercased when it is a level (debug .. critical); ValueError otherwise."""
    level = name.lower()
    if level not in LOG_LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}; got {name!r}")
    return level


def configure_logging(
    log_format: str = DEFAULT_LOG_FORMAT,
    level: str = DEFAULT_LOG_LEVEL,
    *,
    stream: TextIO | None = None,
) -> logging.Handler:
    """Send every log record of the process to ``stream`` (stderr) in ``log_format``, from
    ``level`` up. Replaces handlers a previous call (or ``basicConfig``) installed on
    the root logger, so calling it again — once the configuration file is read, say —
    switches format and level. Returns the handler. Raises ValueError for an unknown
    format or level."""
    kv = check_log_format(log_format) == "kv"
    formatter = KeyValueFormatter() if kv else JsonFormatter()
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(check_log_level(level).upper())
    return handler
