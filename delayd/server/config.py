"""ServeConfig: every setting of ``delayd serve``, from defaults, a TOML file and flags.

The file has one table per part of the server; every key carries its unit in its name
(docs/configuration.md lists them with meaning and default). Unknown tables and keys,
and invalid values, are refused with a ConfigError naming the key — a typo must not
silently leave a default in place. Command-line flags override the file.
"""

from __future__ import annotations

import dataclasses
import enum
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from delayd.address import Address, parse_address
from delayd.broker.config import BrokerConfig
from delayd.cluster.config import (
    CLUSTER_KEYS,
    CLUSTER_STRING_KEYS,
    ClusterConfig,
    cluster_from_table,
)
from delayd.logs import message_log, schedule_log
from delayd.logs.bucket_files import DEFAULT_MAX_OPEN
from delayd.logs.buckets import DEFAULT_SEGMENT_SCALE, check_segment_scale
from delayd.logs.dispatch_log import MAX_ROUTE_WEIGHT, check_group_name
from delayd.protocol.frames import DEFAULT_MAX_FRAME_SIZE
from delayd.replay.replayer import DEFAULT_BATCH_RECORDS, DEFAULT_CHECKPOINT_INTERVAL_S
from delayd.sender.retry import RetryPolicy
from delayd.sender.sender import SenderConfig
from delayd.server.receiver import IntakeLimits
from delayd.serving.connection_limits import (
    DEFAULT_FRAME_TIMEOUT_MS,
    DEFAULT_HELLO_TIMEOUT_MS,
    DEFAULT_MAX_UNFINISHED_FRAME_BYTES,
    ConnectionLimits,
)
from delayd.structured_logs import (
    DEFAULT_LOG_FORMAT,
    DEFAULT_LOG_LEVEL,
    LOG_FORMATS,
    LOG_LEVELS,
)
from delayd.tls import ClientTls, ServerTlsConfig
from storage.flusher import FlushMode, FlushPolicy
from storage.framing import HEADER_SIZE
from storage.record_file import DEFAULT_MAX_UNSYNCED_BYTES as BUCKET_MAX_UNSYNCED_BYTES
from storage.segmented_log import DEFAULT_MAX_UNSYNCED_BYTES, DEFAULT_SEGMENT_SIZE, EOS_SIZE

DEFAULT_LISTEN = Address("127.0.0.1", 20801)
DEFAULT_BROKER_LISTEN = Address("127.0.0.1", 20811)
DEFAULT_METRICS_LISTEN = Address("127.0.0.1", 20880)  # the port; loopback: not exposed
DEFAULT_HTTP_LISTEN = Address("127.0.0.1", 20890)  # the HTTP/JSON API (docs/http.md)


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message names the key."""


EMBEDDED_GROUP = "local"  # the broker group of the embedded broker when none is listed
# [delivery] broker_groups_from: where the broker groups a delay server delivers to come from.
BROKER_GROUPS_FROM_CONFIG = "config"  # [[broker_groups]], or the embedded broker
BROKER_GROUPS_FROM_ETCD = "etcd"  # the cluster's registry (docs/cluster.md)
BROKER_GROUPS_FROM = (BROKER_GROUPS_FROM_CONFIG, BROKER_GROUPS_FROM_ETCD)

DAY_MS = 86_400_000


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """``[retention]``: when replayed message_log segments and finished buckets are
    deleted (delayd.server.retention, docs/operations.md). Ages are in milliseconds;
    0 deletes as soon as it is safe."""

    enabled: bool = True
    interval_ms: int = 60_000  # a pass this often
    # message_log is not needed for delivery once replayed (schedule_log holds every
    # byte); it is kept a day for `delayd inspect find` and the audit's message_log
    # check, and shorter than buckets so that the audit does not look for the schedule
    # records of a message_log record in a bucket already deleted.
    message_log_ms: int = DAY_MS
    # Delivered buckets are kept three days: the audit (docs/audit.md) and `delayd
    # inspect` can still reconcile and explain recent history (a weekend included).
    bucket_ms: int = 3 * DAY_MS

    def __post_init__(self) -> None:
        for name in ("message_log_ms", "bucket_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"retention.{name} must be >= 0")
        if self.interval_ms <= 0:
            raise ValueError("retention.interval_ms must be > 0")


@dataclass(frozen=True, slots=True)
class BrokerGroupConfig:
    """One ``[[broker_groups]]`` entry: a broker group the sender delivers to —
    ``embedded`` (the broker inside this process) or broker processes at
    ``addresses`` (one group: tried in order, over TLS when ``tls`` is given) — and
    its share of keyless messages."""

    name: str
    addresses: tuple[str, ...] = ()
    weight: int = 1
    embedded: bool = False
    tls: ClientTls | None = None  # None: plain TCP to the group's brokers

    def __post_init__(self) -> None:
        try:
            check_group_name(self.name)
        except ValueError as exc:
            raise ConfigError(f"broker_groups.name: {exc}") from None
        if self.embedded == bool(self.addresses):
            raise ConfigError(
                f"broker_groups: group {self.name!r} needs either embedded = true or "
                'addresses = ["HOST:PORT", ...], not both'
            )
        for address in self.addresses:
            try:
                parse_address(address)
            except ValueError as exc:
                raise ConfigError(f"broker_groups.{self.name}.addresses: {exc}") from None
        if not 1 <= self.weight <= MAX_ROUTE_WEIGHT:
            raise ConfigError(
                f"broker_groups.{self.name}.weight must be 1..{MAX_ROUTE_WEIGHT} "
                "(dispatch_log records it in 32 bits)"
            )
        if self.embedded and self.tls is not None:
            raise ConfigError(
                f"broker_groups: group {self.name!r} is embedded (no connection): "
                "remove its tls_* keys"
            )


def parse_listen_address(text: str, what: str) -> Address:
    """A listener's ``HOST:PORT`` (delayd.address; port 0 picks a free port).

    Raises ConfigError naming ``what``.
    """
    try:
        return parse_address(text, allow_port_zero=True)
    except ValueError as exc:
        raise ConfigError(f"{what}: {exc}") from None


def parse_optional_listen_address(text: str, what: str) -> Address | None:
    """As parse_listen_address, or None for ``off``."""
    if text.strip().lower() in ("", "off", "none"):
        return None
    return parse_listen_address(text, what)


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """Everything ``delayd serve`` needs besides the data directory."""

    listen: Address = DEFAULT_LISTEN
    broker_listen: Address | None = DEFAULT_BROKER_LISTEN  # None: embedded broker, no port
    metrics_listen: Address | None = DEFAULT_METRICS_LISTEN  # None: no /metrics endpoint
    http_listen: Address | None = DEFAULT_HTTP_LISTEN  # None: no HTTP API
    token: str | None = field(default=None, repr=False)
    tls: ServerTlsConfig | None = None  # None: every listener plain TCP
    max_frame_bytes: int = DEFAULT_MAX_FRAME_SIZE
    # The intake listener's connections (delayd.serving.connection_limits); 0 = by the fd limit.
    max_connections: int = 0
    hello_timeout_ms: int = DEFAULT_HELLO_TIMEOUT_MS
    frame_timeout_ms: int = DEFAULT_FRAME_TIMEOUT_MS
    max_unfinished_frame_bytes: int = DEFAULT_MAX_UNFINISHED_FRAME_BYTES
    limits: IntakeLimits = field(default_factory=IntakeLimits)
    flush: FlushPolicy = field(default_factory=FlushPolicy)
    message_log_segment_bytes: int = DEFAULT_SEGMENT_SIZE
    segment_scale_minutes: int = DEFAULT_SEGMENT_SCALE
    max_open_buckets: int = DEFAULT_MAX_OPEN
    replay_checkpoint_interval_ms: int = int(DEFAULT_CHECKPOINT_INTERVAL_S * 1000)
    replay_batch_records: int = DEFAULT_BATCH_RECORDS
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    load_ahead_ms: int | None = None  # None: 2 x the bucket width
    wheel_tick_ms: int = 1
    wheel_slots: int = 1024
    sender: SenderConfig = field(default_factory=SenderConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    broker_groups: tuple[BrokerGroupConfig, ...] = (
        BrokerGroupConfig(EMBEDDED_GROUP, embedded=True),
    )
    log_format: str = DEFAULT_LOG_FORMAT
    log_level: str = DEFAULT_LOG_LEVEL
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # no etcd: runs alone
    # "etcd": deliver to the cluster's broker groups found in etcd instead of
    # broker_groups (delayd.sender.discovery), re-read every broker_groups_refresh_ms.
    broker_groups_from: str = BROKER_GROUPS_FROM_CONFIG
    broker_groups_refresh_ms: int = 1000
    # TLS to the broker groups found in etcd (a [[broker_groups]] entry has its own).
    discovered_broker_tls: ClientTls | None = None

    def __post_init__(self) -> None:
        if self.broker_groups_from not in BROKER_GROUPS_FROM:
            raise ConfigError(
                f"delivery.broker_groups_from must be one of {', '.join(BROKER_GROUPS_FROM)}, "
                f"got {self.broker_groups_from!r}"
            )
        if not self.broker_groups:
            raise ConfigError("broker_groups: list at least one group")
        names = [g.name for g in self.broker_groups]
        if len(set(names)) != len(names):
            raise ConfigError(f"broker_groups: names must be unique, got {names}")
        try:
            check_segment_scale(self.segment_scale_minutes)
        except ValueError as exc:
            raise ConfigError(f"schedule_log.segment_scale_minutes: {exc}") from None
        # The largest record must fit message_log's segments and unsynced window, and,
        # behind its message_log offset, a bucket file's unsynced window.
        room = min(
            self.message_log_segment_bytes - EOS_SIZE - HEADER_SIZE,
            DEFAULT_MAX_UNSYNCED_BYTES - HEADER_SIZE,
            BUCKET_MAX_UNSYNCED_BYTES - HEADER_SIZE - schedule_log.PREFIX_SIZE,
        )
        if self.limits.max_record_bytes > room:
            raise ConfigError(
                f"intake.max_record_bytes ({self.limits.max_record_bytes:,}) does not fit in "
                f"message_log.segment_bytes ({self.message_log_segment_bytes:,}) and the "
                f"32 MiB unsynced windows; at most {room:,} with these settings"
            )
        smallest = message_log.HEAD_SIZE + 2
        if self.limits.max_record_bytes < smallest:
            raise ConfigError(f"intake.max_record_bytes must be at least {smallest}")
        if not self.discovers_broker_groups and any(g.embedded for g in self.broker_groups):
            self._check_embedded_broker_takes_what_intake_accepts()
        if self.cluster.enabled:
            try:
                self.cluster.advertised(self.listen.host)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        try:
            self.connection_limits  # noqa: B018  # validates the [server] connection keys
        except ValueError as exc:
            raise ConfigError(f"server.{exc}") from None

    @property
    def discovers_broker_groups(self) -> bool:
        """Whether the broker groups are found in etcd (not ``broker_groups``)."""
        return self.broker_groups_from == BROKER_GROUPS_FROM_ETCD

    def check_complete(self) -> None:
        """What only the whole configuration (file, variables and flags merged) can
        say. Raises ConfigError."""
        if self.discovers_broker_groups and not self.cluster.enabled:
            raise ConfigError(
                'delivery.broker_groups_from = "etcd" finds the broker groups in the '
                "cluster's etcd: give [cluster] etcd and group (--etcd, --group)"
            )

    @property
    def connection_limits(self) -> ConnectionLimits:
        """The limits of the intake listener (the embedded broker's are in ``broker``)."""
        return ConnectionLimits.of(self)

    def _check_embedded_broker_takes_what_intake_accepts(self) -> None:
        """A message intake accepts and the embedded broker (the only group, usually)
        refuses would be retried for ever, its dead-letter copy refused as well: never
        delivered, its bucket never complete. Refuse such a configuration at start."""
        for key in ("max_body_bytes", "max_properties_bytes"):
            accepted, taken = getattr(self.limits, key), getattr(self.broker, key)
            if accepted > taken:
                raise ConfigError(
                    f"intake.{key} ({accepted:,}) is more than broker.{key} ({taken:,}) of "
                    f"the embedded broker: a message accepted between the two could never "
                    f"be delivered; raise broker.{key} or lower intake.{key}"
                )

    @property
    def replay_checkpoint_interval_s(self) -> float:
        return self.replay_checkpoint_interval_ms / 1000


def _int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    return value


def _non_negative(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key} must be an integer >= 0, got {value!r}")
    return value


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def _str(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{key} must be a string, got {value!r}")
    return value


def _choice(*choices: str) -> Callable[[Any, str], str]:
    def check(value: Any, key: str) -> str:
        if value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(choices)}; got {value!r}")
        return value

    return check


# table -> key -> (check, where the value goes: ServeConfig field, or "limits.x")
_SCHEMA: dict[str, dict[str, tuple[Callable[[Any, str], Any], str]]] = {
    "server": {
        "listen": (lambda v, k: parse_listen_address(_str(v, k), k), "listen"),
        "broker_listen": (
            lambda v, k: parse_optional_listen_address(_str(v, k), k),
            "broker_listen",
        ),
        "metrics_listen": (
            lambda v, k: parse_optional_listen_address(_str(v, k), k),
            "metrics_listen",
        ),
        "token": (_str, "token"),
        "max_frame_bytes": (_int, "max_frame_bytes"),
        "max_connections": (_non_negative, "max_connections"),
        "hello_timeout_ms": (_int, "hello_timeout_ms"),
        "frame_timeout_ms": (_int, "frame_timeout_ms"),
        "max_unfinished_frame_bytes": (_int, "max_unfinished_frame_bytes"),
    },
    "http": {
        "listen": (lambda v, k: parse_optional_listen_address(_str(v, k), k), "http_listen"),
    },
    "tls": {
        "cert_file": (_str, "tls.cert_file"),
        "key_file": (_str, "tls.key_file"),
        "client_ca_file": (_str, "tls.client_ca_file"),
    },
    "log": {
        "format": (_choice(*LOG_FORMATS), "log_format"),
        "level": (_choice(*LOG_LEVELS), "log_level"),
    },
    "intake": {name: (_int, f"limits.{name}") for name in IntakeLimits.__dataclass_fields__},
    "message_log": {
        "flush": (_choice(*(m.value for m in FlushMode)), "flush.mode"),
        "flush_interval_ms": (_int, "flush.interval_ms"),
        "segment_bytes": (_int, "message_log_segment_bytes"),
    },
    "schedule_log": {
        "segment_scale_minutes": (_int, "segment_scale_minutes"),
        "max_open_files": (_int, "max_open_buckets"),
    },
    "replay": {
        "checkpoint_interval_ms": (_int, "replay_checkpoint_interval_ms"),
        "batch_records": (_int, "replay_batch_records"),
    },
    "wheel": {
        "load_ahead_ms": (_int, "load_ahead_ms"),
        "tick_ms": (_int, "wheel_tick_ms"),
        "slots": (_int, "wheel_slots"),
    },
    "delivery": {
        "max_batch": (_int, "sender.max_batch"),
        "max_in_flight": (_int, "sender.max_in_flight"),
        "group_queue_limit": (_int, "sender.group_queue_limit"),
        "batches_in_flight": (_int, "sender.batches_in_flight"),
        "failure_threshold": (_int, "sender.failure_threshold"),
        "open_ms": (_int, "sender.open_ms"),
        "max_open_ms": (_int, "sender.max_open_ms"),
        "doubt_hold_ms": (_non_negative, "sender.doubt_hold_ms"),
        "dispatch_flush_interval_ms": (_int, "sender.dispatch_flush_interval_ms"),
        "max_attempts": (_int, "retry.max_attempts"),
        "retry_base_ms": (_int, "retry.base_ms"),
        "retry_max_ms": (_int, "retry.max_ms"),
        "broker_groups_from": (_choice(*BROKER_GROUPS_FROM), "broker_groups_from"),
        "broker_groups_refresh_ms": (_int, "broker_groups_refresh_ms"),
        "broker_tls_ca_file": (_str, "broker_tls.tls_ca_file"),
        "broker_tls_cert_file": (_str, "broker_tls.tls_cert_file"),
        "broker_tls_key_file": (_str, "broker_tls.tls_key_file"),
    },
    "retention": {
        "enabled": (_bool, "retention.enabled"),
        "interval_ms": (_int, "retention.interval_ms"),
        "message_log_ms": (_non_negative, "retention.message_log_ms"),
        "bucket_ms": (_non_negative, "retention.bucket_ms"),
    },
}
_NESTED = ("limits", "flush", "sender", "retry", "retention", "tls", "broker_tls")
_GROUP_TLS_KEYS = ("tls_ca_file", "tls_cert_file", "tls_key_file")
_GROUP_KEYS = {"name", "addresses", "weight", "embedded", *_GROUP_TLS_KEYS}
# [broker] takes the embedded broker's BrokerConfig fields of simple types by name.
_BROKER_KEYS = {
    f.name
    for f in dataclasses.fields(BrokerConfig)
    if f.name not in ("flush", "subject_queues", "index_slot_count", "index_max_entries")
}


def table_keys() -> dict[str, frozenset[str]]:
    """Every table with a fixed set of keys (not ``[[broker_groups]]``), and its keys."""
    tables = {table: frozenset(keys) for table, keys in _SCHEMA.items()}
    tables["broker"] = frozenset([*_BROKER_KEYS, "flush", "subject_queues"])
    tables["cluster"] = CLUSTER_KEYS
    return tables


def key_targets() -> dict[str, dict[str, str]]:
    """For every key of a fixed table except [broker]: the ServeConfig field its value
    goes to (``limits.x``: a field of ``limits``; ``retry.x``: of ``sender.retry``)."""
    return {
        table: {key: target for key, (_, target) in keys.items()} for table, keys in _SCHEMA.items()
    }


def string_keys() -> frozenset[str]:
    """``table.key`` of every key whose value is a string (an address, a name, a choice)."""
    fixed = {
        "server.listen",
        "server.broker_listen",
        "server.metrics_listen",
        "server.token",
        "http.listen",
        "tls.cert_file",
        "tls.key_file",
        "tls.client_ca_file",
        "message_log.flush",
        "log.format",
        "log.level",
        "broker.flush",
        "delivery.broker_groups_from",
        "delivery.broker_tls_ca_file",
        "delivery.broker_tls_cert_file",
        "delivery.broker_tls_key_file",
    }
    enums = {
        f"broker.{f.name}"
        for f in dataclasses.fields(BrokerConfig)
        if isinstance(f.default, enum.Enum)
    }
    clusters = {f"cluster.{key}" for key in CLUSTER_STRING_KEYS}
    return frozenset(fixed | enums | clusters)


def read_toml(path: str) -> dict[str, Any]:
    """The parsed TOML file at ``path``. Raises ConfigError (also for a file that cannot
    be read or parsed, with the parser's line and column)."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None


def config_from_mapping(
    document: Mapping[str, Any],
    *,
    source: str = "config",
    labels: Mapping[str, str] | None = None,
) -> ServeConfig:
    """A ServeConfig from a parsed TOML document. Raises ConfigError naming the key.

    An error about key ``table.key`` begins with ``labels[table.key]`` when given (an
    environment override names its variable), else with ``source: table.key``."""
    labels = labels or {}
    values: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {prefix: {} for prefix in _NESTED}
    broker: dict[str, Any] = {}
    for table, entries in document.items():
        if table == "broker_groups":
            values["broker_groups"] = _broker_groups(entries, source)
            continue
        if table == "cluster" and isinstance(entries, Mapping):
            names = {
                key: labels.get(f"cluster.{key}", f"{source}: cluster.{key}") for key in entries
            }
            try:
                values["cluster"] = cluster_from_table(entries, names, source)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            continue
        if table not in ("broker", "cluster") and table not in _SCHEMA:
            known = ", ".join(sorted([*_SCHEMA, "broker", "broker_groups", "cluster"]))
            raise ConfigError(f"{source}: unknown table [{table}]; known tables: {known}")
        if not isinstance(entries, Mapping):
            raise ConfigError(f"{source}: {table} must be a table ([{table}])")
        for key, value in entries.items():
            name = f"{table}.{key}"
            label = labels.get(name, f"{source}: {name}")
            if table == "broker":
                if key not in _BROKER_KEYS and key not in ("flush", "subject_queues"):
                    known = ", ".join(sorted([*_BROKER_KEYS, "flush", "subject_queues"]))
                    raise ConfigError(f"{source}: unknown key {name}; keys of [broker]: {known}")
                broker[key] = _broker_value(key, value, label)
                continue
            if key not in _SCHEMA[table]:
                known = ", ".join(sorted(_SCHEMA[table]))
                raise ConfigError(f"{source}: unknown key {name}; keys of [{table}]: {known}")
            check, target = _SCHEMA[table][key]
            checked = check(value, label)
            prefix, dot, rest = target.partition(".")
            if dot:
                nested[prefix][rest] = checked
            else:
                values[target] = checked
    try:
        if nested["limits"]:
            values["limits"] = IntakeLimits(**nested["limits"])
        if nested["flush"]:
            values["flush"] = FlushPolicy(**nested["flush"])
        sender = nested["sender"]
        if "dispatch_flush_interval_ms" in sender:
            sender["dispatch_flush_interval_s"] = sender.pop("dispatch_flush_interval_ms") / 1000
        if nested["retry"]:
            sender["retry"] = RetryPolicy(**nested["retry"])
        if sender:
            values["sender"] = SenderConfig(**sender)
        if nested["retention"]:
            values["retention"] = RetentionConfig(**nested["retention"])
        if nested["tls"]:
            values["tls"] = _server_tls(nested["tls"])
        if nested["broker_tls"]:
            files = [nested["broker_tls"].get(key) for key in _GROUP_TLS_KEYS]
            values["discovered_broker_tls"] = _group_tls(files, "delivery.", "broker_")
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if broker:
        try:
            values["broker"] = BrokerConfig(**broker)
        except ValueError as exc:
            raise ConfigError(f"{source}: broker.{exc}") from None
    if "discovered_broker_tls" in values and values.get("broker_groups_from") != (
        BROKER_GROUPS_FROM_ETCD
    ):
        raise ConfigError(
            f"{source}: delivery.broker_tls_* apply to the broker groups found in etcd "
            '(broker_groups_from = "etcd"); a [[broker_groups]] entry takes tls_ca_file, '
            "tls_cert_file and tls_key_file of its own"
        )
    if values.get("broker_groups_from") == BROKER_GROUPS_FROM_ETCD and "broker_groups" in values:
        raise ConfigError(
            f'{source}: delivery.broker_groups_from = "etcd" finds the broker groups in etcd; '
            "remove the [[broker_groups]] list, or the key to deliver to the list"
        )
    try:
        return ServeConfig(**values)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _server_tls(values: dict[str, str]) -> ServerTlsConfig | None:
    """``[tls]`` as a ServerTlsConfig. Raises ValueError for a half-given pair."""
    return ServerTlsConfig.from_files(
        values.get("cert_file"), values.get("key_file"), values.get("client_ca_file")
    )


def _broker_groups(entries: Any, source: str) -> tuple[BrokerGroupConfig, ...]:
    """``[[broker_groups]]`` tables -> BrokerGroupConfigs. Raises ConfigError."""
    if not isinstance(entries, list) or not all(isinstance(e, Mapping) for e in entries):
        raise ConfigError(f"{source}: broker_groups must be an array of tables [[broker_groups]]")
    groups = []
    for entry in entries:
        unknown = set(entry) - _GROUP_KEYS
        if unknown:
            raise ConfigError(
                f"{source}: unknown key broker_groups.{sorted(unknown)[0]}; "
                f"keys of [[broker_groups]]: {', '.join(sorted(_GROUP_KEYS))}"
            )
        name = _str(entry.get("name"), f"{source}: broker_groups.name")
        addresses = entry.get("addresses", [])
        if not isinstance(addresses, list):
            raise ConfigError(f"{source}: broker_groups.{name}.addresses must be a list")
        embedded = entry.get("embedded", False)
        if not isinstance(embedded, bool):
            raise ConfigError(f"{source}: broker_groups.{name}.embedded must be true or false")
        weight = _int(entry.get("weight", 1), f"{source}: broker_groups.{name}.weight")
        files = [
            None if key not in entry else _str(entry[key], f"{source}: broker_groups.{name}.{key}")
            for key in _GROUP_TLS_KEYS
        ]
        try:
            tls = _group_tls(files, f"broker_groups.{name}: ")
            groups.append(
                BrokerGroupConfig(
                    name,
                    tuple(_str(a, f"{source}: broker_groups.{name}.addresses") for a in addresses),
                    weight,
                    embedded,
                    tls,
                )
            )
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        except ValueError as exc:  # from ClientTls
            raise ConfigError(f"{source}: broker_groups.{name}: {exc}") from None
    return tuple(groups)


def _group_tls(files: list[str | None], label: str, prefix: str = "") -> ClientTls | None:
    """TLS to broker groups from the (ca, cert, key) files of the keys ``prefix`` +
    ``tls_ca_file`` and the rest: None when none is given. Raises ConfigError (starting
    with ``label``) for a client certificate without the CA, ValueError (from
    ClientTls) for a certificate without its key."""
    if all(file is None for file in files):
        return None
    if files[0] is None:
        raise ConfigError(
            f"{label}{prefix}tls_cert_file and {prefix}tls_key_file need {prefix}tls_ca_file, "
            "the CA that signed the brokers' certificate"
        )
    return ClientTls(*files)


def _broker_value(key: str, value: Any, label: str) -> Any:
    """A value of a known [broker] key, checked; ``label`` starts every error (it names
    the key)."""
    if key == "flush":
        mode = _choice(*(m.value for m in FlushMode))(value, label)
        return FlushPolicy(FlushMode(mode))
    if key == "subject_queues":
        if not isinstance(value, Mapping):
            raise ConfigError(f"{label} must be a table of subject = queues")
        return {str(s): _int(n, f"{label}.{s}") for s, n in value.items()}
    default = BrokerConfig.__dataclass_fields__[key].default
    if isinstance(default, enum.Enum):
        return _str(value, label)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{label} must be an integer, got {value!r}")
    return value


def load_config(path: str) -> ServeConfig:
    """The ServeConfig of the TOML file at ``path``. Raises ConfigError (also for a file
    that cannot be read or parsed, with the parser's line and column)."""
    return config_from_mapping(read_toml(path), source=path)


def with_overrides(config: ServeConfig, **overrides: Any) -> ServeConfig:
    """``config`` with the non-None ``overrides`` (command-line flags) replacing fields."""
    changes = {k: v for k, v in overrides.items() if v is not None}
    return dataclasses.replace(config, **changes) if changes else config
