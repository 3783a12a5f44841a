"""The addresses a client is given: one server, a group's members, or a group in etcd.

The forms (docs/clients.md, "Addresses"):

- ``HOST:PORT``: one server (delayd.address);
- ``HOST:PORT,HOST:PORT,...``: the members of a group; the client talks to the one that
  leads and follows its NOT_LEADER answers;
- ``etcd://HOST:PORT[,HOST:PORT...]/GROUP``: a group whose members and leader are read
  from etcd (at those endpoints, over ``http``);
- ``etcd://HOST:PORT[,...]/CLUSTER/GROUP``: the same, in the cluster named CLUSTER;
- ``etcd://HOST:PORT[,...]/*`` and ``etcd://HOST:PORT[,...]/CLUSTER/*``: every group of
  the cluster (the default one, or CLUSTER): a producer spreads its messages over the
  delay groups, a consumer reads from every broker group (docs/cluster.md).

Parsed here only; imports nothing from delayd but the address rule, so every layer may
use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from delayd.address import EXAMPLES, parse_address

ETCD_SCHEME = "etcd://"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
EVERY_GROUP = "*"
FORMS = f'{EXAMPLES}, a member list "h1:20801,h2:20801" or "etcd://127.0.0.1:2379/GROUP"'
ETCD_FORMS = (
    "etcd://127.0.0.1:2379/GROUP, etcd://127.0.0.1:2379/CLUSTER/GROUP, "
    "or * for every group: etcd://127.0.0.1:2379/* (names: letters, digits, '.', '_', '-')"
)


@dataclass(frozen=True, slots=True)
class GroupAddress:
    """Where to find a server: ``members`` (``host:port`` texts, as written; one for a
    single server), or ``etcd`` endpoint URLs and the ``group`` to look up there, in the
    cluster named ``cluster`` ("" the default one); ``group`` is ``EVERY_GROUP`` for the
    whole cluster."""

    members: tuple[str, ...] = ()
    etcd: tuple[str, ...] = ()
    group: str = ""
    cluster: str = ""

    @property
    def whole_cluster(self) -> bool:
        """Every group of the cluster rather than one (``etcd://HOST:PORT/*``)."""
        return bool(self.etcd) and self.group == EVERY_GROUP

    @property
    def single(self) -> str | None:
        """The one server's address when that is all it names, else None."""
        return self.members[0] if len(self.members) == 1 and not self.etcd else None

    def __str__(self) -> str:
        if self.etcd:
            hosts = ",".join(url.removeprefix("http://") for url in self.etcd)
            path = f"{self.cluster}/{self.group}" if self.cluster else self.group
            return f"{ETCD_SCHEME}{hosts}/{path}"
        return ",".join(self.members)


def parse_group_address(text: str) -> GroupAddress:
    """``text`` in one of the forms of the module docstring -> GroupAddress. Raises
    ValueError naming ``text`` and the forms."""
    if not isinstance(text, str):
        raise ValueError(f"an address is a string such as {FORMS}, not {text!r}")
    if text.startswith(ETCD_SCHEME):
        return _etcd(text)
    if "," not in text:
        parse_address(text)
        return GroupAddress(members=(text,))
    members = tuple(part.strip() for part in text.split(","))
    for member in members:
        if not member:
            raise ValueError(f"address {text!r} has an empty member; write {FORMS}")
        try:
            parse_address(member)
        except ValueError as exc:
            raise ValueError(f"member list {text!r}: {exc}") from None
    return GroupAddress(members=tuple(dict.fromkeys(members)))


def _etcd(text: str) -> GroupAddress:
    hosts, slash, path = text.removeprefix(ETCD_SCHEME).partition("/")
    *clusters, group = path.split("/")
    if (
        not slash
        or len(clusters) > 1
        or not all(_NAME.fullmatch(name) for name in clusters)
        or not (group == EVERY_GROUP or _NAME.fullmatch(group))
    ):
        raise ValueError(f"address {text!r}: name the group after the etcd endpoints: {ETCD_FORMS}")
    endpoints = []
    for host in hosts.split(","):
        try:
            parse_address(host.strip())
        except ValueError as exc:
            raise ValueError(f"address {text!r}: etcd endpoint: {exc}") from None
        endpoints.append(f"http://{host.strip()}")
    return GroupAddress(etcd=tuple(endpoints), group=group, cluster="".join(clusters))
