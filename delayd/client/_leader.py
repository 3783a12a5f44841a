"""Which member of a group a client talks to, sans-I/O (docs/clients.md, "Addresses").

The client starts at the first member of its address (or, for ``etcd://``, at the
leader etcd names) and moves:

- to the leader a NOT_LEADER answer names (``redirected``); a leader it did not know
  joins the candidates;
- to the next member when a connection cannot be made or NOT_LEADER names nobody
  (``failed``); with ``etcd://`` it reads the group from etcd again instead
  (``needs_lookup``).

With one plain address nothing ever moves: ``current`` is that address, as before.
``tried`` lists every member tried since the last answer, for the error that ends a
call.
"""

from __future__ import annotations

from delayd.group_address import GroupAddress


class LeaderFinder:
    """See the module docstring."""

    def __init__(self, target: GroupAddress) -> None:
        self.target = target
        self.candidates: list[str] = list(target.members)
        self.current: str | None = self.candidates[0] if self.candidates else None
        self.needs_lookup = bool(target.etcd)
        self.tried: list[str] = []

    def __repr__(self) -> str:
        return f"<LeaderFinder {self.target} at {self.current} tried {self.tried}>"

    def attempt(self) -> str:
        """The member to connect to now (``current``), noted as tried."""
        assert self.current is not None, "look the group up first (needs_lookup)"
        if self.current not in self.tried:
            self.tried.append(self.current)
        return self.current

    def learned(self, members: list[str], leader: str | None) -> None:
        """What etcd says: the members' addresses and the leader's (None: no leader
        now). With no address at all the lookup is needed again."""
        self.candidates = list(dict.fromkeys([*([leader] if leader else []), *members]))
        self.current = self.candidates[0] if self.candidates else None
        self.needs_lookup = self.current is None

    def redirected(self, leader: str | None) -> None:
        """A NOT_LEADER answer from ``current`` named ``leader`` (or nobody)."""
        if leader is None:
            self.failed()
            return
        if leader not in self.candidates:
            self.candidates.append(leader)
        self.current = leader

    def failed(self) -> None:
        """``current`` could not be used: move to the next member (or look up again)."""
        if self.target.etcd:
            self.needs_lookup = True
            return
        if self.current in self.candidates and len(self.candidates) > 1:
            index = self.candidates.index(self.current)
            self.current = self.candidates[(index + 1) % len(self.candidates)]

    @property
    def untried(self) -> bool:
        """Whether a member of the list has not been tried since the last answer."""
        return any(member not in self.tried for member in self.candidates)

    def answered(self) -> None:
        """``current`` answered a request: it is the one to keep."""
        self.tried.clear()

    def describe_tried(self) -> str:
        return ", ".join(self.tried) if self.tried else str(self.target)
