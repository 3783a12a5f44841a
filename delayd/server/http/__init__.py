"""The HTTP/JSON API of the delay server (docs/http.md): routes, request and response
models, problem details, the body limit, and the listener that serves them."""

from __future__ import annotations

import trio

from delayd.server.http.limits import BodyLimit, body_limit_bytes
from delayd.server.http.listener import HttpListener
from delayd.server.http.routes import Backend, build_app
from delayd.serving.tls import ServerTls


def open_api(
    backend: Backend,
    listeners: list[trio.SocketListener],
    *,
    max_record_bytes: int,
    grace_s: float,
    tls: ServerTls | None = None,
) -> HttpListener:
    """The API over ``backend``, to serve on the bound ``listeners`` (``serve``), with
    a body limit that fits the intake's largest record; over TLS when ``tls`` is given."""
    app = BodyLimit(build_app(backend), body_limit_bytes(max_record_bytes))
    listener = HttpListener(app, listeners, grace_s=grace_s, tls=tls)
    listener.on_stop.append(backend.stop_pulls)
    return listener


__all__ = ["Backend", "HttpListener", "build_app", "open_api"]
