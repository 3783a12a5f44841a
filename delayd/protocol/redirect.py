"""The reason text of ERROR NOT_LEADER, which names the group's leader (docs/protocol.md).

A member that does not lead answers every request only a leader may take with ERROR
NOT_LEADER. The reason is a sentence for a person that ends in a machine-readable
field, so the frame needs no new layout::

    not the leader of group g1 (follower at epoch 7); leader=10.0.0.2:20801
    not the leader of group g1 (candidate); leader unknown

``leader=`` is the leader's address *for the listener asked* (its intake address to a
producer, its broker address to a consumer); ``leader unknown`` while there is no
leader (an election is under way).
"""

from __future__ import annotations

import re

from delayd.address import parse_address

LEADER_FIELD = "; leader="
LEADER_UNKNOWN = "; leader unknown"
_LEADER = re.compile(r"; leader=(\S+)$")


def not_leader_reason(group: str, role: str, epoch: int | None, leader: str | None) -> str:
    """The reason of a NOT_LEADER answer (see the module docstring); ``leader`` is a
    ``host:port`` or None when unknown."""
    at_epoch = f" at epoch {epoch}" if epoch is not None else ""
    where = f"{LEADER_FIELD}{leader}" if leader else LEADER_UNKNOWN
    return f"not the leader of group {group} ({role}{at_epoch}){where}"


def leader_in(reason: str) -> str | None:
    """The leader's ``host:port`` a NOT_LEADER reason names, or None when it names none
    (or names something that is not an address)."""
    found = _LEADER.search(reason)
    if found is None:
        return None
    try:
        parse_address(found.group(1))
    except ValueError:
        return None
    return found.group(1)
