"""BrokerConfig: every tunable of the broker, with its unit in its name.

One frozen object, validated on construction (ValueError naming the field), so that the
command line, the embedded use by the delay server and the tests build it the same way.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from delayd.serving.connection_limits import (
    DEFAULT_FRAME_TIMEOUT_MS,
    DEFAULT_HELLO_TIMEOUT_MS,
    DEFAULT_MAX_UNFINISHED_FRAME_BYTES,
    ConnectionLimits,
)
from storage.flusher import FlushMode, FlushPolicy
from storage.segmented_log import DEFAULT_SEGMENT_SIZE

DAY_MS = 24 * 60 * 60 * 1000


class StartFrom(enum.StrEnum):
    """Where a consumer group that has never committed starts reading a queue."""

    EARLIEST = "earliest"  # the oldest message still stored
    LATEST = "latest"  # the end of the queue when the group first joins


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """Broker settings; defaults are the production values of docs/broker.md."""

    queues_per_subject: int = 4
    # Subjects with another number of queues than queues_per_subject.
    subject_queues: dict[str, int] = field(default_factory=dict)
    flush: FlushPolicy = field(default_factory=FlushPolicy)
    segment_size: int = DEFAULT_SEGMENT_SIZE  # bytes per commitlog segment (1 GiB)
    # Idempotency window: an id is remembered for at least dedupe_window_ms and at most
    # dedupe_max_ids ids back, whichever is smaller.
    dedupe_window_ms: int = DAY_MS
    dedupe_max_ids: int = 10_000_000
    heartbeat_timeout_ms: int = 10_000  # a member silent this long is dropped
    start_from: StartFrom = StartFrom.EARLIEST
    max_body_bytes: int = 4 * 1024 * 1024
    max_properties_bytes: int = 64 * 1024  # names and values, UTF-8
    max_pull_messages: int = 4096  # a PULL asking for more gets this many at most
    max_pull_bytes: int = 4 * 1024 * 1024  # body bytes per PULL_RESULT (>= 1 message)
    max_wait_ms: int = 60_000  # a longer PULL wait_ms is cut to this
    checkpoint_interval_ms: int = 1_000  # reput checkpoint, offsets fsync
    recent_cache_bytes: int = 64 * 1024 * 1024  # newest records of each queue, for PULL
    index_slot_count: int | None = None  # None: storage.indexfile's default (tests shrink)
    index_max_entries: int | None = None
    # The broker's listener (delayd.serving.connection_limits): 0 = from the descriptor limit.
    max_connections: int = 0
    hello_timeout_ms: int = DEFAULT_HELLO_TIMEOUT_MS
    frame_timeout_ms: int = DEFAULT_FRAME_TIMEOUT_MS
    max_unfinished_frame_bytes: int = DEFAULT_MAX_UNFINISHED_FRAME_BYTES

    def __post_init__(self) -> None:
        object.__setattr__(self, "start_from", StartFrom(self.start_from))
        if not isinstance(self.flush, FlushPolicy):
            object.__setattr__(self, "flush", FlushPolicy(FlushMode(self.flush)))
        positive = (
            "queues_per_subject",
            "segment_size",
            "dedupe_window_ms",
            "dedupe_max_ids",
            "heartbeat_timeout_ms",
            "max_body_bytes",
            "max_properties_bytes",
            "max_pull_messages",
            "max_pull_bytes",
            "checkpoint_interval_ms",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_wait_ms < 0 or self.recent_cache_bytes < 0:
            raise ValueError("max_wait_ms and recent_cache_bytes must be >= 0")
        if self.dedupe_max_ids >= 2**32:
            raise ValueError(f"dedupe_max_ids must be < 2**32, got {self.dedupe_max_ids}")
        for subject, count in self.subject_queues.items():
            if not isinstance(count, int) or not 0 < count <= 1024:
                raise ValueError(f"subject_queues[{subject!r}] must be in 1..1024, got {count!r}")
        if self.queues_per_subject > 1024:
            raise ValueError(
                f"queues_per_subject must be at most 1024, got {self.queues_per_subject}"
            )
        self.connection_limits  # noqa: B018  # validates those four fields

    @property
    def connection_limits(self) -> ConnectionLimits:
        """The limits of the broker's listener."""
        return ConnectionLimits.of(self)

    def queues_for(self, subject: str) -> int:
        """How many queues ``subject`` has."""
        return self.subject_queues.get(subject, self.queues_per_subject)
