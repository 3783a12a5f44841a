"""``[cluster]``: how a server joins a group (docs/configuration.md, docs/replication.md).

Without ``etcd`` the server runs alone, exactly as a server without the table does.
With it, ``group`` is required and the server takes part in the group's election; its
members and clients reach it at ``advertise`` (a host) and the ports it bound.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from delayd.address import Address, format_address, parse_address
from delayd.cluster.lease_guard import DEFAULT_LEASE_TTL_MS, check_lease_ttl_ms
from delayd.cluster.members import DEFAULT_PREFIX, check_name, cluster_prefix

DEFAULT_SERVE_REPLICATION_PORT = 20870
DEFAULT_BROKER_REPLICATION_PORT = 20871
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


class AckMode(enum.StrEnum):
    """When the leader acknowledges a write (DESIGN.md, "Groups, replication and failover")."""

    SYNC = "sync"  # once the leader and every in-sync follower have it durable
    LEADER = "leader"  # once the leader has it durable


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The ``[cluster]`` table; ``etcd`` empty: no group (the server runs alone).

    ``replication_listen`` None: the default port on the listen host (``resolved``).
    ``name``: the cluster the group belongs to ("" the default one); its groups' keys
    live under ``prefix`` (``cluster_prefix``; docs/cluster.md).
    """

    etcd: tuple[str, ...] = ()
    group: str = ""
    advertise: str = ""
    lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS
    ack: AckMode = AckMode.SYNC
    min_in_sync: int = 1
    replication_listen: Address | None = None
    prefix: str = DEFAULT_PREFIX
    name: str = ""

    def __post_init__(self) -> None:
        """Raises ValueError naming the key; only when ``etcd`` is given are the group
        keys required."""
        object.__setattr__(self, "ack", AckMode(self.ack))
        if self.name:
            try:
                object.__setattr__(self, "prefix", cluster_prefix(self.name))
            except ValueError as exc:
                raise ValueError(f"cluster.name: {exc}") from None
        for url in self.etcd:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"cluster.etcd: {url!r} is not a URL; write http://{url}")
        if self.etcd and not self.group:
            raise ValueError("cluster.group: name the group this server joins (--group NAME)")
        if self.group:
            check_name("cluster.group", self.group)
        if self.group and not self.etcd:
            raise ValueError("cluster.etcd: a group needs etcd's URLs (--etcd http://HOST:2379)")
        if self.advertise:
            try:
                parse_address(format_address(self.advertise.strip("[]"), 1))
            except ValueError:
                raise ValueError(
                    f"cluster.advertise: {self.advertise!r} is not a host name or IP address "
                    "(a host only, without a port)"
                ) from None
        try:
            check_lease_ttl_ms(self.lease_ttl_ms)
        except ValueError as exc:
            raise ValueError(f"cluster.{exc}") from None
        if self.min_in_sync < 0:
            raise ValueError(f"cluster.min_in_sync must be >= 0, got {self.min_in_sync}")

    @property
    def enabled(self) -> bool:
        return bool(self.etcd)

    def replication_address(self, listen_host: str, default_port: int) -> Address:
        """Where the replication listener binds: ``replication_listen``, else
        ``default_port`` on the host the server's main listener binds."""
        if self.replication_listen is not None:
            return self.replication_listen
        return Address(listen_host, default_port)

    def advertised(self, listen_host: str) -> str:
        """The host members and clients reach this server at: ``advertise``, else the
        listen host unless it is a wildcard. Raises ValueError asking for it."""
        if self.advertise:
            return self.advertise.strip("[]")
        if listen_host in WILDCARD_HOSTS:
            raise ValueError(
                f"cluster.advertise: the server listens on {listen_host or 'every address'}; "
                "say which host other members and clients reach it at "
                "(--advertise HOST or [cluster] advertise)"
            )
        return listen_host

    def address_of(self, listen_host: str, port: int) -> str:
        """``advertised host:port``."""
        return format_address(self.advertised(listen_host), port)


def etcd_urls(value: Any, key: str) -> tuple[str, ...]:
    """etcd's URLs from a list or a comma-separated string. Raises ValueError."""
    if isinstance(value, str):
        urls = [part.strip() for part in value.split(",")]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        urls = [v.strip() for v in value]
    else:
        raise ValueError(f"{key} must be a list of URLs or a comma-separated string, got {value!r}")
    if not all(urls):
        raise ValueError(f"{key}: an empty URL in {value!r}")
    return tuple(urls)


def cluster_from_table(
    table: Mapping[str, Any], label: Mapping[str, str], source: str
) -> ClusterConfig:
    """A ClusterConfig from a ``[cluster]`` table; errors about one key start with
    ``label[key]``, the others with ``source``. Raises ValueError naming the key."""
    values: dict[str, Any] = {}
    for key, value in table.items():
        where = label[key]
        if key not in CLUSTER_KEYS:
            known = ", ".join(sorted(CLUSTER_KEYS))
            raise ValueError(f"{where}: unknown key; keys of [cluster]: {known}")
        if key == "etcd":
            values[key] = etcd_urls(value, where)
        elif key in ("lease_ttl_ms", "min_in_sync"):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{where} must be a whole number, got {value!r}")
            values[key] = value
        elif not isinstance(value, str):
            raise ValueError(f"{where} must be a string, got {value!r}")
        elif key == "ack":
            if value not in tuple(AckMode):
                raise ValueError(f"{where} must be sync or leader, got {value!r}")
            values[key] = AckMode(value)
        elif key == "replication_listen":
            try:
                values[key] = parse_address(value, allow_port_zero=True)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
        else:
            values[key] = value
    try:
        return ClusterConfig(**values)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


CLUSTER_KEYS = frozenset(
    {
        "etcd",
        "group",
        "advertise",
        "lease_ttl_ms",
        "ack",
        "min_in_sync",
        "replication_listen",
        "name",
    }
)
CLUSTER_STRING_KEYS = frozenset({"etcd", "group", "advertise", "ack", "replication_listen", "name"})


def cluster_with_flags(config: ClusterConfig, flags: object) -> ClusterConfig:
    """``config`` with the ``--etcd``, ``--group``, ``--advertise`` and ``--cluster``
    flags given (the attributes ``etcd``, ``group``, ``advertise``, ``cluster`` of
    ``flags`` that are not None). Raises ValueError as ClusterConfig does."""
    changes = {
        key: getattr(flags, flag)
        for flag, key in (
            ("etcd", "etcd"),
            ("group", "group"),
            ("advertise", "advertise"),
            ("cluster", "name"),
        )
        if getattr(flags, flag, None) is not None
    }
    return dataclasses.replace(config, **changes) if changes else config


ENV_PREFIX = "DELAYD_CLUSTER_"


def cluster_from_environment(environ: Mapping[str, str]) -> ClusterConfig:
    """The ``[cluster]`` keys set as ``DELAYD_CLUSTER_<KEY>`` variables (for ``delayd
    broker``, which has no configuration file; ``delayd serve`` reads them with the
    rest of its configuration). Raises ValueError naming the variable."""
    table: dict[str, object] = {}
    label: dict[str, str] = {}
    for variable, text in sorted(environ.items()):
        if not variable.startswith(ENV_PREFIX):
            continue
        key = variable.removeprefix(ENV_PREFIX).lower()
        if key not in CLUSTER_KEYS:
            known = ", ".join(sorted(CLUSTER_KEYS))
            raise ValueError(
                f"environment variable {variable}: unknown key cluster.{key}; "
                f"keys of [cluster]: {known}"
            )
        value: object = text
        if key not in CLUSTER_STRING_KEYS:
            value = int(text) if text.strip().isdecimal() else text
        table[key] = value
        label[key] = f"environment variable {variable} (cluster.{key})"
    return cluster_from_table(table, label, "environment")
