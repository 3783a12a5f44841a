"""TLS for every listener and every client: the one place its rules live.

A server gets one ``ServerTls`` from ``[tls]`` of its configuration (or the
``--tls-*`` flags): a certificate and key, and optionally a client CA, which turns on
mutual TLS (every client must present a certificate that CA signed). Every listener
of the process uses it: intake, broker, metrics and the HTTP API.

Handshakes run in each connection's own task, never in the accept loop, and within the
listener's HELLO deadline: a client that stalls its handshake holds one task and one
descriptor until then, as a client that stalls its HELLO does. Server streams are
``https_compatible``: closing sends no close_notify (it could block on a client that
does not read, in a shielded close) and a client that closes without one is at EOF.
The protocol's frames carry their own lengths, so a cut stream is seen as one.

``ServerTls.reload`` (on SIGHUP) reads the files again: new connections get the new
certificate, connections already open keep theirs, and files that cannot be used are
logged and the old context kept, so a bad rotation never stops a serving process.

Clients describe what they trust with ``ClientTls`` (a CA file, or the system's trust
store; a certificate and key for mutual TLS). A certificate the client refuses, or a
refusal from the server, is a ``TlsError``: not retried, since the next attempt would
fail the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import os
import signal
import ssl
from dataclasses import dataclass

import trio

from delayd.connection_gate import RateLimitedLog
from delayd.errors import ConnectionClosedError, DelaydError

log = logging.getLogger(__name__)

# The HTTP API's protocols (hypercorn serves both); the other listeners offer none, so
# that an HTTP/2 client of /metrics falls back to HTTP/1.x, the only one served there.
HTTP_ALPN = ("h2", "http/1.1")


class TlsError(DelaydError):
    """A certificate, key or CA file that cannot be used (the message names the file
    and what is wrong), or a TLS handshake refused by either side."""


@dataclass(frozen=True, slots=True)
class ServerTlsConfig:
    """``[tls]``: the certificate and key every listener presents (PEM files; the
    certificate file may hold the chain after it), and ``client_ca_file``, when set,
    the CA (PEM) whose certificates clients must present (mutual TLS)."""

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    @classmethod
    def from_files(
        cls, cert_file: str | None, key_file: str | None, client_ca_file: str | None
    ) -> ServerTlsConfig | None:
        """The config of these files (``[tls]`` or the ``--tls-*`` flags), or None when
        none is given. Raises ValueError for a certificate without its key, or a client
        CA without either."""
        if cert_file is None and key_file is None and client_ca_file is None:
            return None
        if cert_file is None or key_file is None:
            raise ValueError(
                "tls: set both tls.cert_file and tls.key_file (--tls-cert and --tls-key: "
                "the server's certificate and its key) to serve with TLS; a client CA "
                "alone is not enough"
            )
        return cls(cert_file, key_file, client_ca_file)


@dataclass(frozen=True)
class ClientTls:
    """What a client trusts and presents: ``ca_file`` (PEM) the server's certificate
    must chain to (None: the system's trust store), and for mutual TLS a
    ``cert_file`` and ``key_file`` (both or neither). ``server_name``: the name the
    server's certificate must carry (default: the host connected to).

    Raises ValueError for a certificate without its key or the reverse. A client
    builds ``ssl_context`` once, when it is created (TlsError for a file it cannot
    use), and uses it for every connection."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError(
                "TLS: give both cert_file and key_file (a client certificate and its key), "
                "or neither"
            )

    @functools.cached_property
    def ssl_context(self) -> ssl.SSLContext:
        """The client context (the server's certificate and name verified). Raises
        TlsError naming a file that cannot be read or used."""
        context = ssl.create_default_context()
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca_file is not None:
            _load_ca(context, self.ca_file, "CA file")
        if self.cert_file is not None and self.key_file is not None:
            _load_chain(context, self.cert_file, self.key_file)
        return context


def server_context(config: ServerTlsConfig, alpn: tuple[str, ...] = ()) -> ssl.SSLContext:
    """A server context from ``config``'s files (TLS 1.2 at least; a client certificate
    required and verified when ``client_ca_file`` is set). Raises TlsError naming the
    file and what is wrong with it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(context, config.cert_file, config.key_file)
    if config.client_ca_file is not None:
        _load_ca(context, config.client_ca_file, "client CA file")
        context.verify_mode = ssl.CERT_REQUIRED
    if alpn:
        context.set_alpn_protocols(list(alpn))
    return context


def _readable(path: str, what: str) -> None:
    """Raises TlsError when ``path`` cannot be opened for reading."""
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise TlsError(f"TLS {what} {path}: cannot be read: {exc.strerror}") from None


def _load_chain(context: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    _readable(cert_file, "certificate file")
    _readable(key_file, "key file")
    try:
        context.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise TlsError(
            f"TLS certificate file {cert_file} with key file {key_file}: {_reason(exc)} "
            "(both must be PEM, the key unencrypted and the one of that certificate)"
        ) from None


def _load_ca(context: ssl.SSLContext, ca_file: str, what: str) -> None:
    _readable(ca_file, what)
    try:
        context.load_verify_locations(cafile=ca_file)
    except ssl.SSLError as exc:
        raise TlsError(
            f"TLS {what} {ca_file}: {_reason(exc)} (it must hold PEM certificates)"
        ) from None


def _reason(exc: ssl.SSLError) -> str:
    """OpenSSL's reason in words ("KEY_VALUES_MISMATCH" -> "key values mismatch")."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str):
        return reason.lower().replace("_", " ")
    return str(exc)


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
        return _reason(cause)
    return str(cause or exc) or "the client closed the connection"


def peer_of(stream: trio.abc.Stream) -> str:
    """``host:port`` of the peer of a socket stream, also under TLS; ``?`` if unknown."""
    try:
        return "{}:{}".format(*transport_of(stream).socket.getpeername()[:2])  # type: ignore[attr-defined]
    except (AttributeError, OSError, TypeError):
        return "?"


def transport_of(stream: trio.abc.Stream) -> trio.abc.Stream:
    """The TCP stream under a TLS stream, or ``stream`` itself."""
    return getattr(stream, "transport_stream", stream)


def handshake_failure(exc: ssl.SSLError, address: str) -> DelaydError:
    """What a client raises when TLS with ``address`` failed with ``exc``:
    ConnectionClosedError (worth another attempt) when the connection was cut, else a
    TlsError saying what the client refused (an unknown CA, a wrong name) or what the
    server did (no or an unknown client certificate), and what to check."""
    if isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
        return ConnectionClosedError(f"{address} closed the connection during the TLS handshake")
    reason = _reason(exc)
    if isinstance(exc, ssl.SSLCertVerificationError):
        hint = (
            f"{exc.verify_message}: give the CA that signed the server's certificate "
            "(ClientTls ca_file, --tls-ca, tls_ca_file), and connect by a name the "
            "certificate carries"
        )
    elif "certificate required" in reason or "unknown ca" in reason or "bad certificate" in reason:
        hint = (
            "the server requires a client certificate its client CA signed (ClientTls "
            "cert_file and key_file, --tls-cert and --tls-key, tls_cert_file and tls_key_file)"
        )
    elif "wrong version number" in reason or "record layer failure" in reason:
        hint = "is the server listening with TLS?"
    else:
        hint = "check the TLS settings of the client and the server"
    return TlsError(f"TLS with {address} failed: {reason}; {hint}")


def add_client_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls-ca``, ``--tls-cert`` and ``--tls-key`` for a client command, defaulting
    to ``DELAYD_TLS_CA``, ``DELAYD_TLS_CERT`` and ``DELAYD_TLS_KEY``."""
    env = os.environ.get
    parser.add_argument(
        "--tls-ca",
        metavar="FILE",
        default=env("DELAYD_TLS_CA"),
        help="connect with TLS, trusting the CA in FILE (PEM; env DELAYD_TLS_CA)",
    )
    parser.add_argument(
        "--tls-cert",
        metavar="FILE",
        default=env("DELAYD_TLS_CERT"),
        help="client certificate for mutual TLS (PEM; env DELAYD_TLS_CERT)",
    )
    parser.add_argument(
        "--tls-key",
        metavar="FILE",
        default=env("DELAYD_TLS_KEY"),
        help="the client certificate's key (PEM; env DELAYD_TLS_KEY)",
    )


def client_tls_from_args(args: argparse.Namespace) -> ClientTls | None:
    """The ClientTls of ``add_client_tls_arguments``, or None (plain TCP) when none of
    them is given. Raises TlsError for a certificate without its key."""
    if args.tls_ca is None and args.tls_cert is None and args.tls_key is None:
        return None
    try:
        return ClientTls(args.tls_ca, args.tls_cert, args.tls_key)
    except ValueError as exc:
        raise TlsError(f"{exc} (--tls-cert, --tls-key)") from None


def add_server_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls-cert``, ``--tls-key`` and ``--tls-client-ca`` for a server command."""
    parser.add_argument(
        "--tls-cert", metavar="FILE", help="serve every listener with TLS: certificate (PEM)"
    )
    parser.add_argument("--tls-key", metavar="FILE", help="the certificate's key (PEM)")
    parser.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="require client certificates signed by the CA in FILE (mutual TLS)",
    )
