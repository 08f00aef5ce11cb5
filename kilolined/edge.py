"""What every request passes on its way in and every answer on its way out, before and after the
pipeline (docs/SECURITY.md):

- the raw-path check (kilolined/paths.py), before routing, for every path the gateway serves;
- HTTP/0.9 refused: the connection is closed, there is no HTTP/0.9 answer to give;
- every error the gateway or aiohttp makes is the JSON of docs/API.md "Errors" — aiohttp's own
  text/plain 413 (a body over ``server.max_body_mb``), 405 and 502 included, and a 500
  ``internal_error`` for a bug, logged with its traceback but never the request's bytes;
- ``Server: kilolined`` on every response, without versions.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from kilolined.errors import REASONS, error_response
from kilolined.paths import path_of_target, path_problem
from kilolined.proxy import request_id

log = logging.getLogger("kilolined")

SERVER = "kilolined"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
_TYPES = {**REASONS, 405: "bad_request", 500: "internal_error", 503: "shutting_down"}
_KEEP_HEADERS = ("Allow", "Retry-After")
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")


def reason_of(exc: BaseException) -> str:
    """A short, safe reason for a log line or an error message: the parser's own sentence, cut
    before the bytes it quotes (aiohttp's messages end in ``b'<the offending line>'``)."""
    text = exc.message if isinstance(exc, HttpProcessingError) else str(exc)
    if not isinstance(text, str):
        text = type(exc).__name__
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    first = first.split(":", 1)[0] if "b'" in text or 'b"' in text else first
    return _UNPRINTABLE.sub("?", first)[:120]


def json_error(request: web.BaseRequest, status: int, message: str, *, rid: str | None = None,
               headers: dict[str, str] | None = None) -> web.Response:
    return error_response(status, _TYPES.get(status, "bad_request" if status < 500 else "internal_error"),
                          message, request_id=rid or request_id(request), headers=headers)


@web.middleware
async def check_path(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.version < (1, 0):
        # An HTTP/0.9 request has no headers and its answer no status line: nothing a proxy or
        # client should rely on. Close without answering.
        tr = request.transport
        if tr is not None:
            tr.abort()
        raise ConnectionResetError("HTTP/0.9 request refused")
    raw = request.raw_path
    problem = path_problem(raw if raw[:1] == "/" and "?" not in raw else path_of_target(raw))
    if problem is not None:
        resp = json_error(request, 400, problem)
        return resp
    return await handler(request)


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise  # a redirect, or an answer that is already ours
        headers = {k: exc.headers[k] for k in _KEEP_HEADERS if k in exc.headers}
        resp = json_error(request, exc.status, exc.reason, headers=headers)
        if exc.status == 413:
            resp.force_close()  # do not drain (up to aiohttp's lingering time) a body we refused
        return resp
    except (HttpProcessingError, RequestPayloadError) as exc:
        # A body that broke HTTP mid-way (a bad chunk): the client's fault, and the connection is
        # out of step, so it is not reused.
        log.warning("malformed request body from %s: %s (request %s)", request.remote, reason_of(exc),
                    request_id(request))
        resp = json_error(request, 400, "malformed request body")
        resp.force_close()
        return resp
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client left: nothing to answer
    except Exception:
        rid = request_id(request)
        # exc_info gives the traceback; the request's bytes, headers and body are never logged.
        log.exception("internal error on %s %s (request %s)", request.method, request.path, rid)
        if request.writer is not None and request.writer.output_size > 0:
            # The answer had begun: there is no honest error to write any more.
            tr = request.transport
            if tr is not None:
                tr.abort()
            raise ConnectionResetError("internal error after the response began") from None
        return json_error(request, 500, "internal error (logged)", rid=rid)


def middlewares() -> list[Middleware]:
    """For ``web.Application(middlewares=...)``: errors outermost, so that a refusal of the path
    check and anything raised after it come out as JSON too."""
    return [json_errors, check_path]


async def server_header(_request: web.BaseRequest, response: web.StreamResponse) -> None:
    """``on_response_prepare`` hook: streamed answers are prepared inside the handler, after any
    middleware could touch them."""
    response.headers["Server"] = SERVER
