"""One client connection: aiohttp's protocol with the limits of docs/SECURITY.md added.

- ``server.header_timeout_sec``: a request head must be complete this long after its first byte
  (or after the connection opened): a slowloris dribble is closed, like nginx's
  ``client_header_timeout``. ``server.idle_timeout_sec`` is aiohttp's keep-alive timeout.
- the connection counts itself in and out of the ConnectionGate (``server.max_connections``).
- a malformed request (a bad header byte, a bad chunk, a line too long) is answered with the
  JSON 400 and logged as ONE line: peer, reason, request id. aiohttp's own handler logs the
  offending bytes at ERROR with a traceback, an API key or a body included, and echoes them back.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from kilolined.edge.guard import json_error, reason_of
from kilolined.edge.listener import ConnectionGate
from kilolined.wire.expect import waits_for_continue

log = logging.getLogger("kilolined")


class EdgeHandler(RequestHandler):
    __slots__ = ("_gate", "_head_timeout", "_head_timer", "_in_gate")

    def __init__(self, manager: web.Server, *, loop: asyncio.AbstractEventLoop, gate: ConnectionGate | None,
                 header_timeout: float, **kw: Any):
        super().__init__(manager, loop=loop, **kw)
        self._gate = gate
        self._head_timeout = header_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self._in_gate = False

    # --- counting and the head timer -----------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._gate is not None:
            self._in_gate = True
            self._gate.opened()
        self._arm_head_timer()  # a connection that never sends a byte is bounded too

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head_timer()
        if self._in_gate and self._gate is not None:
            self._in_gate = False
            self._gate.closed()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        heads = self._request_count
        super().data_received(data)
        if self._request_count != heads:
            self._cancel_head_timer()  # a whole head arrived
        elif data and self._head_timer is None and not self._request_in_progress and not self._messages:
            self._arm_head_timer()  # the first bytes of a new head (body bytes arrive in progress)

    def _arm_head_timer(self) -> None:
        if self._head_timeout > 0 and self._head_timer is None:
            self._head_timer = self._loop.call_later(self._head_timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._request_in_progress or self._messages:
            return
        # Closed without an answer, as nginx does for client_header_timeout: a client this slow
        # is rarely one that reads a 408.
        log.debug("closing connection from %s: no complete request head in %gs", self._peer(), self._head_timeout)
        self.force_close()

    def _peer(self) -> str:
        peer = self.peername
        return str(peer[0]) if isinstance(peer, tuple) else str(peer or "unknown")

    def no_linger(self) -> None:
        """Close right after the current answer instead of reading what is left of the body for
        up to 10 s first (aiohttp's lingering close): the connection does not outlive it."""
        self._lingering_time = 0.0

    # --- errors aiohttp makes itself ---------------------------------------------------------
    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if isinstance(exc, ConnectionError):
            raise exc  # the client left, or the request was refused by closing: nothing to answer
        if request.writer.output_size > 0:
            raise ConnectionError("the response had begun; no error can be written")
        rid = os.urandom(16).hex()  # a malformed head has no trustworthy X-Request-Id
        if status == 400:
            reason = reason_of(exc) if exc is not None else "malformed request"
            log.warning("malformed request from %s: %s (request %s)", self._peer(), reason, rid)
            text = f"malformed request: {reason}"
        elif status >= 500 and exc is not None:
            log.error("internal error (request %s)", rid, exc_info=exc)
            text = "internal error (logged)"
        else:
            text = "request failed"
        resp = json_error(request, status, text, rid=rid)
        resp.force_close()
        return resp


def settle_expect(request: web.BaseRequest, resp: web.StreamResponse) -> None:
    """An answer given while the client still waits for ``100 Continue`` (refused before its body
    was wanted: kilolined/wire/expect.py): the connection closes after it, at once. The client may
    send the body now or not, and the next request could not be told apart from it."""
    if not resp.prepared and waits_for_continue(request):
        resp.force_close()
        proto = request.protocol
        if isinstance(proto, EdgeHandler):
            proto.no_linger()
