"""Errors as RFC 9457 problem details, and the HTTP status of every refusal.

Every error answer is ``application/problem+json``: ``type`` (a stable URI naming the
kind of problem, ``urn:delayd:problem:<kind>``), ``title``, ``status``, ``detail`` (the
sentence a user can act on, the intake's own words for a refused message), ``code``
(the intake's result code, as the binary protocol names it) and ``retryable``. A
retryable refusal (BUSY, a full disk) carries ``Retry-After``.

Bad input is 400 (not JSON), 413 (too large) or 422 (well-formed JSON that breaks a
rule); never 500.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from delayd.protocol import ResultCode, SendResult

PROBLEM_BASE = "urn:delayd:problem:"  # type URIs name the kind; docs/http.md lists them
MEDIA_TYPE = "application/problem+json"
RETRY_AFTER_S = 1  # a busy server or a full disk: look again in a second

# The HTTP status of each refused result code: the client's fault (422, 413), or the
# server's state, retryable (503 busy, 507 disk full).
_STATUS = {
    ResultCode.INVALID_SUBJECT: HTTPStatus.UNPROCESSABLE_ENTITY,
    ResultCode.EMPTY_ID: HTTPStatus.UNPROCESSABLE_ENTITY,
    ResultCode.INVALID_ID: HTTPStatus.UNPROCESSABLE_ENTITY,
    ResultCode.INVALID_DELAY: HTTPStatus.UNPROCESSABLE_ENTITY,
    ResultCode.DELAY_TOO_LONG: HTTPStatus.UNPROCESSABLE_ENTITY,
    ResultCode.BODY_TOO_LARGE: HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    ResultCode.PROPERTIES_TOO_LARGE: HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    ResultCode.BUSY: HTTPStatus.SERVICE_UNAVAILABLE,
    ResultCode.DISK_FULL: HTTPStatus.INSUFFICIENT_STORAGE,
    ResultCode.INTERNAL: HTTPStatus.SERVICE_UNAVAILABLE,
}


@dataclass(eq=False)
class ProblemError(Exception):
    """Raised by a handler: answered as the problem it describes. ``kind`` names its
    ``type``; ``extra``: members added to the body (RFC 9457 extension members)."""

    status: int
    kind: str
    detail: str
    _: KW_ONLY
    code: str | None = None
    retryable: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__(self.detail)
        if self.retryable:
            self.headers = {**self.headers, "Retry-After": str(RETRY_AFTER_S)}

    def body(self) -> dict[str, Any]:
        return {
            "type": PROBLEM_BASE + self.kind,
            "title": HTTPStatus(self.status).phrase,
            "status": self.status,
            "detail": self.detail,
            "code": self.code,
            "retryable": self.retryable,
            **self.extra,
        }

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        return JSONResponse(self.body(), self.status, headers, media_type=MEDIA_TYPE)


def refusal(result: SendResult) -> ProblemError:
    """The problem for a message the intake refused (not OK, not DUPLICATE)."""
    code = result.code
    status = _STATUS.get(code, HTTPStatus.UNPROCESSABLE_ENTITY)
    kind = code.name.lower().replace("_", "-")
    return ProblemError(status, kind, result.reason, code=code.name, retryable=code.is_retryable)


def bad_input(detail: str, kind: str = "invalid-request") -> ProblemError:
    return ProblemError(HTTPStatus.UNPROCESSABLE_ENTITY, kind, detail)


def _validation_detail(exc: RequestValidationError) -> str:
    """The pydantic errors as one sentence per field: ``body.messages.0.delay: ...``."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error.get("loc", ()))
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "; ".join(parts) or "the request does not match the API (see /openapi.json)"


def install(app: FastAPI) -> None:
    """Answer every error of ``app`` as a problem."""

    @app.exception_handler(ProblemError)
    async def _problem(_: Request, exc: ProblemError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(error.get("type") == "json_invalid" for error in errors):
            detail = "the request body is not valid JSON: " + _validation_detail(exc)
            return ProblemError(HTTPStatus.BAD_REQUEST, "not-json", detail).response()
        if any(tuple(error.get("loc", ())) == ("body",) for error in errors):
            detail = (
                "the request body must be a JSON object, sent with "
                "Content-Type: application/json: " + _validation_detail(exc)
            )
            return ProblemError(HTTPStatus.BAD_REQUEST, "not-json", detail).response()
        return bad_input(_validation_detail(exc)).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = HTTPStatus(exc.status_code).phrase.lower().replace(" ", "-")
        detail = (
            f"{exc.detail}: {request.method} {request.url.path} "
            "(the API is described at /openapi.json)"
        )
        return ProblemError(exc.status_code, kind, detail, headers=exc.headers or {}).response()
