"""The process's descriptor limit (soft ``RLIMIT_NOFILE``), which every open file and
socket counts against.

A long-running process holds descriptors for bucket files, readers, segments, index
files and client connections. Distributions start processes with a soft limit of 1,024
and a hard one far above; running out mid-run fails an append or an accept. Like the JVM
(``-XX:+MaxFDLimit``, on by default) and Go's runtime, a server raises the soft limit to
the hard one at start, capped at MAX_DESCRIPTORS; it never lowers it. Pools of open
files size themselves by the limit that results.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

MAX_DESCRIPTORS = 1 << 20


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
