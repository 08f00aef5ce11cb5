"""The gateway's own error responses (docs/API.md#errors): always JSON, never a node address."""

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
               openai: bool = False) -> dict[str, object]:
    err: dict[str, object] = {
        "type": type_,
        "message": message,
        "request_id": request_id,
        "retry_after_sec": None if retry_after is None else int(max(1, math.ceil(retry_after))),
    }
    if openai:
        # OpenAI SDKs read error.code / error.param; the extra keys are harmless to ours.
        err["code"] = type_
        err["param"] = None
    return {"error": err}


def error_response(status: int, type_: str, message: str, *, request_id: str | None = None,
                   retry_after: float | None = None, headers: dict[str, str] | None = None,
                   openai: bool = False) -> web.Response:
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
        body=orjson.dumps(error_body(type_, message, request_id, retry_after, openai)),
        content_type="application/json",
        headers=h,
    )
