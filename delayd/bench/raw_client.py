"""Just enough of the protocol for a benchmark to measure the server, not a client
library: one socket, HELLO, requests written as prepared bytes, answers read in order,
STATS."""

from __future__ import annotations

import socket
import ssl
from functools import partial

from delayd import protocol
from delayd.address import format_address
from delayd.protocol.handshake import say_hello_blocking


class RawClient:
    """A connection to a delay server (``host``, ``port``) that said HELLO as
    ``client_name``, over TLS trusting ``tls_ca`` (a CA file) when given.
    ``next_request_id()`` numbers the requests a caller encodes."""

    def __init__(
        self, host: str, port: int, client_name: str, *, tls_ca: str | None = None
    ) -> None:
        self.sock = socket.create_connection((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls_ca is not None:
            context = ssl.create_default_context(cafile=tls_ca)
            self.sock = context.wrap_socket(self.sock, server_hostname=host)
        say_hello_blocking(
            protocol.Connection(protocol.CLIENT),
            self.sock.sendall,
            partial(self.sock.recv, 65536),
            token=None,
            client_name=client_name,
            peer=format_address(host, port),
        )
        self.decoder = protocol.FrameDecoder()
        self._next_id = 2

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.sock.close()

    def next_request_id(self) -> int:
        request_id = self._next_id
        self._next_id += 1
        return request_id

    def receive(self) -> protocol.Event:
        """The next answer. Raises ConnectionError when the server closed."""
        while (frame := self.decoder.next_frame()) is None:
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("server closed the connection")
            self.decoder.feed(data)
        return protocol.decode_event(frame.command, frame.flags, frame.request_id, frame.body)

    def stats(self) -> dict:
        """The server's STATS (replay lag and so on); no other answer may be pending."""
        self.sock.sendall(protocol.encode_event(protocol.Stats(request_id=self.next_request_id())))
        answer = self.receive()
        assert isinstance(answer, protocol.StatsResult), answer
        return answer.stats
