"""Errors as HTTP answers, in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}``.

This is the one place where runtime errors become status codes:

=========================================  ======  ==========================
error                                      status  type / code
=========================================  ======  ==========================
InvalidRequest (bad parameter, ``param``)  400     invalid_request_error
UnknownModel                               404     invalid_request_error / model_not_found
BodyTooLarge, PayloadTooLarge              413     invalid_request_error / request_too_large
BodyTimeout                                408     invalid_request_error / request_timeout
Overloaded                                 429     rate_limit_error / overloaded (Retry-After)
NoInstances, worker lost after migrations  503     service_unavailable (Retry-After)
anything else                              500     internal_error (logged with its traceback)
=========================================  ======  ==========================
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from runtime import (
    InstanceGone,
    InstanceTimeout,
    InvalidRequest,
    NoInstances,
    Overloaded,
    PayloadTooLarge,
    RemoteError,
    ShuttingDown,
)

from .models import UnknownModel
from .responses import encode_json
from .tokenizer import TokenizerLoadError

log = logging.getLogger(__name__)


class BodyTooLarge(Exception):
    """The HTTP request body exceeds the configured limit."""

    def __init__(self, limit: int):
        self.limit = limit
        super().__init__(f"the request body exceeds the limit of {limit} bytes")


class BodyTimeout(Exception):
    """The client did not send its whole request body within the configured time."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        super().__init__(f"the request body did not arrive within {seconds:g} s")


@dataclass(frozen=True)
class HttpError:
    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(encode_json(self.body()), self.status, self.headers, media_type="application/json")


def to_http(exc: BaseException, retry_after: int = 1) -> HttpError:
    """The HTTP answer for ``exc``."""
    retry = {"Retry-After": str(retry_after)}
    if isinstance(exc, InvalidRequest):
        return HttpError(400, str(exc), "invalid_request_error", exc.field or None)
    if isinstance(exc, UnknownModel):
        return HttpError(404, str(exc), "invalid_request_error", "model", "model_not_found")
    if isinstance(exc, BodyTimeout):
        return HttpError(408, str(exc), "invalid_request_error", None, "request_timeout")
    if isinstance(exc, (BodyTooLarge, PayloadTooLarge)):
        return HttpError(413, str(exc), "invalid_request_error", None, "request_too_large")
    if isinstance(exc, Overloaded):
        return HttpError(429, f"the server is overloaded: {exc}", "rate_limit_error", None, "overloaded", retry)
    if isinstance(exc, NoInstances):
        return HttpError(503, f"no worker is available: {exc}", "service_unavailable", None, "no_workers", retry)
    if isinstance(exc, (InstanceGone, InstanceTimeout, ShuttingDown)):
        return HttpError(503, f"the request lost its worker: {exc}", "service_unavailable", None, "worker_lost", retry)
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return HttpError(503, "the model's tokenizer is still loading", "service_unavailable", None, "loading", retry)
    if isinstance(exc, TokenizerLoadError):
        return HttpError(500, str(exc), "internal_error", None, "tokenizer_unavailable")
    if isinstance(exc, RemoteError):
        return HttpError(500, f"the worker failed: {exc}", "internal_error", None, exc.kind)
    return HttpError(500, "internal server error", "internal_error")


def install(app: FastAPI, retry_after: int) -> None:
    """Make every error the app can produce an OpenAI-format JSON answer."""

    async def on_validation(_request: Request, exc: RequestValidationError) -> Response:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        return HttpError(400, f"invalid value for '{param}': {err.get('msg')}", "invalid_request_error", param).response()

    async def on_http(_request: Request, exc: StarletteHTTPException) -> Response:
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return HttpError(exc.status_code, str(exc.detail), kind, None, None, dict(exc.headers or {})).response()

    async def on_error(request: Request, exc: Exception) -> Response:
        err = to_http(exc, retry_after)
        if err.status >= 500 and err.type == "internal_error":
            log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return err.response()

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_error)
