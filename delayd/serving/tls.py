"""TLS on every listener of a server: intake, broker, metrics and the HTTP API share
one ``ServerTls``, made from ``[tls]`` (delayd.tls.ServerTlsConfig).

Handshakes run in each connection's own task, never in the accept loop, and within the
listener's HELLO deadline: a client that stalls its handshake holds one task and one
descriptor until then, as a client that stalls its HELLO does. Server streams are
``https_compatible``: closing sends no close_notify (it could block on a client that
does not read, in a shielded close) and a client that closes without one is at EOF.

``ServerTls.reload`` (on SIGHUP) reads the files again: new connections get the new
certificate, connections already open keep theirs, and files that cannot be used are
logged and the old context kept, so a bad rotation never stops a serving process.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import ssl

import trio

from delayd.serving.connection_gate import RateLimitedLog
from delayd.tls import ServerTlsConfig, TlsError, load_ca, load_chain, ssl_reason, transport_of

log = logging.getLogger(__name__)

# The HTTP API's protocols (hypercorn serves both); the other listeners offer none, so
# that an HTTP/2 client of /metrics falls back to HTTP/1.x, the only one served there.
HTTP_ALPN = ("h2", "http/1.1")


def server_context(config: ServerTlsConfig, alpn: tuple[str, ...] = ()) -> ssl.SSLContext:
    """A server context from ``config``'s files (TLS 1.2 at least; a client certificate
    required and verified when ``client_ca_file`` is set). Raises TlsError naming the
    file and what is wrong with it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    load_chain(context, config.cert_file, config.key_file)
    if config.client_ca_file is not None:
        load_ca(context, config.client_ca_file, "client CA file")
        context.verify_mode = ssl.CERT_REQUIRED
    if alpn:
        context.set_alpn_protocols(list(alpn))
    return context


class ServerTls:
    """A server's TLS contexts, replaced on ``reload``; see the module docstring.

    Raises TlsError (naming the file) when the files cannot be used at start."""

    def __init__(self, config: ServerTlsConfig) -> None:
        self.config = config
        self.context, self.http_context = self._load()
        self.handshake_failures = 0
        self._log = RateLimitedLog(log)

    def _load(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        return server_context(self.config), server_context(self.config, HTTP_ALPN)

    def reload(self) -> bool:
        """Read the files again for connections accepted from now on; True when they
        were taken. Files that cannot be used are logged and the contexts in use kept."""
        try:
            self.context, self.http_context = self._load()
        except TlsError as exc:
            log.error("TLS reload failed, still serving the certificate loaded before: %s", exc)
            return False
        log.info("TLS reloaded: new connections get %s", self.config.cert_file)
        return True

    async def accept(
        self, stream: trio.SocketStream, timeout_s: float
    ) -> trio.SSLStream[trio.SocketStream] | None:
        """``stream`` with the TLS handshake done within ``timeout_s``, or None (logged,
        rate-limited, and counted) when the client failed it or ran out of time. The
        caller closes ``stream`` either way."""
        secure = trio.SSLStream(stream, self.context, server_side=True, https_compatible=True)
        with trio.move_on_after(timeout_s):
            try:
                await secure.do_handshake()
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._failed(stream, _reason_of(exc))
                await _send_alert(stream, secure)
                return None
            return secure
        self._failed(stream, f"no handshake within {timeout_s:g} s")
        return None

    def _failed(self, stream: trio.SocketStream, reason: str) -> None:
        self.handshake_failures += 1
        self._log.warning("handshake", "TLS handshake with %s failed: %s", peer_of(stream), reason)

    def http_front_context(self) -> ssl.SSLContext:
        """A context for a server that builds its one context at start (hypercorn):
        every handshake switches, as its ClientHello arrives, to the HTTP context
        current then, so that ``reload`` reaches new connections there too."""
        front = server_context(self.config, HTTP_ALPN)

        def switch(ssl_object: ssl.SSLObject, _name: str | None, _front: ssl.SSLContext) -> None:
            ssl_object.context = self.http_context

        front.sni_callback = switch
        return front


# After a refused handshake: how long the client gets to read the alert and close.
ALERT_LINGER_S = 1.0


async def _send_alert(stream: trio.SocketStream, secure: trio.SSLStream[trio.SocketStream]) -> None:
    """Send the alert of a handshake this server refused (no client certificate, an
    unknown CA), then FIN, and read what the client still sends until it closes: trio
    drops the alert with the broken stream, and a close with the client's first bytes
    unread would reset the connection, so the client would see a reset, not why.
    ``_outgoing`` is where trio's SSLStream keeps the bytes OpenSSL wrote."""
    alert = secure._outgoing.read() if hasattr(secure, "_outgoing") else b""
    with (
        trio.move_on_after(ALERT_LINGER_S),
        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError, OSError),
    ):
        if alert:
            await stream.send_all(alert)
        await stream.send_eof()
        while await stream.receive_some(4096):
            pass


async def reload_on_sighup(
    tls: ServerTls | None, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Reload ``tls`` on every SIGHUP until cancelled (logging that there is nothing to
    reload without TLS). Started before a server's recovery: SIGHUP's default action
    would end the process."""
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        task_status.started()
        async for _ in signals:
            if tls is None:
                log.info("SIGHUP: no TLS configured, nothing to reload")
            else:
                tls.reload()


def _reason_of(exc: BaseException) -> str:
    cause = exc.__cause__
    if isinstance(cause, ssl.SSLError):
        return ssl_reason(cause)
    return str(cause or exc) or "the client closed the connection"


def peer_of(stream: trio.abc.Stream) -> str:
    """``host:port`` of the peer of a socket stream, also under TLS; ``?`` if unknown."""
    try:
        return "{}:{}".format(*transport_of(stream).socket.getpeername()[:2])  # type: ignore[attr-defined]
    except (AttributeError, OSError, TypeError):
        return "?"
