"""What ``delayd top`` shows, computed from two successive scrapes of each server.

Pure: scrapes and their times (seconds, any monotonic clock) come in, a ServerView comes
out. Counters become rates over the interval between the two scrapes (a counter that
went down means the server restarted: its current value is the increase, as
Prometheus's ``rate`` treats a reset). Lateness percentiles are taken from the
histogram's increase over the interval, and from the whole histogram when nothing was
delivered in it. A metric the server does not export shows as unknown (None), never 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from delayd.top.scrape import Snapshot, histogram_quantile

# Metric names (docs/operations.md says what each means).
ACCEPTED = "delayd_intake_accepted_messages_total"
REFUSED = "delayd_intake_refused_messages_total"
REPLAY_LAG_RECORDS = "delayd_replay_lag_records"
REPLAY_LAG_BYTES = "delayd_replay_lag_bytes"
WHEEL_ENTRIES = "delayd_wheel_entries"
WHEEL_LOADED_AHEAD = "delayd_wheel_loaded_ahead_seconds"
WHEEL_LOADING_BUCKET = "delayd_wheel_loading_bucket_start_timestamp_seconds"
WHEEL_LOADING_OFFSET = "delayd_wheel_loading_offset_bytes"
WHEEL_LOADED_OFFSET = "delayd_wheel_loaded_offset_bytes"
PENDING = "delayd_pending_messages"
LATENESS = "delayd_delivery_lateness_seconds"
BATCH_SIZE = "delayd_delivery_batch_size_messages"
SENT = "delayd_delivery_sent_messages_total"
FAILED = "delayd_delivery_failed_messages_total"
RETRIED = "delayd_delivery_retried_messages_total"
DEAD_LETTERED = "delayd_delivery_dead_lettered_messages_total"
CIRCUIT = "delayd_delivery_circuit_state"
STORED = "delayd_broker_stored_messages_total"
FOLLOWER_LAG_BYTES = "delayd_replication_follower_lag_bytes"
FOLLOWER_LAG_SECONDS = "delayd_replication_follower_lag_seconds"

HORIZONS = ("1m", "10m", "1h", "1d", "later")  # label values of PENDING, nearest first
CIRCUIT_STATES = {0: "closed", 1: "half-open", 2: "OPEN"}


@dataclass(frozen=True, slots=True)
class Scrape:
    """One attempt to read a server: when (seconds, monotonic), and what came back —
    a Snapshot, or why there is none."""

    at_s: float
    snapshot: Snapshot | None = None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class GroupView:
    """One broker group the sender delivers to. Rates per second; None = unknown."""

    name: str
    circuit: str | None  # "closed", "half-open", "OPEN", or None when not exported
    sent_per_s: float | None
    failed_per_s: float | None
    retried_per_s: float | None
    dead_lettered_per_s: float | None


@dataclass(frozen=True, slots=True)
class ServerView:
    """Everything top shows about one server; None means unknown (not exported, or no
    previous scrape to take a rate from)."""

    label: str
    error: str | None = None  # set when the last scrape failed: nothing else is known
    in_per_s: float | None = None
    refused_per_s: float | None = None
    out_per_s: float | None = None
    batch_mean: float | None = None
    lateness_p50_s: float | None = None
    lateness_p99_s: float | None = None
    lateness_since_start: bool = False  # nothing delivered in the interval: whole histogram
    replay_lag_records: float | None = None
    replay_lag_bytes: float | None = None
    wheel_entries: float | None = None
    loaded_ahead_s: float | None = None
    loading_bucket_ms: int | None = None
    loading_offset_bytes: float | None = None
    loaded_offset_bytes: float | None = None
    pending: dict[str, float] = field(default_factory=dict)  # by horizon, HORIZONS order
    groups: list[GroupView] = field(default_factory=list)  # OPEN first, then by name
    stored_per_s: float | None = None  # messages its broker stored
    # A replication leader's view of its followers, by member id.
    follower_lag_bytes: dict[str, float] = field(default_factory=dict)
    follower_lag_s: dict[str, float] = field(default_factory=dict)

    @property
    def pending_total(self) -> float | None:
        """Every message not yet delivered (the horizons add up to it); None when the
        server does not export pending."""
        return sum(self.pending.values()) if self.pending else None

    @property
    def open_circuits(self) -> int:
        return sum(1 for g in self.groups if g.circuit == "OPEN")


@dataclass(frozen=True, slots=True)
class TopModel:
    """A frame: every server watched, which one is selected, when (epoch ms, UTC)."""

    servers: list[ServerView]
    selected: int = 0
    now_ms: int = 0
    interval_s: float = 1.0


def _increase(current: float, previous: float) -> float:
    return current if current < previous else current - previous  # a reset restarts at 0


def _rate(name: str, current: Snapshot, previous: Snapshot | None, dt_s: float) -> float | None:
    now = current.total(name)
    if now is None or previous is None or dt_s <= 0:
        return None
    before = previous.total(name)
    return _increase(now, 0.0 if before is None else before) / dt_s


def _rates_by(
    name: str, label: str, current: Snapshot, previous: Snapshot | None, dt_s: float
) -> dict[str, float | None]:
    now = current.by_label(name, label)
    if previous is None or dt_s <= 0:
        return dict.fromkeys(now)
    before = previous.by_label(name, label)
    return {key: _increase(value, before.get(key, 0.0)) / dt_s for key, value in now.items()}


def _interval_buckets(
    name: str, current: Snapshot, previous: Snapshot | None
) -> list[tuple[float, float]]:
    """The histogram's increase between the scrapes; empty when nothing was observed in
    the interval (or there is no previous scrape)."""
    now = current.buckets(name)
    if previous is None:
        return []
    before = dict(previous.buckets(name))
    delta = [(le, count - before.get(le, 0.0)) for le, count in now]
    if any(count < 0 for _, count in delta):
        delta = now  # the server restarted: everything it has was observed since
    return delta if delta and delta[-1][1] > 0 else []


def _mean_over_interval(name: str, current: Snapshot, previous: Snapshot | None) -> float | None:
    """The mean of the observations histogram ``name`` got between the scrapes; None
    when it got none (or it is not exported)."""
    total, count = current.total(f"{name}_sum"), current.total(f"{name}_count")
    if total is None or count is None or previous is None:
        return None
    before_total = previous.total(f"{name}_sum") or 0.0
    before_count = previous.total(f"{name}_count") or 0.0
    if count < before_count or total < before_total:
        before_total = before_count = 0.0  # the server restarted
    if count == before_count:
        return None
    return (total - before_total) / (count - before_count)


def _lateness_quantile(
    q: float, buckets: list[tuple[float, float]], mean_s: float | None
) -> float | None:
    """The ``q``-quantile of lateness ``buckets`` whose observations have mean ``mean_s``.
    Lateness is never negative, so a mean of 0 means every delivery was on time: 0,
    where interpolating inside the lowest bucket would give a fraction of its bound (half
    a millisecond from a server whose lowest bound is 1 ms)."""
    if mean_s == 0 and buckets:
        return 0.0
    return histogram_quantile(q, buckets)


def _group_order(group: GroupView) -> tuple[int, str]:
    rank = {"OPEN": 0, "half-open": 1}.get(group.circuit or "", 2)
    return rank, group.name


def server_view(label: str, current: Scrape, previous: Scrape | None = None) -> ServerView:
    """The view of one server from its latest scrape and the one before (rates need
    both; ``previous`` may be None or a failed scrape)."""
    now = current.snapshot
    if now is None:
        return ServerView(label, error=current.error or "no data")
    before = previous.snapshot if previous is not None else None
    dt_s = current.at_s - previous.at_s if previous is not None else 0.0

    interval = _interval_buckets(LATENESS, now, before)
    lateness = interval or now.buckets(LATENESS)
    if interval:
        lateness_mean_s = _mean_over_interval(LATENESS, now, before)
    else:
        lateness_mean_s = _mean_over_interval(LATENESS, now, Snapshot({}))  # since start
    loading_bucket = now.total(WHEEL_LOADING_BUCKET)

    circuits = now.by_label(CIRCUIT, "group")
    rates = {
        name: _rates_by(name, "group", now, before, dt_s)
        for name in (SENT, FAILED, RETRIED, DEAD_LETTERED)
    }
    names = set(circuits).union(*rates.values())
    groups = sorted(
        (
            GroupView(
                name=name,
                circuit=CIRCUIT_STATES.get(int(circuits[name]), "?") if name in circuits else None,
                sent_per_s=rates[SENT].get(name),
                failed_per_s=rates[FAILED].get(name),
                retried_per_s=rates[RETRIED].get(name),
                dead_lettered_per_s=rates[DEAD_LETTERED].get(name),
            )
            for name in names
        ),
        key=_group_order,
    )
    pending = now.by_label(PENDING, "horizon")
    return ServerView(
        label,
        in_per_s=_rate(ACCEPTED, now, before, dt_s),
        refused_per_s=_rate(REFUSED, now, before, dt_s),
        out_per_s=_rate(SENT, now, before, dt_s),
        batch_mean=_mean_over_interval(BATCH_SIZE, now, before),
        lateness_p50_s=_lateness_quantile(0.50, lateness, lateness_mean_s),
        lateness_p99_s=_lateness_quantile(0.99, lateness, lateness_mean_s),
        lateness_since_start=not interval and bool(lateness),
        replay_lag_records=now.total(REPLAY_LAG_RECORDS),
        replay_lag_bytes=now.total(REPLAY_LAG_BYTES),
        wheel_entries=now.total(WHEEL_ENTRIES),
        loaded_ahead_s=now.total(WHEEL_LOADED_AHEAD),
        loading_bucket_ms=None if loading_bucket is None else round(loading_bucket * 1000),
        loading_offset_bytes=now.total(WHEEL_LOADING_OFFSET),
        loaded_offset_bytes=now.total(WHEEL_LOADED_OFFSET),
        pending={h: pending[h] for h in HORIZONS if h in pending},
        groups=groups,
        stored_per_s=_rate(STORED, now, before, dt_s),
        follower_lag_bytes=now.by_label(FOLLOWER_LAG_BYTES, "member"),
        follower_lag_s=now.by_label(FOLLOWER_LAG_SECONDS, "member"),
    )
