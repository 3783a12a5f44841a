"""Consumer ids: unique per consumer instance, readable in the broker's logs."""

from __future__ import annotations

import os
import secrets
import socket


def new_consumer_id() -> str:
    """``host-pid-random``: the host and process say where it runs, the random part
    keeps two consumers of one process (or a reused pid) apart."""
    host = socket.gethostname().split(".")[0] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"
