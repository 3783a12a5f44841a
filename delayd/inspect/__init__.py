"""``delayd inspect``: a data directory read offline, never changed.

``files`` scans framed files read-only and tells torn tails from corruption, ``report``
builds what is asked (summary, record listings, dispatch state, checkpoints, find) with
the project's codecs, ``text`` and ``as_json`` print it; the command is
delayd/cli/inspect.py.
"""

from delayd.inspect.files import CORRUPT, TORN_TAIL, Damage
from delayd.inspect.report import (
    InspectError,
    dispatch_report,
    find_message,
    list_bucket,
    list_message_log,
    read_checkpoints,
    summary,
)

__all__ = [
    "CORRUPT",
    "TORN_TAIL",
    "Damage",
    "InspectError",
    "dispatch_report",
    "find_message",
    "list_bucket",
    "list_message_log",
    "read_checkpoints",
    "summary",
]
