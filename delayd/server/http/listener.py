"""The HTTP listener: the API served by hypercorn's trio worker, in the server's nursery.

The sockets are bound before recovery with the other listeners (delayd.serving.listeners); here
hypercorn takes them over (a duplicate of each descriptor, ``fd://``; the bound ones
are closed), so a port clash is still reported at once and connections made during
recovery wait in the backlog.

``stop`` is the graceful shutdown: long polls are answered with what they have, no
new connection is accepted, and requests in flight get ``grace_s`` to finish (a send
being acknowledged is answered), as on the binary listener.
"""

from __future__ import annotations

import logging
import os
import ssl
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from delayd.serving.connection_limits import DEFAULT_HELLO_TIMEOUT_MS
from delayd.serving.listeners import bound_addresses
from delayd.serving.tls import ServerTls

log = logging.getLogger(__name__)

Address = tuple[str, int]
KEEP_ALIVE_S = 75  # longer than a typical proxy's or client pool's idle time
# A TLS handshake not done by then is dropped: the binary listeners' HELLO deadline
# (hypercorn's own default, 60 s, would let a stalled client hold a descriptor longer).
TLS_HANDSHAKE_TIMEOUT_S = DEFAULT_HELLO_TIMEOUT_MS / 1000


class HttpListener:
    """Serves ``app`` on bound ``listeners`` until ``stop``, over TLS (https) when
    ``tls`` is given."""

    def __init__(
        self,
        app: Any,
        listeners: list[trio.SocketListener],
        *,
        grace_s: float,
        tls: ServerTls | None = None,
    ) -> None:
        self.app = app
        self.listeners = listeners
        self.grace_s = grace_s
        self.tls = tls
        self.on_stop: list[Any] = []  # callables run when the stop begins
        self._stop = trio.Event()
        self._stopped = trio.Event()

    async def serve(self, *, task_status: trio.TaskStatus[Address]) -> None:
        """Serve until ``stop``; reports the first bound address once it accepts."""
        address = bound_addresses(self.listeners)[0]
        config = Config() if self.tls is None else _TlsConfig(self.tls)
        config.bind = [f"fd://{os.dup(listener.socket.fileno())}" for listener in self.listeners]
        for listener in self.listeners:
            await listener.aclose()
        config.graceful_timeout = self.grace_s
        config.keep_alive_timeout = KEEP_ALIVE_S
        config.ssl_handshake_timeout = TLS_HANDSHAKE_TIMEOUT_S
        config.accesslog = None
        config.errorlog = log
        config.include_server_header = False
        try:
            async with trio.open_nursery() as nursery:
                run = partial(serve, self.app, config, shutdown_trigger=self._stop.wait)
                await nursery.start(run)
                task_status.started(address)
        finally:
            self._stopped.set()

    async def stop(self) -> None:
        """Stop: see the module docstring. Returns once the listener is closed."""
        for hook in self.on_stop:
            hook()
        self._stop.set()
        await self._stopped.wait()


class _TlsConfig(Config):
    """hypercorn's configuration with delayd's TLS context: hypercorn builds its one
    context at start; this one follows ``ServerTls.reload`` (delayd.tls)."""

    def __init__(self, tls: ServerTls) -> None:
        super().__init__()
        self._tls = tls

    @property
    def ssl_enabled(self) -> bool:
        return True

    def create_ssl_context(self) -> ssl.SSLContext:
        return self._tls.http_front_context()
