"""The effective configuration as TOML (``delayd serve --print-config``).

Every key of docs/configuration.md with the value the server would run with —
defaults, the file, the environment and the flags applied — so an operator sees what
a deployment really does, and the output read back as a file gives the same
configuration. Derived values are printed as they take effect (``wheel.load_ahead_ms``
unset is 2 x the bucket width, printed as that number). The token is never printed:
a comment says whether one is set.
"""

from __future__ import annotations

import enum
import json
from typing import Any

from delayd.address import format_address
from delayd.logs.buckets import bucket_width_ms
from delayd.server.config import Address, ServeConfig, key_targets, table_keys

_ADDRESS_KEYS = {"listen", "broker_listen", "metrics_listen", "http_listen"}


def format_listen_address(address: Address | None) -> str:
    """``HOST:PORT`` (``[v6]:PORT``) as the configuration reads it; ``off`` for None."""
    return "off" if address is None else format_address(*address)


def _value(config: ServeConfig, target: str) -> Any:
    head, _, field = target.partition(".")
    if not field:
        value = getattr(config, head)
        if head in _ADDRESS_KEYS:
            return format_listen_address(value)
        if head == "load_ahead_ms" and value is None:
            return 2 * bucket_width_ms(config.segment_scale_minutes)
        return value
    if head == "retry":
        return getattr(config.sender.retry, field)
    if head == "broker_tls":  # ClientTls's fields are ca_file, cert_file, key_file
        tls = config.discovered_broker_tls
        return None if tls is None else getattr(tls, field.removeprefix("tls_"))
    if target == "sender.dispatch_flush_interval_ms":
        return round(config.sender.dispatch_flush_interval_s * 1000)
    value = getattr(getattr(config, head), field)
    return value.value if isinstance(value, enum.Enum) else value


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        # A JSON string is a TOML basic string (same escapes; \\uXXXX for controls).
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items())
        return "{ " + items + " }" if items else "{}"
    raise TypeError(f"no TOML form for {value!r}")


def _broker_value(config: ServeConfig, key: str) -> Any:
    if key == "flush":
        return config.broker.flush.mode.value
    value = getattr(config.broker, key)
    if isinstance(value, enum.Enum):
        return value.value
    return dict(sorted(value.items())) if isinstance(value, dict) else value


def config_to_toml(config: ServeConfig) -> str:
    """The whole effective configuration as a TOML document (see the module docstring)."""
    lines = ["# delayd serve: effective configuration (docs/configuration.md)"]
    for table, keys in key_targets().items():
        if table == "tls" and config.tls is None:
            lines += ["", "# [tls] not set: every listener is plain TCP"]
            continue
        lines += ["", f"[{table}]"]
        for key, target in keys.items():
            if table in ("tls", "delivery") and _value(config, target) is None:
                continue  # unset files: no client certificates asked for, or plain TCP
            if key == "token":
                state = "set" if config.token is not None else "not set"
                lines.append(f"# token: {state} (never printed)")
                continue
            lines.append(f"{key} = {_toml(_value(config, target))}")
    lines += ["", "[broker]"]
    lines += [f"{k} = {_toml(_broker_value(config, k))}" for k in sorted(table_keys()["broker"])]
    # With broker_groups_from = "etcd" the list is not used, and may not be given.
    listed = () if config.discovers_broker_groups else config.broker_groups
    for group in listed:
        lines += ["", "[[broker_groups]]", f"name = {_toml(group.name)}"]
        if group.embedded:
            lines.append("embedded = true")
        else:
            lines.append(f"addresses = {_toml(list(group.addresses))}")
        lines.append(f"weight = {group.weight}")
        if group.tls is not None:
            tls = group.tls
            files = {"tls_ca_file": tls.ca_file, "tls_cert_file": tls.cert_file}
            files["tls_key_file"] = tls.key_file
            for key, file in files.items():
                if file is not None:
                    lines.append(f"{key} = {_toml(file)}")
    lines += ["", "[cluster]", *_cluster_lines(config)]
    return "\n".join(lines) + "\n"


def _cluster_lines(config: ServeConfig) -> list[str]:
    cluster = config.cluster
    lines = [
        f"etcd = {_toml(list(cluster.etcd))}",
        f"group = {_toml(cluster.group)}",
        f"advertise = {_toml(cluster.advertise)}",
        f"lease_ttl_ms = {cluster.lease_ttl_ms}",
        f"ack = {_toml(cluster.ack.value)}",
        f"min_in_sync = {cluster.min_in_sync}",
    ]
    if cluster.replication_listen is not None:
        lines.append(f"replication_listen = {_toml(str(cluster.replication_listen))}")
    return lines
