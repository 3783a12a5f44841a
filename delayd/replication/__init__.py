"""Replication of a group's streams from its leader to its followers.

The data path only: streams, the epoch history, the wire frames, the leader's and the
follower's sides. Wiring them into ``delayd serve`` / ``delayd broker`` roles is the
server's (docs/replication.md, "Replication protocol").
"""

from delayd.replication.epochs import EpochHistory, EpochHistoryError
from delayd.replication.follower import Follower, FollowRefused
from delayd.replication.in_sync import InSyncTracker
from delayd.replication.leader import ACK_LEADER, ACK_SYNC, Leader, LeaderFenced, LeaderStopped
from delayd.replication.streams import (
    COMMITLOG,
    MESSAGE_LOG,
    BrokerStreams,
    DelayStreams,
    StreamSet,
    dispatch_stream,
    offsets_stream,
)

__all__ = [
    "ACK_LEADER",
    "ACK_SYNC",
    "COMMITLOG",
    "MESSAGE_LOG",
    "BrokerStreams",
    "DelayStreams",
    "EpochHistory",
    "EpochHistoryError",
    "FollowRefused",
    "Follower",
    "InSyncTracker",
    "Leader",
    "LeaderFenced",
    "LeaderStopped",
    "StreamSet",
    "dispatch_stream",
    "offsets_stream",
]
