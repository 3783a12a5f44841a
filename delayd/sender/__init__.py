"""The sender: due messages out of the wheel and into the broker groups (DESIGN.md).

Building blocks, each one idea: ``circuit`` (a circuit breaker per group), ``routing``
(which group a message goes to), ``retry`` (back-off, max attempts, dead-letter
subjects), ``targets`` (the embedded broker or a broker process, behind one interface),
``wire`` (due messages in the wire layout, copied from schedule_log), ``ledger`` (every
message between the wheel and dispatch_log: held, in doubt, withdrawn, retried; pure,
``now_ms`` passed in), ``sender`` (the trio wiring that drives them) and ``discovery``
(the broker groups of a cluster, found in etcd and followed while the sender runs).
"""

from delayd.sender.circuit import CircuitBreaker, CircuitState
from delayd.sender.retry import (
    DEAD_LETTER_PREFIX,
    MAX_DEAD_LETTERED_SUBJECT_LENGTH,
    RetryPolicy,
    dead_letter_subject,
)
from delayd.sender.routing import GroupWeight, Router
from delayd.sender.targets import EmbeddedTarget, RemoteTarget, SendTarget, TargetUnavailable

__all__ = [
    "DEAD_LETTER_PREFIX",
    "MAX_DEAD_LETTERED_SUBJECT_LENGTH",
    "CircuitBreaker",
    "CircuitState",
    "EmbeddedTarget",
    "GroupWeight",
    "RemoteTarget",
    "RetryPolicy",
    "Router",
    "SendTarget",
    "TargetUnavailable",
    "dead_letter_subject",
]
