"""Parsing ``"host:port"`` broker and server addresses."""

from __future__ import annotations

EXAMPLE = '"127.0.0.1:20811" or "broker.internal:20811" or "[::1]:20811"'


def parse_addr(addr: str) -> tuple[str, int]:
    """Split ``addr`` into (host, port).

    ``addr`` is ``host:port`` with a host name or IPv4 address, or ``[v6]:port`` for an
    IPv6 address (brackets, as in URLs, because the address itself contains colons).
    Raises ValueError, with an example of the right form, for anything else.
    """
    if not isinstance(addr, str):
        raise ValueError(f"address must be a 'host:port' string such as {EXAMPLE}, got {addr!r}")
    host, sep, port_text = addr.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        sep = ""  # a bare IPv6 address: the port cannot be told from the address
    if not sep or not host or not port_text.isdigit() or not port_text.isascii():
        raise ValueError(f"address must be 'host:port', such as {EXAMPLE}; got {addr!r}")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"port must be 1..65535 in {addr!r}; for example {EXAMPLE}")
    return host, port
