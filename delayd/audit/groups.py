"""Delay groups: which one copy of a group's logs the audit reads.

A group's members hold byte-identical copies of message_log and dispatch_log
(docs/replication.md) and derive schedule_log from them with the same code, so one copy
says everything the group did — and reading two would count every message twice. The
audit reads the **leader's** copy when etcd names the leader and its directory is
readable here: the leader holds everything the group acknowledged. Otherwise it reads
the copy that **holds most** (bytes of schedule_log and dispatch_log, what the audit
judges): a follower that lags holds a prefix of the leader's logs, and judged alone its
missing tail would read as messages never dispatched.

A directory is readable when it is a delayd data directory at that path on this
machine: the path a member registers is the path as *it* sees it (MemberInfo's
``data_dir``, on its ``hostname``), so the audit must run where the directories are
mounted at those paths. Members on hosts of their own often register one path
(``/var/lib/delayd`` everywhere): such a path is taken here only for the member on
this host, and two groups are never read from one directory.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from delayd.audit.config import Server
from delayd.logs import log_files

_JUDGED_LOGS = (log_files.SCHEDULE_LOG, log_files.DISPATCH_LOG)


@dataclass(frozen=True, slots=True)
class Copy:
    """One copy of a delay group's logs: a member's data directory (``member`` its id,
    on ``hostname``, ``leader`` when etcd names it the leader), or a ``--data``
    directory (no member)."""

    group: str
    data_dir: str
    member: str = ""
    hostname: str = ""
    leader: bool = False

    def describe(self) -> str:
        """``member m1 on host h (leader): /path``, or the path alone."""
        if not self.member:
            return self.data_dir
        where = f" on {self.hostname}" if self.hostname else ""
        role = " (leader)" if self.leader else ""
        return f"member {self.member}{where}{role}: {self.data_dir or 'no data_dir registered'}"


class CopyMissingError(FileNotFoundError):
    """No copy of a group is readable here; the message says where each one is and what
    to do."""


def held_bytes(data_dir: str) -> int:
    """Bytes of schedule_log and dispatch_log in ``data_dir``. Raises FileNotFoundError
    when it is not a data directory."""
    return sum(file.size for log in _JUDGED_LOGS for file in log_files.list_files(data_dir, log))


def choose(copies: list[Copy], here: str = "", shared: frozenset[str] = frozenset()) -> Server:
    """The copy of one group to read, as a Server named after the group, whose ``copy``
    says which and why. ``here`` is this host's name; ``shared`` the paths more than one
    member registers (each on its own host: only the one on ``here`` is taken for such a
    path). Raises CopyMissingError when none is readable here, naming each copy and why
    it is not."""
    group = copies[0].group
    held: dict[Copy, int] = {}
    unreadable: list[str] = []
    for copy in copies:
        if not copy.data_dir:
            unreadable.append(f"{copy.describe()} (an older delayd: it registers no data_dir)")
            continue
        if copy.member and copy.data_dir in shared and copy.hostname != here:
            unreadable.append(
                f"{copy.describe()} (other members register the same path, each on its own "
                f"host: here, on {here}, it is not this member's)"
            )
            continue
        try:
            held[copy] = held_bytes(copy.data_dir)
        except (FileNotFoundError, NotADirectoryError, PermissionError) as exc:
            unreadable.append(f"{copy.describe()} ({exc.strerror or exc})")
    if not held:
        raise CopyMissingError(
            f"group {group}: no copy of its logs is readable here: {'; '.join(unreadable)}. "
            "A member's data_dir is the path as that member sees it: run the audit where "
            f"the directories are mounted at those paths, or give one with --data {group}=DIR"
        )
    leaders = [copy for copy in held if copy.leader]
    if leaders:
        chosen, why = leaders[0], "the leader's copy"
    else:
        chosen = max(held, key=lambda copy: held[copy])
        why = "the copy that holds most" if len(copies) > 1 else "the only copy"
    others = len(copies) - 1
    why += f"; {others} other cop{'y' if others == 1 else 'ies'} not read" if others else ""
    return Server(group, chosen.data_dir, copy=f"{chosen.describe()} ({why})")


def servers(copies: Iterable[Copy], here: str = "") -> tuple[Server, ...]:
    """One Server per group of ``copies`` (choose; ``here`` this host's name), in the
    order the groups first appear; a group of one ``--data`` directory is read as given,
    with nothing to say of copies. Raises CopyMissingError as choose does, and
    ValueError when two groups would be read from one directory."""
    by_group: dict[str, list[Copy]] = {}
    registered: dict[str, int] = {}
    for copy in copies:
        by_group.setdefault(copy.group, []).append(copy)
        if copy.member and copy.data_dir:
            registered[copy.data_dir] = registered.get(copy.data_dir, 0) + 1
    shared = frozenset(path for path, members in registered.items() if members > 1)
    chosen = tuple(
        Server(group, mine[0].data_dir)
        if len(mine) == 1 and not mine[0].member
        else choose(mine, here, shared)
        for group, mine in by_group.items()
    )
    read_by: dict[str, str] = {}
    for server in chosen:
        real = os.path.realpath(server.data_dir)
        if real in read_by:
            raise ValueError(
                f"groups {read_by[real]} and {server.name} would both be read from {real}: "
                "one directory holds one group's logs; give each group its own with "
                "--data NAME=DIR"
            )
        read_by[real] = server.name
    return chosen
