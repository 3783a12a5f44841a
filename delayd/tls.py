"""TLS: the rules every listener and every client share, and the client's part.

A server reads ``[tls]`` of its configuration (or the ``--tls-*`` flags) into a
``ServerTlsConfig``: a certificate and key, and optionally a client CA, which turns on
mutual TLS (every client must present a certificate that CA signed). What the server
does with it — contexts, handshakes in each connection's task, SIGHUP reload — is
delayd.serving.tls.

Clients describe what they trust with ``ClientTls`` (a CA file, or the system's trust
store; a certificate and key for mutual TLS). A certificate the client refuses, or a
refusal from the server, is a ``TlsError``: not retried, since the next attempt would
fail the same way. Streams on both sides treat a close without close_notify as EOF:
the protocol's frames carry their own lengths, so a cut stream is seen as one.
"""

from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING

from delayd.errors import ConnectionClosedError, DelaydError

if TYPE_CHECKING:
    import trio


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
            load_ca(context, self.ca_file, "CA file")
        if self.cert_file is not None and self.key_file is not None:
            load_chain(context, self.cert_file, self.key_file)
        return context


def _readable(path: str, what: str) -> None:
    """Raises TlsError when ``path`` cannot be opened for reading."""
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise TlsError(f"TLS {what} {path}: cannot be read: {exc.strerror}") from None


def load_chain(context: ssl.SSLContext, cert_file: str, key_file: str) -> None:
    """Load a certificate and its key into ``context``. Raises TlsError naming the
    files and what is wrong with them."""
    _readable(cert_file, "certificate file")
    _readable(key_file, "key file")
    try:
        context.load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise TlsError(
            f"TLS certificate file {cert_file} with key file {key_file}: {ssl_reason(exc)} "
            "(both must be PEM, the key unencrypted and the one of that certificate)"
        ) from None


def load_ca(context: ssl.SSLContext, ca_file: str, what: str) -> None:
    """Trust the CA certificates in ``ca_file`` (``what`` names it in errors). Raises
    TlsError naming the file and what is wrong with it."""
    _readable(ca_file, what)
    try:
        context.load_verify_locations(cafile=ca_file)
    except ssl.SSLError as exc:
        raise TlsError(
            f"TLS {what} {ca_file}: {ssl_reason(exc)} (it must hold PEM certificates)"
        ) from None


def ssl_reason(exc: ssl.SSLError) -> str:
    """OpenSSL's reason in words ("KEY_VALUES_MISMATCH" -> "key values mismatch")."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, str):
        return reason.lower().replace("_", " ")
    return str(exc)


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
    reason = ssl_reason(exc)
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
