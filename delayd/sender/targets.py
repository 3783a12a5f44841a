"""Where the sender delivers a batch: the embedded broker, or a broker process.

Both kinds of target answer a batch the same way — one SendResult per message, in
order, refusals included — and fail the same way: TargetUnavailable, the group could
not take the batch now. They do not retry and do not back off: the sender's circuit
breaker and retry policy decide what happens next, with all groups in view. Sending a
batch again, to the same group or another, is safe: a broker answers DUPLICATE for an
id it has already stored.

RemoteTarget speaks the protocol itself, on trio, over the sans-I/O
``delayd.protocol.Connection``. It does not use the client library's producer because
that one reconnects and retries inside the call until its time-out, which would hide a
dead broker from the circuit breaker for seconds per batch, and because the client
library brings anyio, which the servers do without.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Protocol

import trio

from delayd.address import Address, parse_address
from delayd.errors import DelaydError, LocalProtocolError, NotLeaderError, ProtocolError
from delayd.protocol import (
    CLIENT,
    Connection,
    EncodedMessages,
    Error,
    ErrorCode,
    Message,
    Response,
    ResultCode,
    SendBatch,
    SendBatchResult,
    SendResult,
)
from delayd.protocol.answers import route_answers
from delayd.protocol.handshake import say_hello
from delayd.protocol.redirect import leader_in
from delayd.tls import ClientTls, handshake_failure, transport_of
from delayd.version import __version__

if TYPE_CHECKING:
    from delayd.broker import Broker

CLIENT_NAME = f"delayd-sender/{__version__}"
RECEIVE_BYTES = 256 * 1024
# What a broken or closed connection raises: from the socket (OSError while
# connecting), from trio's stream, and from the Connection when the bytes make no sense.
_LINK_ERRORS = (OSError, trio.BrokenResourceError, trio.ClosedResourceError, ProtocolError)


class TargetUnavailable(DelaydError):
    """The broker group could not take the batch: no connection (refused, lost, timed
    out), the HELLO refused (a wrong token), or the whole request refused (busy,
    shutting down, failing). The message names the group, the address and the cause.

    The batch may or may not have been stored: send it again, here or elsewhere.
    ``nothing_stored``: it was certainly not (no connection, refused as a whole, not
    the leader), so sending it elsewhere cannot store it twice.
    """

    def __init__(self, message: str, *, nothing_stored: bool = False) -> None:
        super().__init__(message)
        self.nothing_stored = nothing_stored


class NotLeaderTarget(TargetUnavailable):
    """The broker is a member of a group that does not lead it (ERROR NOT_LEADER):
    nothing was stored; ``leader`` is the leader's address, or None when unknown."""

    def __init__(self, message: str, leader: str | None) -> None:
        super().__init__(message, nothing_stored=True)
        self.leader = leader


class SendTarget(Protocol):
    """A broker group as the sender sees it."""

    name: str

    async def send_batch(self, messages: Sequence[Message]) -> list[SendResult]:
        """Store ``messages``: one result per message, in order (OK and DUPLICATE mean
        stored). Raises TargetUnavailable when the group cannot take the batch now."""
        ...

    async def aclose(self) -> None:
        """Release the connection; send_batch is not called afterwards."""
        ...


class EmbeddedTarget:
    """The broker running in this process (``delayd serve`` without broker groups).

    Calls Broker.send_batch (or, from the sender, Broker.send_encoded) directly: no
    socket, no decoding. It raises what that raises — a StorageError means the broker's
    commitlog failed and the process cannot go on, which is not a group being
    unavailable. The broker belongs to whoever opened it;
    ``aclose`` leaves it open.
    """

    def __init__(self, name: str, broker: Broker) -> None:
        self.name = name
        self.broker = broker

    def __repr__(self) -> str:
        return f"<EmbeddedTarget {self.name}>"

    async def send_batch(self, messages: Sequence[Message]) -> list[SendResult]:
        if not messages:
            return []
        with self._not_leader_as_unavailable():
            return await self.broker.send_batch(messages)

    @contextlib.contextmanager
    def _not_leader_as_unavailable(self) -> Iterator[None]:
        """A member that stopped leading before its group had the batch: not stored as
        far as the sender knows (no dispatch_log entry); the new leader delivers it."""
        try:
            yield
        except NotLeaderError as exc:
            raise NotLeaderTarget(f"broker group {self.name}: {exc.reason}", None) from None

    async def send_encoded(self, encoded: EncodedMessages) -> list[SendResult]:
        """send_batch of messages in their wire encoding (the sender's fast path: no
        Message is built on either side; Broker.send_encoded)."""
        if not len(encoded):
            return []
        with self._not_leader_as_unavailable():
            return await self.broker.send_encoded(encoded)

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


class RemoteTarget:
    """A broker group of one or more broker processes, reached over TCP.

    Holds one connection, opened on the first call and again on the first call after it
    failed. ``addresses`` (``"host:port"``, ``"[v6]:port"``) are tried in order,
    starting with the one that worked last, each for at most ``connect_timeout_s``
    (TCP connect, the TLS handshake when ``tls`` is given, and HELLO). ``timeout_s``
    bounds a whole ``send_batch``, connecting included; a request not answered by then
    ends the connection, since its outcome and the stream's state are unknown.
    Concurrent calls share the connection, their frames pipelined, so the broker's
    group commit acknowledges them together.

    A batch too large for one frame is split in halves until each part fits; a single
    message too large for a frame comes back refused (BODY_TOO_LARGE), not raised.

    When ``addresses`` are the members of a replicated broker group, a member that does
    not lead answers NOT_LEADER naming the leader: the batch goes there at once (the
    leader joins the addresses when it is not one of them), within the same time-out.
    Raises ValueError for a malformed address, no address, or a time-out <= 0.
    """

    def __init__(
        self,
        name: str,
        addresses: Sequence[str],
        *,
        token: str | None = None,
        tls: ClientTls | None = None,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 1.0,
    ) -> None:
        if isinstance(addresses, str) or not addresses:
            raise ValueError(f"broker group {name!r}: give a list of one or more addresses")
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("timeout_s and connect_timeout_s must be positive (seconds)")
        self.name = name
        self.addresses: tuple[str, ...] = tuple(addresses)
        try:
            self._endpoints = [parse_address(address) for address in self.addresses]
        except ValueError as exc:
            raise ValueError(f"broker group {name!r}: {exc}") from None
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._token = token
        self._tls = tls
        self._current = 0  # index of the address that worked last: tried first
        self._link: _Link | None = None
        self._connecting = trio.Lock()
        self._closed = False
        self.connects = 0  # connections opened (statistics, tests)

    def __repr__(self) -> str:
        return f"<RemoteTarget {self.name} {self.address}>"

    @property
    def address(self) -> str:
        """The address connected to, or to be tried first."""
        return self.addresses[self._current]

    async def send_batch(self, messages: Sequence[Message]) -> list[SendResult]:
        """See SendTarget.send_batch. Raises trio.ClosedResourceError after aclose."""
        if self._closed:
            raise trio.ClosedResourceError(f"target {self.name} is closed")
        if not messages:
            return []
        link = None
        try:
            with trio.fail_after(self.timeout_s):
                for _ in range(len(self.addresses) + 1):
                    link = await self._connected()
                    try:
                        return await self._send(link, list(messages))
                    except NotLeaderTarget as exc:
                        link.fail("was left: not the leader")
                        if not self._follow(exc.leader):
                            raise
                raise TargetUnavailable(
                    f"broker group {self.name}: no member of {', '.join(self.addresses)} leads",
                    nothing_stored=True,
                )
        except trio.TooSlowError:
            where = link.address if link is not None else " or ".join(self.addresses)
            raise TargetUnavailable(
                f"broker group {self.name}: no answer from {where} within {self.timeout_s} s"
            ) from None

    def update_members(self, addresses: Sequence[str]) -> None:
        """The group's members as etcd now lists them, the leader first
        (delayd.sender.discovery): the next connection tries them in that order; an
        open connection is kept (a member that no longer leads answers NOT_LEADER,
        which is followed). Raises ValueError for a malformed address, keeping the
        members it had."""
        if isinstance(addresses, str) or not addresses or tuple(addresses) == self.addresses:
            return
        try:
            endpoints = [parse_address(address) for address in addresses]
        except ValueError as exc:
            raise ValueError(f"broker group {self.name!r}: {exc}") from None
        self.addresses, self._endpoints, self._current = tuple(addresses), endpoints, 0

    def _follow(self, leader: str | None) -> bool:
        """Make ``leader`` the address tried next; False when it names none (the
        circuit breaker and retry policy take it from there)."""
        if leader is None:
            return False
        if leader not in self.addresses:
            try:
                endpoint = parse_address(leader)
            except ValueError:
                return False
            self.addresses = (*self.addresses, leader)
            self._endpoints.append(endpoint)
        self._current = self.addresses.index(leader)
        return True

    async def _send(self, link: _Link, messages: list[Message]) -> list[SendResult]:
        try:
            return await link.send_batch(messages)
        except LocalProtocolError as exc:
            # Too large for one frame (or, for a single message, not encodable at all):
            # nothing was sent. Halves go one after the other, which is rare enough.
            if len(messages) == 1:
                reason = f"cannot be sent to {link.address}: {exc}"
                return [SendResult(ResultCode.BODY_TOO_LARGE, reason)]
        half = len(messages) // 2
        return await self._send(link, messages[:half]) + await self._send(link, messages[half:])

    async def _connected(self) -> _Link:
        link = self._link
        if link is not None and link.failure is None:
            return link
        async with self._connecting:
            link = self._link  # perhaps connected while this call waited for the lock
            if link is not None and link.failure is None:
                return link
            problems: list[str] = []
            # A snapshot: update_members may replace the lists while this connects.
            addresses, endpoints = self.addresses, list(self._endpoints)
            count = len(addresses)
            for step in range(count):
                index = (self._current + step) % count
                address = addresses[index]
                endpoint = endpoints[index]
                with trio.move_on_after(self.connect_timeout_s):
                    try:
                        link = await _Link.open(
                            self.name, address, endpoint, self._token, self._tls
                        )
                    except (*_LINK_ERRORS, DelaydError) as exc:
                        problems.append(f"{address}: {_why(exc, address)}")
                        continue
                    if self._closed:  # aclose() ran while this connected
                        link.fail("was closed by the sender")
                        raise trio.ClosedResourceError(f"target {self.name} is closed")
                    self._link = link
                    if address in self.addresses:
                        self._current = self.addresses.index(address)
                    self.connects += 1
                    return link
                problems.append(f"{address}: no HELLO_OK within {self.connect_timeout_s} s")
            raise TargetUnavailable(
                f"broker group {self.name}: " + "; ".join(problems), nothing_stored=True
            )

    async def aclose(self) -> None:
        """Close the connection (idempotent); later calls raise ClosedResourceError."""
        self._closed = True
        if self._link is not None:
            self._link.fail("was closed by the sender")
        await trio.lowlevel.checkpoint()


def _why(exc: BaseException, address: str) -> str:
    """``exc`` in words; a trio stream error says nothing itself, but the TLS error
    behind it does (the broker refused the sender's certificate)."""
    if isinstance(exc.__cause__, ssl.SSLError):
        return str(handshake_failure(exc.__cause__, address))
    return str(exc) or type(exc).__name__


async def _connect(endpoint: Address, tls: ClientTls | None) -> trio.abc.Stream:
    """A TCP stream to ``endpoint``, with the TLS handshake done when ``tls`` is given.
    Raises OSError, a trio stream error, or TargetUnavailable for a refused handshake."""
    host, port = endpoint
    tcp = await trio.open_tcp_stream(host, port)  # TCP_NODELAY is trio's default
    if tls is None:
        return tcp
    server_name = tls.server_name or host
    # https_compatible: a broker's close without close_notify is EOF (delayd.tls).
    context = tls.ssl_context
    stream = trio.SSLStream(tcp, context, server_hostname=server_name, https_compatible=True)
    try:
        await stream.do_handshake()
    except trio.BrokenResourceError as exc:
        tcp.socket.close()
        if isinstance(exc.__cause__, ssl.SSLError):
            failure = handshake_failure(exc.__cause__, str(endpoint))
            raise TargetUnavailable(str(failure)) from None
        raise
    except BaseException:
        tcp.socket.close()
        raise
    return stream


class _Waiter:
    """A request waiting for its answer. ``wake`` is set when the answer came, when the
    link failed, or when the reader's part is free to take."""

    __slots__ = ("response", "wake")

    def __init__(self) -> None:
        self.response: SendBatchResult | Error | None = None
        self.wake = trio.Event()


class _Link:
    """One connection with HELLO done, carrying SEND_BATCH requests, never reused once
    failed (``failure`` says why).

    There is no reader task (a target has no nursery of its own): the requests waiting
    for answers take turns reading. One of them reads and hands each answer to its
    waiter; when its own answer has come it stops and wakes the others, and one of them
    reads on. Requests are cancellation-unsafe halfway (a frame half written, an
    answer that will arrive for nobody), so a cancelled request ends the link.
    """

    def __init__(self, group: str, address: str, stream: trio.abc.Stream, conn: Connection) -> None:
        self.group = group
        self.address = address
        self._stream = stream
        self._socket = transport_of(stream).socket  # type: ignore[attr-defined]
        self._conn = conn
        self._waiters: dict[int, _Waiter] = {}  # by request id
        self._writing = trio.StrictFIFOLock()  # one frame at a time on the stream
        self._reading = False
        self.failure: str | None = None

    @classmethod
    async def open(
        cls,
        group: str,
        address: str,
        endpoint: Address,
        token: str | None,
        tls: ClientTls | None = None,
    ) -> _Link:
        """Connect (over TLS with ``tls``) and do HELLO (delayd.protocol.handshake).
        Raises OSError or a trio stream error when the connection fails,
        TargetUnavailable when the broker refuses the TLS handshake, and what say_hello
        raises: RejectedError for a wrong token, BusyError for a broker shutting down,
        ConnectionClosedError, ProtocolError for a peer that does not speak the
        protocol."""
        stream = await _connect(endpoint, tls)
        try:
            conn = Connection(CLIENT)
            await say_hello(
                conn,
                stream.send_all,
                partial(stream.receive_some, RECEIVE_BYTES),
                token=token,
                client_name=CLIENT_NAME,
                peer=address,
            )
        except BaseException:
            transport_of(stream).socket.close()  # type: ignore[attr-defined]
            raise
        return cls(group, address, stream, conn)

    def fail(self, reason: str) -> None:
        """End the link: close the socket (a task blocked on it wakes with
        ClosedResourceError) and wake every waiting request."""
        if self.failure is None:
            self.failure = reason
            self._socket.close()
        for waiter in self._waiters.values():
            waiter.wake.set()

    def _unavailable(self) -> TargetUnavailable:
        return TargetUnavailable(
            f"broker group {self.group}: connection to {self.address} {self.failure}"
        )

    async def send_batch(self, messages: list[Message]) -> list[SendResult]:
        """Send one SEND_BATCH and wait for its answer.

        Raises LocalProtocolError, with nothing sent and the link intact, when the
        batch does not fit in a frame the broker accepts; TargetUnavailable when the
        link fails before the answer, or the broker refuses the whole request.
        """
        if self.failure is not None:
            raise self._unavailable()
        request_id = self._conn.next_request_id()
        data = self._conn.send(SendBatch(messages, request_id=request_id))
        waiter = self._waiters[request_id] = _Waiter()
        try:
            async with self._writing:
                await self._stream.send_all(data)
            while waiter.response is None:
                if self.failure is not None:
                    raise self._unavailable()
                if self._reading:
                    waiter.wake = trio.Event()
                    await waiter.wake.wait()
                else:
                    await self._read_until(waiter)
        except _LINK_ERRORS as exc:
            self.fail(f"was lost: {exc!r}")
            raise self._unavailable() from exc
        except BaseException:
            self.fail("was ended: a request on it was cancelled or failed")
            raise
        finally:
            self._waiters.pop(request_id, None)
        response = waiter.response
        if isinstance(response, Error) and response.code is ErrorCode.NOT_LEADER:
            raise NotLeaderTarget(
                f"broker group {self.group}: {self.address}: {response.reason}",
                leader_in(response.reason),
            )
        if isinstance(response, Error):
            raise TargetUnavailable(
                f"broker group {self.group}: {self.address} refused the batch: "
                f"{response.reason} ({response.code.name})",
                nothing_stored=True,
            )
        if len(response.results) != len(messages):
            self.fail(f"was ended: {len(response.results)} results for {len(messages)} messages")
            raise self._unavailable()
        return list(response.results)

    async def _read_until(self, mine: _Waiter) -> None:
        """Read answers, handing each to its waiter, until ``mine`` has one or the link
        ends; then wake the other waiters so that one of them reads on."""
        self._reading = True
        try:
            while mine.response is None:
                self._conn.receive_data(await self._stream.receive_some(RECEIVE_BYTES))
                try:
                    route_answers(self._conn, self._deliver, self.address)
                except DelaydError as exc:  # closed, or an ERROR about the whole connection
                    self.fail(f"was ended: {exc}")
                    return
        finally:
            self._reading = False
            for waiter in self._waiters.values():
                waiter.wake.set()

    def _deliver(self, answer: Response | Error) -> None:
        waiter = self._waiters.pop(answer.request_id, None)
        if waiter is not None:
            waiter.response = answer  # type: ignore[assignment]
            waiter.wake.set()
