"""Environment overrides of the configuration: ``DELAYD_<TABLE>_<KEY>=value``.

A container or a unit file sets one key without writing a file (twelve-factor style):
``DELAYD_INTAKE_MAX_DELAY_MS=86400000`` is ``[intake] max_delay_ms = 86400000``. The
table is the longest table name that prefixes the rest of the name
(``DELAYD_MESSAGE_LOG_FLUSH`` is ``message_log.flush``, not a table ``message``).
A string key takes the value as it is; any other value is read as a TOML value
(``1_000``, ``true``, ``{ orders = 8 }``). Overrides are merged into the file's
document before it is checked, so they are validated exactly as the file is, and an
error names the variable and the key. A variable whose name starts with ``DELAYD_``
but names no table is not ours and is left alone; one that names a table and no key
of it is refused (a typo must not leave a default in place). ``[[broker_groups]]``
has no environment form.

Precedence: defaults < file < environment < command-line flags.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from typing import Any

from delayd.server.config import (
    ConfigError,
    ServeConfig,
    config_from_mapping,
    read_toml,
    string_keys,
    table_keys,
)

ENV_PREFIX = "DELAYD_"


def environment_overrides(
    environ: Mapping[str, str],
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """The overrides in ``environ`` as a TOML-like document, and for each ``table.key``
    the label errors about it start with (naming the variable). Raises ConfigError for
    a variable that names a table but none of its keys."""
    tables = table_keys()
    by_length = sorted(tables, key=len, reverse=True)
    strings = string_keys()
    document: dict[str, dict[str, Any]] = {}
    labels: dict[str, str] = {}
    for variable in sorted(environ):
        if not variable.startswith(ENV_PREFIX):
            continue
        rest = variable[len(ENV_PREFIX) :].lower()
        table = next((t for t in by_length if rest.startswith(t + "_")), None)
        if table is None:
            continue
        key = rest[len(table) + 1 :]
        name = f"{table}.{key}"
        if key not in tables[table]:
            known = ", ".join(sorted(tables[table]))
            raise ConfigError(
                f"environment variable {variable}: unknown key {name}; keys of [{table}]: {known}"
            )
        text = environ[variable]
        value = text if name in strings else _toml_value(text)
        document.setdefault(table, {})[key] = value
        labels[name] = f"environment variable {variable} ({name})"
    return document, labels


def _toml_value(text: str) -> Any:
    """``text`` read as one TOML value; the text itself when it is not one (the check
    of the key then says what it should be)."""
    if "\n" in text or "\r" in text:
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_effective_config(path: str | None, environ: Mapping[str, str]) -> ServeConfig:
    """Defaults, then the TOML file at ``path`` (when given), then the overrides in
    ``environ``. Raises ConfigError naming the key (and the variable, for an override)."""
    document: dict[str, Any] = read_toml(path) if path else {}
    overrides, labels = environment_overrides(environ)
    for table, values in overrides.items():
        current = document.get(table)
        if current is None:
            document[table] = values
        elif isinstance(current, Mapping):
            document[table] = {**current, **values}
        # else: the file's [table] is not a table, which config_from_mapping refuses
    return config_from_mapping(document, source=path or "configuration", labels=labels)
