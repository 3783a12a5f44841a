"""A small async client for etcd v3 over its HTTP/JSON gateway, for trio.

etcd serves every v3 RPC as ``POST /v3/<service>/<method>`` with a JSON body (the
grpc-gateway every etcd server runs on its client URL): bytes are base64, 64-bit
integers are strings, and fields equal to their default are left out (so a txn that
failed has no ``succeeded`` at all). Streaming RPCs answer one JSON object per line.
That is all a group member needs (leases, a transaction, a watch), so this module speaks
it with httpx (which runs on trio through anyio) instead of pulling in gRPC.

Keys and values are ``bytes``; ``str`` arguments are encoded as UTF-8.

Endpoints are tried in order, starting with the last one that answered; a request moves
on to the next one only when it could not *connect*, since then etcd never saw it. A
request that reached etcd and lost its answer (read timeout, dropped connection, etcd's
own "no leader" / "timed out") raises ``EtcdUnavailable`` with ``outcome_unknown`` set:
retrying a write elsewhere could apply it twice, so the caller reads and decides.
"""

from __future__ import annotations

import base64
import enum
import json
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import httpx
import trio

from delayd.errors import EtcdError, EtcdUnavailable

log = logging.getLogger(__name__)
# httpx logs every request at INFO; a member renews its lease three times per TTL, which
# would bury the lines that matter. Its warnings and errors still come through.
logging.getLogger("httpx").setLevel(logging.WARNING)

# gRPC status codes etcd answers with (google.golang.org/grpc/codes).
GRPC_DEADLINE_EXCEEDED = 4
GRPC_NOT_FOUND = 5  # a lease that expired or was revoked
GRPC_OUT_OF_RANGE = 11  # a revision that was compacted away
GRPC_UNAVAILABLE = 14  # "no leader", "leader changed", server stopping
_UNAVAILABLE_CODES = frozenset({GRPC_DEADLINE_EXCEEDED, GRPC_UNAVAILABLE})

DEFAULT_TIMEOUT_S = 1.0
WATCH_BUFFER = 64  # events a watch holds for a slow reader before it stops reading etcd
WATCH_RETRY_MIN_S = 0.05
WATCH_RETRY_MAX_S = 1.0

# Connecting failed: etcd never saw the request, another endpoint may take it.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)

Key = bytes | str


def _bytes(data: Key) -> bytes:
    return data.encode() if isinstance(data, str) else data


def _b64(data: Key) -> str:
    return base64.b64encode(_bytes(data)).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_range_end(prefix: Key) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``
    (etcd's clientv3.GetPrefixRangeEnd): the prefix with its last byte below 0xff
    incremented; ``b"\\0"`` (every key) when there is none."""
    end = bytearray(_bytes(prefix))
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd stores it. ``create_revision`` is the revision of the write that
    created the key (0 in a delete event), ``lease`` the lease it is attached to (0:
    none)."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_json(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(
            key=_unb64(kv.get("key")),
            value=_unb64(kv.get("value")),
            create_revision=int(kv.get("create_revision", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
            version=int(kv.get("version", 0)),
            lease=int(kv.get("lease", 0)),
        )


@dataclass(frozen=True, slots=True)
class RangeResult:
    """The keys a range found, and the store's revision when it was read."""

    kvs: tuple[KeyValue, ...]
    revision: int


@dataclass(frozen=True, slots=True)
class Lease:
    """A granted lease: its id and its TTL in seconds (etcd counts leases in seconds)."""

    id: int
    ttl_s: int


class EventKind(enum.Enum):
    PUT = "PUT"
    DELETE = "DELETE"


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """A change to a watched key. ``kv.mod_revision`` is the revision of the change."""

    kind: EventKind
    kv: KeyValue


# Transactions: compares, and the operations of each branch.


@dataclass(frozen=True, slots=True)
class Compare:
    """One condition of a txn: ``target`` of ``key`` ``result`` ``operand``.

    Use the constructors: ``Compare.create_revision(key, 0)`` holds when the key does not
    exist, ``Compare.mod_revision(key, r)`` when nothing wrote it since revision ``r``,
    ``Compare.value(key, v)`` when it holds ``v``.
    """

    key: bytes
    target: str  # CREATE, MOD, VALUE, VERSION
    operand: int | bytes
    result: str = "EQUAL"  # EQUAL, NOT_EQUAL, GREATER, LESS

    @classmethod
    def create_revision(cls, key: Key, revision: int, result: str = "EQUAL") -> Compare:
        return cls(_bytes(key), "CREATE", revision, result)

    @classmethod
    def mod_revision(cls, key: Key, revision: int, result: str = "EQUAL") -> Compare:
        return cls(_bytes(key), "MOD", revision, result)

    @classmethod
    def value(cls, key: Key, value: Key, result: str = "EQUAL") -> Compare:
        return cls(_bytes(key), "VALUE", _bytes(value), result)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"key": _b64(self.key), "target": self.target, "result": self.result}
        if self.target == "VALUE":
            assert isinstance(self.operand, bytes)
            body["value"] = _b64(self.operand)
        else:
            field = {"CREATE": "create_revision", "MOD": "mod_revision", "VERSION": "version"}
            body[field[self.target]] = str(self.operand)
        return body


@dataclass(frozen=True, slots=True)
class Put:
    """Write ``value`` at ``key``, attached to ``lease`` (0: no lease)."""

    key: Key
    value: Key
    lease: int = 0

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"key": _b64(self.key), "value": _b64(self.value)}
        if self.lease:
            body["lease"] = str(self.lease)
        return {"request_put": body}


@dataclass(frozen=True, slots=True)
class _OnKeys:
    """An op on ``key``, or with ``prefix`` on every key under it."""

    request: ClassVar[str]  # the op's member in a txn's list of requests
    key: Key
    prefix: bool = False

    def to_json(self) -> dict[str, Any]:
        body = {"key": _b64(self.key)}
        if self.prefix:
            body["range_end"] = _b64(prefix_range_end(self.key))
        return {self.request: body}


@dataclass(frozen=True, slots=True)
class Get(_OnKeys):
    """Read ``key`` (every key under it with ``prefix``)."""

    request: ClassVar[str] = "request_range"


@dataclass(frozen=True, slots=True)
class Delete(_OnKeys):
    """Delete ``key`` (every key under it with ``prefix``)."""

    request: ClassVar[str] = "request_delete_range"


Op = Put | Get | Delete
# What each op answers inside a txn: Get its RangeResult, Delete the number of keys it
# deleted, Put None (the txn's revision is the put's).
OpResult = RangeResult | int | None


@dataclass(frozen=True, slots=True)
class TxnResult:
    """Which branch ran, the revision after the txn (the revision of its writes, if it
    wrote), and one result per op of that branch."""

    succeeded: bool
    revision: int
    responses: tuple[OpResult, ...]


def _range_result(body: dict[str, Any], revision: int) -> RangeResult:
    return RangeResult(tuple(KeyValue.from_json(kv) for kv in body.get("kvs", ())), revision)


def _op_result(response: dict[str, Any], revision: int) -> OpResult:
    if "response_range" in response:
        return _range_result(response["response_range"], revision)
    if "response_delete_range" in response:
        return int(response["response_delete_range"].get("deleted", 0))
    return None


def _revision(body: dict[str, Any]) -> int:
    return int(body.get("header", {}).get("revision", 0))


class EtcdClient:
    """An etcd v3 client on one or more endpoints (``http://host:port`` URLs of the same
    cluster). Use as ``async with EtcdClient([...]) as etcd:`` or call ``aclose()``.

    Every call raises ``EtcdUnavailable`` when no endpoint answers within ``timeout_s``
    (per endpoint tried) and ``EtcdError`` when etcd refuses the request.
    """

    def __init__(self, endpoints: Sequence[str], *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Raises ValueError for an empty endpoint list or one that is not an http URL."""
        if not endpoints:
            raise ValueError("need at least one etcd endpoint, such as http://127.0.0.1:2379")
        for url in endpoints:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"etcd endpoint {url!r} is not a URL; write http://{url}")
        self.endpoints = [url.rstrip("/") for url in endpoints]
        self.timeout_s = timeout_s
        self._preferred = 0  # index of the endpoint that answered last
        # trust_env=False: an HTTP_PROXY meant for the internet must not sit between a
        # member and its etcd.
        self._http = httpx.AsyncClient(trust_env=False, timeout=timeout_s)

    def __repr__(self) -> str:
        return f"<EtcdClient {','.join(self.endpoints)}>"

    async def __aenter__(self) -> EtcdClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def _rotation(self) -> list[int]:
        n = len(self.endpoints)
        return [(self._preferred + i) % n for i in range(n)]

    async def _call(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        """POST ``body`` to ``path`` and return the decoded answer (the first line of a
        streaming RPC's answer)."""
        failures = []
        for index in self._rotation():
            endpoint = self.endpoints[index]
            try:
                response = await self._http.post(endpoint + path, json=body)
            except _NOT_SENT as exc:
                failures.append(f"{endpoint} ({_describe(exc)})")
                continue
            except httpx.TransportError as exc:
                raise EtcdUnavailable(
                    f"etcd {what} at {endpoint}: no answer ({_describe(exc)}); "
                    "it may or may not have been applied",
                    endpoint=endpoint,
                    outcome_unknown=True,
                ) from None
            self._preferred = index
            return _decode(response, endpoint, what)
        raise EtcdUnavailable(
            f"etcd {what}: no endpoint reachable: {', '.join(failures)}",
            endpoint=self.current_endpoint,
        )

    # KV

    async def range(self, key: Key, *, prefix: bool = False) -> RangeResult:
        """The value of ``key``, or of every key under it with ``prefix`` (sorted by key)."""
        op = Get(key, prefix).to_json()["request_range"]
        body = await self._call("/v3/kv/range", op, "range")
        return _range_result(body, _revision(body))

    async def get(self, key: Key) -> KeyValue | None:
        """``key``'s current value, or None when it does not exist."""
        found = await self.range(key)
        return found.kvs[0] if found.kvs else None

    async def put(self, key: Key, value: Key, *, lease: int = 0) -> int:
        """Write ``value`` at ``key`` (attached to ``lease``, 0: none); returns the revision
        of the write. Raises EtcdError (code NOT_FOUND) when the lease no longer exists."""
        body = await self._call(
            "/v3/kv/put", Put(key, value, lease).to_json()["request_put"], "put"
        )
        return _revision(body)

    async def delete(self, key: Key, *, prefix: bool = False) -> int:
        """Delete ``key`` (every key under it with ``prefix``); returns how many went."""
        op = Delete(key, prefix).to_json()["request_delete_range"]
        body = await self._call("/v3/kv/deleterange", op, "delete")
        return int(body.get("deleted", 0))

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """Run ``success`` if every ``compare`` holds, else ``failure``, atomically."""
        body = await self._call(
            "/v3/kv/txn",
            {
                "compare": [c.to_json() for c in compare],
                "success": [op.to_json() for op in success],
                "failure": [op.to_json() for op in failure],
            },
            "txn",
        )
        revision = _revision(body)
        return TxnResult(
            succeeded=bool(body.get("succeeded", False)),
            revision=revision,
            responses=tuple(_op_result(r, revision) for r in body.get("responses", ())),
        )

    # Leases

    async def lease_grant(self, ttl_s: int) -> Lease:
        """A new lease that expires ``ttl_s`` seconds after its last renewal. etcd may
        grant more than asked (it has a minimum TTL), never less."""
        body = await self._call("/v3/lease/grant", {"TTL": str(ttl_s)}, "lease grant")
        return Lease(int(body["ID"]), int(body["TTL"]))

    async def lease_keepalive(self, lease_id: int) -> int:
        """Renew the lease; returns its TTL in seconds, counted from when etcd received
        this request. Raises EtcdError (code NOT_FOUND) when it has expired or was revoked."""
        body = await self._call("/v3/lease/keepalive", {"ID": str(lease_id)}, "lease keepalive")
        ttl_s = int(body.get("result", {}).get("TTL", 0))
        if ttl_s <= 0:
            raise EtcdError(
                f"etcd lease keepalive at {self.current_endpoint}: lease {lease_id:x} not found "
                "(expired or revoked)",
                code=GRPC_NOT_FOUND,
                endpoint=self.current_endpoint,
            )
        return ttl_s

    async def lease_revoke(self, lease_id: int) -> None:
        """End the lease now, deleting every key attached to it. Raises EtcdError (code
        NOT_FOUND) when it had already expired or been revoked."""
        await self._call("/v3/lease/revoke", {"ID": str(lease_id)}, "lease revoke")

    async def lease_time_to_live(self, lease_id: int) -> int:
        """Seconds the lease has left. Raises EtcdError (code NOT_FOUND) when it is gone."""
        body = await self._call("/v3/lease/timetolive", {"ID": str(lease_id)}, "lease timetolive")
        ttl_s = int(body.get("TTL", 0))  # omitted when 0; -1 for an unknown lease
        if ttl_s < 0:
            raise EtcdError(
                f"etcd lease timetolive at {self.current_endpoint}: lease {lease_id:x} not found "
                "(expired or revoked)",
                code=GRPC_NOT_FOUND,
                endpoint=self.current_endpoint,
            )
        return ttl_s

    @property
    def current_endpoint(self) -> str:
        """The endpoint the next request goes to first: the last one that answered."""
        return self.endpoints[self._preferred]

    # Watch

    @asynccontextmanager
    async def watch(
        self, key: Key, *, prefix: bool = False, start_revision: int = 0
    ) -> AsyncIterator[Watch]:
        """Watch ``key`` (every key under it with ``prefix``) from ``start_revision``
        (0: changes after now)::

            async with etcd.watch(key, start_revision=r + 1) as events:
                async for event in events:
                    ...

        A lost connection is retried on the next endpoint with a backoff, resuming after
        the last event delivered, so no event is missed or repeated; it is retried until
        the context exits. Iterating raises EtcdError when etcd ends the watch itself
        (code OUT_OF_RANGE: ``start_revision`` was compacted; read again and watch from
        the revision of that read).
        """
        send, receive = trio.open_memory_channel[WatchEvent](WATCH_BUFFER)
        events = Watch(receive)
        raised: Exception | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._pump_watch, Get(key, prefix), start_revision, send, events)
            try:
                yield events
            except Exception as exc:  # re-raised below as itself, not in an ExceptionGroup
                raised = exc
            finally:
                nursery.cancel_scope.cancel()
        if raised is not None:
            raise raised

    async def _pump_watch(
        self,
        target: Get,
        start_revision: int,
        send: trio.MemorySendChannel[WatchEvent],
        events: Watch,
    ) -> None:
        next_revision = start_revision
        retry_s = WATCH_RETRY_MIN_S
        async with send:
            while True:
                endpoint = self.current_endpoint
                request = dict(target.to_json()["request_range"])
                if next_revision:
                    request["start_revision"] = str(next_revision)
                try:
                    async with self._http.stream(
                        "POST",
                        endpoint + "/v3/watch",
                        json={"create_request": request},
                        timeout=httpx.Timeout(self.timeout_s, read=None),
                    ) as response:
                        if response.status_code != 200:
                            await response.aread()
                            _decode(response, endpoint, "watch")
                        async for line in response.aiter_lines():
                            if not line.strip():
                                continue
                            message = json.loads(line)
                            if "error" in message:
                                _raise_for(message["error"], endpoint, "watch")
                            result = message.get("result", {})
                            if result.get("canceled"):
                                raise _watch_canceled(result, endpoint, next_revision)
                            if result.get("created") and not next_revision:
                                next_revision = _revision(result) + 1
                            for raw in result.get("events", ()):
                                event = WatchEvent(
                                    EventKind(raw.get("type", "PUT")), KeyValue.from_json(raw["kv"])
                                )
                                await send.send(event)
                                next_revision = event.kv.mod_revision + 1
                            retry_s = WATCH_RETRY_MIN_S
                except (httpx.TransportError, EtcdUnavailable) as exc:
                    log.debug("etcd watch at %s lost (%s); retrying", endpoint, _describe(exc))
                    self._preferred = (self._preferred + 1) % len(self.endpoints)
                except EtcdError as exc:
                    events.error = exc
                    return
                except (ValueError, KeyError) as exc:
                    events.error = EtcdError(
                        f"etcd watch at {endpoint}: an answer this client cannot read ({exc!r})",
                        endpoint=endpoint,
                    )
                    return
                await trio.sleep(retry_s)
                retry_s = min(retry_s * 2, WATCH_RETRY_MAX_S)


class Watch:
    """The events of one watch, in revision order (``async for``); see EtcdClient.watch."""

    def __init__(self, receive: trio.MemoryReceiveChannel[WatchEvent]) -> None:
        self._receive = receive
        self.error: EtcdError | None = None  # why etcd ended the watch, once it has

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> WatchEvent:
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            assert self.error is not None  # the pump only stops early on an EtcdError
            raise self.error from None


def _watch_canceled(result: dict[str, Any], endpoint: str, revision: int) -> EtcdError:
    compacted = int(result.get("compact_revision", 0))
    if compacted:
        return EtcdError(
            f"etcd watch from revision {revision}: compacted up to revision {compacted}; "
            "read the key again and watch from the revision of that read",
            code=GRPC_OUT_OF_RANGE,
            endpoint=endpoint,
        )
    reason = result.get("cancel_reason") or "no reason given"
    return EtcdError(f"etcd canceled the watch: {reason}", endpoint=endpoint)


def _decode(response: httpx.Response, endpoint: str, what: str) -> dict[str, Any]:
    """The JSON answer of a successful call; raises EtcdError / EtcdUnavailable for an
    error answer."""
    try:
        body = json.loads(response.text.split("\n", 1)[0] or "{}")
    except ValueError:
        raise EtcdError(
            f"etcd {what} at {endpoint}: HTTP {response.status_code} with a body that is not "
            f"JSON: {response.text[:200]!r}; is this an etcd v3 client URL?",
            endpoint=endpoint,
        ) from None
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):  # streaming RPCs wrap it: {"error": {"code", "message"}}
        _raise_for(error, endpoint, what)
    if error or response.status_code != 200:
        _raise_for(body, endpoint, what, response.status_code)
    return body


def _raise_for(error: dict[str, Any], endpoint: str, what: str, status: int = 0) -> None:
    # A unary call's error has "code"; a stream's (watch, keepalive) has "grpc_code".
    code = error.get("code", error.get("grpc_code"))
    message = error.get("message") or error.get("error") or f"HTTP {status}"
    if code in _UNAVAILABLE_CODES:
        raise EtcdUnavailable(
            f"etcd {what} at {endpoint}: {message}; it may or may not have been applied",
            endpoint=endpoint,
            outcome_unknown=True,
        )
    raise EtcdError(f"etcd {what} at {endpoint}: {message}", code=code, endpoint=endpoint)


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
