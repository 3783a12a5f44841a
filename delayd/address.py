"""``host:port`` addresses: the one rule every listener, client, CLI and tool follows.

The rule (docs/configuration.md, "Addresses"):

- ``HOST:PORT``: a host name or IPv4 address, a colon, a port: ``127.0.0.1:20811``,
  ``broker.internal:20811``.
- An IPv6 address goes in brackets, as in URLs: ``[::1]:20811``. Without them the port
  cannot be told from the address (is ``::1:20811`` port 20811 of ``::1``, or the
  address ``::1:20811`` with no port?), so a bare one is refused.
- The port is 1 to 65535 in ASCII digits (not ``+80``, not full-width digits).
  Port 0 only where the caller binds a listener and asks the system for a free port
  (``allow_port_zero``).
- The host is never empty, and nothing may surround the address (no spaces).

Imports nothing from delayd, so that every layer may use it.
"""

from __future__ import annotations

import ipaddress
from typing import NamedTuple

EXAMPLES = '"127.0.0.1:20811", "broker.internal:20811" or "[::1]:20811"'
MAX_PORT = 65535


class Address(NamedTuple):
    """A host and a port; ``str()`` writes it back in the form the parser reads."""

    host: str
    port: int

    def __str__(self) -> str:
        return format_address(self.host, self.port)


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets (``[::1]:20811``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(text: str, *, allow_port_zero: bool = False) -> Address:
    """``text`` (``HOST:PORT``, ``[IPV6]:PORT``) -> Address(host, port).

    The host comes back without brackets. ``allow_port_zero`` accepts port 0 (a listener
    that binds a free port). Raises ValueError naming ``text`` and saying what to write
    instead.
    """
    if not isinstance(text, str):
        raise ValueError(f"an address is a 'HOST:PORT' string such as {EXAMPLES}, not {text!r}")
    if any(c.isspace() for c in text):
        raise ValueError(f"address {text!r} contains white space; write it as {EXAMPLES}")
    host, colon, port_text = text.rpartition(":")
    if not colon or text.endswith("]"):  # "[::1]": the colons are the address's
        raise ValueError(f"address {text!r} has no port; write HOST:PORT, such as {EXAMPLES}")
    if host.startswith("["):
        host = _bracketed_ipv6(text, host)
    elif ":" in host:
        raise ValueError(
            f"address {text!r}: put an IPv6 address in brackets, as in {_bracketed_example(text)}"
        )
    elif not host:
        raise ValueError(f"address {text!r} has no host; write HOST:PORT, such as {EXAMPLES}")
    elif "[" in host or "]" in host:
        raise ValueError(f"address {text!r}: brackets go around an IPv6 address, [::1]:20811")
    return Address(host, _port(text, port_text, allow_port_zero))


def _bracketed_example(text: str) -> str:
    """How ``text``, a bare IPv6 address with or without a port, is written."""
    host, _, port_text = text.rpartition(":")
    split = f"[{host}]:{port_text}" if _is_ipv6(host) and port_text.isdecimal() else None
    if not _is_ipv6(text):
        return split or "[::1]:20811"
    whole = f"[{text}]:PORT"
    return f"{split} if {port_text} is the port, else {whole}" if split else whole


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def _bracketed_ipv6(text: str, host: str) -> str:
    if not host.endswith("]"):
        raise ValueError(f"address {text!r}: close the bracket, as in [::1]:20811")
    inside = host[1:-1]
    if not _is_ipv6(inside):
        raise ValueError(
            f"address {text!r}: {inside!r} is not an IPv6 address; brackets are for IPv6 "
            "only ([::1]:20811), a host name or IPv4 address goes without them"
        )
    return inside


def _port(text: str, port_text: str, allow_port_zero: bool) -> int:
    lowest = 0 if allow_port_zero else 1
    allowed = f"{lowest} to {MAX_PORT}" + (" (0: a free port)" if allow_port_zero else "")
    # isdecimal() alone accepts other scripts' digits (full-width, Arabic-Indic), which
    # int() reads too: a port must be written as every other program reads it.
    if not (port_text.isascii() and port_text.isdecimal()):
        raise ValueError(f"address {text!r}: the port must be a number {allowed}")
    port = int(port_text)
    if not lowest <= port <= MAX_PORT:
        raise ValueError(f"address {text!r}: the port must be {allowed}, not {port}")
    return port
