"""The descriptor limit of the long-running servers (``delayd serve``, ``delayd broker``).

A server holds descriptors for bucket files (an LRU per log, plus evicted files waiting
for their group commit: delayd.logs.bucket_files), readers, segments, index files and
every client connection. Distributions start processes with a soft ``RLIMIT_NOFILE``
of 1,024 and a hard one far above; running out mid-run fails an append or an accept.
Like the JVM (``-XX:+MaxFDLimit``, on by default) and Go's runtime, the servers raise
the soft limit to the hard one at start, capped at MAX_DESCRIPTORS; they never lower it.

Client connections are the part of that an outsider controls, so each listener caps
them (``max_connections``); by default the cap leaves a reserve of descriptors to the
logs, so that opening a bucket file never fails because clients took every descriptor.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

MAX_DESCRIPTORS = 1 << 20
# Descriptors kept for the logs by the default connection cap: the bucket files' LRUs
# and those waiting for their group commit (delayd.logs.bucket_files, dispatch_files),
# segments, readers, index files, /metrics and the sender's broker connections. At the
# usual 1,024 that is half; with more, a quarter (the retired budgets grow with it).
LOG_DESCRIPTORS = 512
MAX_DEFAULT_CONNECTIONS = 10_000
LISTENERS_PER_PROCESS = 2  # delayd serve: intake and the embedded broker's port


def soft_descriptor_limit() -> int:
    """This process's soft RLIMIT_NOFILE (MAX_DESCRIPTORS when unlimited), for whatever
    sizes a pool of descriptors by it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_DESCRIPTORS if soft == resource.RLIM_INFINITY else soft


def raise_descriptor_limit() -> int:
    """Raise the soft RLIMIT_NOFILE toward the hard limit; returns the soft limit now.
    A refusal (a container that forbids it) leaves the limit as it was, logged."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = MAX_DESCRIPTORS if hard == resource.RLIM_INFINITY else min(hard, MAX_DESCRIPTORS)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            log.warning("descriptor limit stays %d (raising it to %d: %s)", soft, wanted, exc)
            return soft
        log.debug("descriptor limit raised from %d to %d", soft, wanted)
        return wanted
    return soft


def default_max_connections(soft_limit: int | None = None) -> int:
    """The connection cap of one listener when ``max_connections`` is 0: what the soft
    descriptor limit (this process's, by default) leaves after the logs' reserve, shared
    by the process's two listeners, and at most MAX_DEFAULT_CONNECTIONS."""
    if soft_limit is None:
        soft_limit = soft_descriptor_limit()
    reserve = max(soft_limit // 4, min(LOG_DESCRIPTORS, soft_limit // 2))
    share = (soft_limit - reserve) // LISTENERS_PER_PROCESS
    return max(1, min(MAX_DEFAULT_CONNECTIONS, share))
