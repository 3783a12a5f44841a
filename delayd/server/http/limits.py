"""The request body limit, before any JSON is parsed.

An ASGI middleware: a body longer than ``max_bytes`` (by its Content-Length, or as it
streams in, chunked) is answered 413 with a problem, and its rest is not read into
memory. A body within the limit is read whole, then handed to the app. The limit is
the intake's largest record with room for base64 and JSON escapes
(``body_limit_bytes``), so every message the intake would take fits.
"""

from __future__ import annotations

from typing import Any

from delayd.server.http.problems import ProblemError

Scope = dict[str, Any]
Message = dict[str, Any]
MAX_BATCH_OVERHEAD_BYTES = 1024 * 1024  # a batch's JSON around its messages' bodies


def body_limit_bytes(max_record_bytes: int) -> int:
    """A request may be this long: one record in base64 (4/3) with JSON escapes, plus
    the batch's room."""
    return max_record_bytes * 2 + MAX_BATCH_OVERHEAD_BYTES


class BodyLimit:
    """Wraps an ASGI app; see the module docstring."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _problem(self) -> ProblemError:
        return ProblemError(
            413,
            "request-too-large",
            f"the request body is over {self.max_bytes:,} bytes; send fewer or smaller "
            "messages (one batch per request, bodies within [intake] max_body_bytes)",
        )

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._problem().response()(scope, receive, send)
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._problem().response()(scope, receive, send)
                return
            more = message.get("more_body", False)
        whole: Message = {"type": "http.request", "body": bytes(body), "more_body": False}
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if delivered:
                return await receive()  # what follows: a disconnect
            delivered = True
            return whole

        await self.app(scope, replay, send)
