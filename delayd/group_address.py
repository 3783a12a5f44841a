"""The addresses a client is given: one server, a group's members, or a group in etcd.

The forms (docs/clients.md, "Addresses"):

- ``HOST:PORT``: one server (delayd.address);
- ``HOST:PORT,HOST:PORT,...``: the members of a group; the client talks to the one that
  leads and follows its NOT_LEADER answers;
- ``etcd://HOST:PORT[,HOST:PORT...]/GROUP``: a group whose members and leader are read
  from etcd (at those endpoints, over ``http``).

Parsed here only; imports nothing from delayd but the address rule, so every layer may
use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from delayd.address import EXAMPLES, parse_address

ETCD_SCHEME = "etcd://"
_GROUP = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
FORMS = f'{EXAMPLES}, a member list "h1:20801,h2:20801" or "etcd://127.0.0.1:2379/GROUP"'


@dataclass(frozen=True, slots=True)
class GroupAddress:
    """Where to find a server: ``members`` (``host:port`` texts, as written; one for a
    single server), or ``etcd`` endpoint URLs and the ``group`` to look up there."""

    members: tuple[str, ...] = ()
    etcd: tuple[str, ...] = ()
    group: str = ""

    @property
    def single(self) -> str | None:
        """The one server's address when that is all it names, else None."""
        return self.members[0] if len(self.members) == 1 and not self.etcd else None

    def __str__(self) -> str:
        if self.etcd:
            hosts = ",".join(url.removeprefix("http://") for url in self.etcd)
            return f"{ETCD_SCHEME}{hosts}/{self.group}"
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
    hosts, slash, group = text.removeprefix(ETCD_SCHEME).partition("/")
    if not slash or not _GROUP.fullmatch(group):
        raise ValueError(
            f"address {text!r}: name the group after the etcd endpoints, as in "
            "etcd://127.0.0.1:2379/GROUP (letters, digits, '.', '_', '-')"
        )
    endpoints = []
    for host in hosts.split(","):
        try:
            parse_address(host.strip())
        except ValueError as exc:
            raise ValueError(f"address {text!r}: etcd endpoint: {exc}") from None
        endpoints.append(f"http://{host.strip()}")
    return GroupAddress(etcd=tuple(endpoints), group=group)
