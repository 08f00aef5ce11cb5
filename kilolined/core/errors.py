"""The gateway's own error responses (docs/API.md#errors): always JSON, never a node address.

Two shapes: the gateway's own (OpenAI's ``{"error": {…}}``, with ``code``/``param`` added on
openai routes), and Anthropic's ``{"type": "error", "error": {"type", "message"}}`` for a
client of an Anthropic Messages path, whose SDK raises only errors it recognises.
"""

from __future__ import annotations

import math
import os

import orjson
from aiohttp import web

REASONS = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    413: "payload_too_large",
    425: "not_ready",
    502: "upstream_error",
    504: "upstream_timeout",
}


def error_body(type_: str, message: str, request_id: str, retry_after: float | None,
               openai: bool = False, param: str | None = None) -> dict[str, object]:
    err: dict[str, object] = {
        "type": type_,
        "message": message,
        "request_id": request_id,
        "retry_after_sec": None if retry_after is None else int(max(1, math.ceil(retry_after))),
    }
    if openai:
        # OpenAI SDKs read error.code / error.param; the extra keys are harmless to ours.
        err["code"] = type_
        err["param"] = param  # the request field at fault, where one is
    return {"error": err}


def error_response(status: int, type_: str, message: str, *, request_id: str | None = None,
                   retry_after: float | None = None, headers: dict[str, str] | None = None,
                   openai: bool = False, param: str | None = None) -> web.Response:
    h = dict(headers or {})
    if not request_id:
        request_id = os.urandom(16).hex()  # every error carries one (callers pass the request's own)
    if retry_after is not None:
        h["Retry-After"] = str(int(max(1, math.ceil(retry_after))))
    h["X-Request-Id"] = request_id
    if status == 401:
        h["WWW-Authenticate"] = 'Bearer realm="kiloline"'
    return web.Response(
        status=status,
        body=orjson.dumps(error_body(type_, message, request_id, retry_after, openai, param)),
        content_type="application/json",
        headers=h,
    )


#: Anthropic's error type per HTTP status (its API's errors page). Anthropic itself never answers
#: 503; the gateway's 503s (queue full or timed out, shutting down) are ``overloaded_error``, as
#: LiteLLM maps a 503 and as Anthropic names its own 529 "overloaded".
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_type(status: int) -> str:
    """Anthropic's error type for ``status``; a status it has no name for is ``api_error`` (5xx)
    or ``invalid_request_error`` (4xx: 422 exceeds_capacity, 425 not_ready)."""
    return ANTHROPIC_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def anthropic_error_body(status: int, type_: str, message: str, request_id: str | None,
                         retry_after: float | None) -> dict[str, object]:
    """Anthropic's error shape; the gateway's own type (``queue_timeout``, ``budget_exhausted``…)
    stays in ``error.code``, and ``request_id`` is at the top level, where Anthropic puts it."""
    return {"type": "error",
            "error": {"type": anthropic_type(status), "message": message, "code": type_,
                      "retry_after_sec": None if retry_after is None else int(max(1, math.ceil(retry_after)))},
            "request_id": request_id}


def anthropic_error_response(status: int, type_: str, message: str, *, request_id: str,
                             retry_after: float | None = None, headers: dict[str, str] | None = None) -> web.Response:
    """``error_response``'s status and headers (Retry-After, X-Request-Id, WWW-Authenticate) with
    Anthropic's body."""
    resp = error_response(status, type_, message, request_id=request_id, retry_after=retry_after, headers=headers)
    resp.body = orjson.dumps(anthropic_error_body(status, type_, message, request_id, retry_after))
    return resp
