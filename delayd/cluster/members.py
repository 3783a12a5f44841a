"""What a group keeps in etcd, and what a member concludes from it (pure, no I/O).

Keys, for group ``G`` under its cluster's ``prefix`` (``cluster_prefix``: ``/delayd`` for
the default cluster, ``/delayd/clusters/NAME`` for the cluster NAME)::

    <prefix>/groups/G/members/<member_id>   MemberInfo JSON, on the member's lease
    <prefix>/groups/G/leader                the leader's MemberInfo JSON, on its lease
    <prefix>/groups/G/in_sync               the members that may lead, a JSON list of ids

Both live on the member's lease, so a member that dies (or loses etcd for longer than
its lease) disappears from the group by itself. The leader key is created in a txn that
holds only if the key does not exist; the revision that created it is the leader's
**epoch**. etcd's revisions only grow, so every new leader has a greater epoch than every
leader before it, which is what lets a follower refuse an old leader.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from delayd.cluster.etcd import KeyValue

DEFAULT_PREFIX = "/delayd"
NAMED_CLUSTERS = f"{DEFAULT_PREFIX}/clusters"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_name(kind: str, name: str) -> str:
    """``name`` if it can be a group name or member id (a single etcd key segment:
    letters, digits, ``.``, ``_``, ``-``, at most 128); else ValueError saying so."""
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"{kind} {name!r} must be 1 to 128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def cluster_prefix(cluster: str) -> str:
    """The key prefix of the cluster named ``cluster``: every group of one cluster lives
    under one prefix (docs/cluster.md). "" is the default cluster, ``/delayd``, where a
    server without ``[cluster] name`` registers. Raises ValueError for a bad name."""
    if not cluster:
        return DEFAULT_PREFIX
    return f"{NAMED_CLUSTERS}/{check_name('cluster name', cluster)}"


class Role(enum.IntEnum):
    """A member's role as it sees it (the value is what a gauge exports)."""

    CANDIDATE = 0  # no leader known: campaigning, waiting to be eligible, or cut off
    FOLLOWER = 1  # another member holds the leader key
    LEADER = 2  # this member holds the leader key on a lease it still trusts


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """Who a member is and where to reach it (``host:port`` strings; "" when it does not
    serve that). Decoding ignores fields it does not know, so later versions can add
    some (how much data a member holds, for instance) without breaking older readers.

    ``data_dir`` is the member's data directory as an absolute path *as that member
    sees it*, on ``hostname`` ("" when it does not say: an older member): what
    ``delayd audit --etcd`` reads, where the directory is mounted."""

    member_id: str
    intake: str = ""
    broker: str = ""
    replication: str = ""
    metrics: str = ""
    http: str = ""  # the HTTP/JSON API of a delay server
    data_dir: str = ""
    hostname: str = ""

    def __post_init__(self) -> None:
        check_name("member id", self.member_id)

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> MemberInfo:
        """Raises ValueError for anything but a JSON object with a valid ``member_id``."""
        try:
            fields = json.loads(data)
        except ValueError:
            raise ValueError(f"member info is not JSON: {data[:100]!r}") from None
        if not isinstance(fields, dict) or not isinstance(fields.get("member_id"), str):
            raise ValueError(f"member info has no member_id: {data[:100]!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: str(v) for k, v in fields.items() if k in known})


@dataclass(frozen=True, slots=True)
class GroupKeys:
    """The etcd keys of one group (see the module docstring)."""

    prefix: str
    group: str

    def __post_init__(self) -> None:
        if self.prefix and (not self.prefix.startswith("/") or self.prefix.endswith("/")):
            raise ValueError(f"key prefix {self.prefix!r} must start with '/' and not end with it")
        check_name("group", self.group)

    @property
    def base(self) -> str:
        return f"{self.prefix}/groups/{self.group}"

    @property
    def leader(self) -> str:
        return f"{self.base}/leader"

    @property
    def in_sync(self) -> str:
        """The members that may lead (delayd.cluster.in_sync); no lease: it outlives them."""
        return f"{self.base}/in_sync"

    @property
    def members(self) -> str:
        """The prefix of every member key of the group."""
        return f"{self.base}/members/"

    def member(self, member_id: str) -> str:
        return self.members + check_name("member id", member_id)


@dataclass(frozen=True, slots=True)
class View:
    """What a member knows of its group: its role, the epoch of the leader it knows
    (its own when it leads), and that leader's info (None when unknown or unreadable)."""

    role: Role
    epoch: int | None = None
    leader: MemberInfo | None = None


NO_LEADER = View(Role.CANDIDATE)


def view_of(leader_kv: KeyValue | None, own_lease: int, own_id: str = "") -> View:
    """The view a member ``own_id`` holding lease ``own_lease`` takes of the leader key.

    The member leads when the key is on *its lease*, not when the key names its member
    id: a member restarted under the same id, with a new lease, must not take the key
    its previous life left behind for its own (that life's lease still has to expire).
    Nor may it follow that key: it would follow itself (and count itself in sync). It
    knows no leader until the key expires, then campaigns.
    """
    if leader_kv is None:
        return NO_LEADER
    try:
        leader: MemberInfo | None = MemberInfo.from_json(leader_kv.value)
    except ValueError:
        leader = None
    on_own_lease = own_lease and leader_kv.lease == own_lease
    if not on_own_lease and own_id and leader is not None and leader.member_id == own_id:
        return NO_LEADER
    role = Role.LEADER if own_lease and leader_kv.lease == own_lease else Role.FOLLOWER
    return View(role, leader_kv.create_revision, leader)
