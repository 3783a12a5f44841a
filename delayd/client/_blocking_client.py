"""BlockingClient: what the blocking Producer and Consumer have in common."""

from __future__ import annotations

import threading
from typing import Self

from delayd.client._backoff import Backoff
from delayd.client._blocking_session import BlockingSession
from delayd.errors import ConnectionClosedError
from delayd.tls import ClientTls


class BlockingClient:
    """A session to the server at ``addr``, a lock under which calls from several
    threads take turns, a back-off for BUSY answers, and the open/closed state.

    Subclasses define ``connect()`` and ``close()``; ``with`` calls both.
    """

    listener = "intake"  # a member's address etcd:// resolves to (SessionBase)

    def __init__(
        self,
        addr: str,
        token: str | None,
        client_name: str,
        timeout_s: float,
        retry: bool,
        tls: ClientTls | None = None,
    ) -> None:
        """``retry``: whether a first connection that cannot be made is retried
        (SessionBase.retry_first_connect); ``tls``: connect over TLS (SessionBase)."""
        self._session = BlockingSession(
            addr, token=token, client_name=client_name, listener=self.listener, tls=tls
        )
        self._session.retry_first_connect = retry
        self.addr = addr
        self.timeout_s = timeout_s
        self._busy_backoff = Backoff(initial_s=0.01, max_s=1.0)
        self._lock = threading.Lock()
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectionClosedError(f"the {type(self).__name__.lower()} is closed")

    def connect(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.connect()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
