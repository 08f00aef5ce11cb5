"""What every request passes on its way in and every answer on its way out, before and after the
pipeline (docs/SECURITY.md):

- the raw-path check (kilolined/core/paths.py), before routing, for every path the gateway serves;
- HTTP/0.9 refused: the connection is closed, there is no HTTP/0.9 answer to give;
- every error the gateway or aiohttp makes is the JSON of docs/API.md "Errors" — aiohttp's own
  text/plain 413 (a body over ``server.max_body_mb``), 405 and 502 included, and a 500
  ``internal_error`` for a bug, logged with its traceback but never the request's bytes;
- ``Server: kilolined`` on every response, without versions.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from kilolined.core.errors import REASONS, error_response
from kilolined.core.paths import path_of_target, path_problem
from kilolined.wire.proxy import SERVER, request_id

log = logging.getLogger("kilolined")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
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
    """An error the edge makes (its own, or aiohttp's turned into JSON), with our Server header."""
    return error_response(status, _TYPES.get(status, "bad_request" if status < 500 else "internal_error"),
                          message, request_id=rid or request_id(request), headers={**(headers or {}), "Server": SERVER})


def refuse(request: web.BaseRequest) -> web.StreamResponse | None:
    """The answer to a request refused before routing (a bad raw path), or None to go on."""
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
        return json_error(request, 400, problem)
    return None


def error_answer(request: web.BaseRequest, exc: Exception) -> web.StreamResponse | None:
    """The JSON answer to what a handler raised, or None when the exception must go on (a
    redirect, an answer that is already ours, a client that left)."""
    if isinstance(exc, web.HTTPException):
        if exc.status < 400 or exc.content_type == "application/json":
            exc.headers["Server"] = SERVER
            return None  # a redirect, or an answer that is already ours
        headers = {k: exc.headers[k] for k in _KEEP_HEADERS if k in exc.headers}
        resp = json_error(request, exc.status, exc.reason, headers=headers)
        if exc.status == 413:
            resp.force_close()  # do not drain (up to aiohttp's lingering time) a body we refused
        return resp
    if isinstance(exc, HttpProcessingError | RequestPayloadError):
        # A body that broke HTTP mid-way (a bad chunk): the client's fault, and the connection is
        # out of step, so it is not reused.
        log.warning("malformed request body from %s: %s (request %s)", request.remote, reason_of(exc),
                    request_id(request))
        resp = json_error(request, 400, "malformed request body")
        resp.force_close()
        return resp
    if isinstance(exc, ConnectionError):
        return None  # the client left: nothing to answer
    rid = request_id(request)
    # exc_info gives the traceback; the request's bytes, headers and body are never logged.
    log.error("internal error on %s %s (request %s)", request.method, request.path, rid, exc_info=exc)
    if request.writer is not None and request.writer.output_size > 0:
        # The answer had begun: there is no honest error to write any more.
        tr = request.transport
        if tr is not None:
            tr.abort()
        raise ConnectionResetError("internal error after the response began") from exc
    return json_error(request, 500, "internal error (logged)", rid=rid)


def guard(handler: Handler) -> Handler:
    """``handler`` behind the edge: the raw-path check first, and whatever it raises answered as
    JSON. One plain wrapper instead of aiohttp middlewares, which would cost three coroutine
    layers per request (the pipeline's handler inlines the same two calls: kilolined/edge/app.py)."""

    async def guarded(request: web.Request) -> web.StreamResponse:
        resp = refuse(request)
        if resp is None:
            try:
                resp = await handler(request)
            except Exception as exc:
                resp = error_answer(request, exc)
                if resp is None:
                    raise
        if not resp.prepared:
            resp.headers["Server"] = SERVER  # a streamed answer set it before its prepare()
        return resp

    return guarded
