"""Certificates made on the fly (trustme) and written to files, as an operator has them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme

from delayd.tls import ClientTls, ServerTlsConfig

NAMES = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class Pki:
    """One CA, with PEM files in one directory: the CA's certificate, a server
    certificate for loopback and a client certificate, each with its key."""

    ca: trustme.CA
    ca_file: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str

    def server(self, *, mutual: bool = False) -> ServerTlsConfig:
        """The server's config; ``mutual``: clients need a certificate of this CA."""
        return ServerTlsConfig(self.server_cert, self.server_key, self.ca_file if mutual else None)

    def client(self, *, with_cert: bool = False) -> ClientTls:
        """A client trusting this CA; ``with_cert``: presenting its client certificate."""
        if with_cert:
            return ClientTls(self.ca_file, self.client_cert, self.client_key)
        return ClientTls(self.ca_file)


def make_pki(directory: Path) -> Pki:
    """A new CA with its certificates written under ``directory`` (created)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    files = ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")
    pki = Pki(ca, *(str(directory / name) for name in files))
    ca.cert_pem.write_to_path(pki.ca_file)
    server = ca.issue_cert(*NAMES)
    server.cert_chain_pems[0].write_to_path(pki.server_cert)
    for pem in server.cert_chain_pems[1:]:
        pem.write_to_path(pki.server_cert, append=True)
    server.private_key_pem.write_to_path(pki.server_key)
    client = ca.issue_cert("client@delayd.test")
    client.cert_chain_pems[0].write_to_path(pki.client_cert)
    client.private_key_pem.write_to_path(pki.client_key)
    return pki
