"""ConnectionLimits: what one client connection, and all of a listener's together, may
hold of the server — the same keys for the delay server's intake and the broker.

What an outsider could otherwise exhaust (docs/operations.md, "Connections"):
descriptors (``max_connections``), connections that never speak or finish a frame
(``hello_timeout_ms``, ``frame_timeout_ms``) and memory for frames still arriving
(``max_unfinished_frame_bytes``). Unanswered requests per connection are bounded in the
connections themselves: they stop reading until their answers drain.

Client connections are the part of the descriptors (storage.descriptor_limit) an
outsider controls, so each listener caps them; by default the cap leaves a reserve of
descriptors to the logs, so that opening a bucket file never fails because clients took
every descriptor.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from storage.descriptor_limit import soft_descriptor_limit

DEFAULT_HELLO_TIMEOUT_MS = 10_000
DEFAULT_FRAME_TIMEOUT_MS = 30_000
# Four frames of the default 16 MiB max_frame_size arriving at once; more wait.
DEFAULT_MAX_UNFINISHED_FRAME_BYTES = 64 * 1024 * 1024
# Descriptors kept for the logs by the default connection cap: the bucket files' LRUs
# and those waiting for their group commit (delayd.logs.bucket_files, dispatch_files),
# segments, readers, index files, /metrics and the sender's broker connections. At the
# usual 1,024 that is half; with more, a quarter (the retired budgets grow with it).
LOG_DESCRIPTORS = 512
MAX_DEFAULT_CONNECTIONS = 10_000
LISTENERS_PER_PROCESS = 2  # delayd serve: intake and the embedded broker's port


def default_max_connections(soft_limit: int | None = None) -> int:
    """The connection cap of one listener when ``max_connections`` is 0: what the soft
    descriptor limit (this process's, by default) leaves after the logs' reserve, shared
    by the process's two listeners, and at most MAX_DEFAULT_CONNECTIONS."""
    if soft_limit is None:
        soft_limit = soft_descriptor_limit()
    reserve = max(soft_limit // 4, min(LOG_DESCRIPTORS, soft_limit // 2))
    share = (soft_limit - reserve) // LISTENERS_PER_PROCESS
    return max(1, min(MAX_DEFAULT_CONNECTIONS, share))


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """The limits of one listener; ValueError naming the field when one is invalid."""

    max_connections: int = 0  # 0: from the descriptor limit (default_max_connections)
    hello_timeout_ms: int = DEFAULT_HELLO_TIMEOUT_MS  # connect to HELLO_OK
    frame_timeout_ms: int = DEFAULT_FRAME_TIMEOUT_MS  # a frame's first byte to its last
    # Frames larger than delayd.serving.frame_budget.UNBUDGETED_FRAME_BYTES reserve their size
    # here before their body is read; a frame that finds no room waits (its sender with it).
    max_unfinished_frame_bytes: int = DEFAULT_MAX_UNFINISHED_FRAME_BYTES

    def __post_init__(self) -> None:
        if isinstance(self.max_connections, bool) or not (
            isinstance(self.max_connections, int) and self.max_connections >= 0
        ):
            raise ValueError(
                f"max_connections must be an integer >= 0 (0: from the descriptor limit), "
                f"got {self.max_connections!r}"
            )
        for name in ("hello_timeout_ms", "frame_timeout_ms", "max_unfinished_frame_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def of(cls, config: object) -> ConnectionLimits:
        """The limits ``config`` holds in fields of the same names: a server's
        configuration carries these keys flat (``[server]`` of ServeConfig, ``[broker]``
        of BrokerConfig). ValueError naming the field when one is invalid."""
        return cls(*(getattr(config, field.name) for field in dataclasses.fields(cls)))

    @property
    def connection_cap(self) -> int:
        """``max_connections``, or the default the descriptor limit allows."""
        return self.max_connections or default_max_connections()

    @property
    def hello_timeout_s(self) -> float:
        return self.hello_timeout_ms / 1000

    @property
    def frame_timeout_s(self) -> float:
        return self.frame_timeout_ms / 1000
