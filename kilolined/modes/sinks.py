"""Where a request's answer goes: the sync client modes (API docs: docs/API.md "Client modes").

Each is a ``lease.Sink``: it hears the request's moves, takes the node's answer (``deliver``), a
computed result (``result``) or the failure (``fail``), and owns how each looks to its client.
The job sink lives with the jobs (``jobs.py``).

- ``SyncSink``: the node's answer streams back to the held client connection.
- ``StreamSink``: OpenAI ``"stream": true``. Its 200 goes out only once the request has to wait
  (queued, or the node silent for ``heartbeat_sec``), with keep-alive comments until the node's
  first byte; before that, the node's real status and body pass through as in sync mode.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import aiohttp
import orjson
from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError
from multidict import CIMultiDict

from kilolined.adapters.openai import UsageStripper, gateway_added_usage, relay_tap
from kilolined.core.continuation import StreamKeeper
from kilolined.core.outcome import Failure, Result
from kilolined.core.rewrite import MAX_HELD, ModelRename, aliased
from kilolined.core.verdict import failed_status
from kilolined.modes.call import Call
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.lease import LeaseScope, Sink
from kilolined.scheduling.queue import WAITING, Lease
from kilolined.wire.proxy import (
    SERVER,
    Observer,
    Upstream,
    cut_client,
    mid_response,
    response_headers,
    stream_back,
    whole_answer,
)
from kilolined.wire.upstream import UpstreamResponse


class SyncSink(Sink):
    __slots__ = ("call", "label", "outcome", "response", "rt", "scope")
    mode = "sync"
    reports_progress = False

    def __init__(self, rt: Runtime, call: Call):
        self.rt, self.call = rt, call
        self.label = call.route
        self.response: web.StreamResponse | None = None
        self.outcome = "ok"
        self.scope: LeaseScope | None = None

    # --- listener -----------------------------------------------------------------------------
    def dispatched(self, lease: Lease, queue_wait: float) -> None:
        call = self.call
        if call.node == "-":
            call.queue_wait = queue_wait
            self.rt.metrics.queue_wait.labels(self.label).observe(queue_wait)
        call.node = lease.node
        call.swap = lease.swap  # the access log's swap= (docs/CONFIG.md#multi-model-nodes)

    # --- answers ------------------------------------------------------------------------------
    def headers_for(self, scope: LeaseScope, up: Upstream) -> CIMultiDict[str]:
        call = self.call
        lease_node = call.node
        assert scope.lease is not None
        node_url, rcfg = scope.lease.target.url, scope.lease.target.route
        # A node's redirect comes back through the route: under its path only if the path was cut off.
        headers = response_headers(up, node_url, rcfg.path if rcfg.strips_path else "/")
        headers.update(call.headers)
        headers["X-Request-Id"] = call.request_id
        headers["X-KiloLine-Node"] = lease_node
        headers["X-KiloLine-Queue-Wait-Ms"] = str(int((call.queue_wait or 0.0) * 1000))
        return headers

    async def deliver(self, scope: LeaseScope, up: Upstream, obs: Observer | None,
                      capture: bytearray | None = None) -> None:
        """Copy the node's answer to the client. The slot is freed when the body ends (the scope)."""
        call = self.call
        self.scope = scope
        with _Relaying(self, scope, up, obs) as ok:
            headers = self.headers_for(scope, up)
            rename = self.renamer(scope, sse=False) if call.asked_model is not None else None
            if rename is not None and "json" in up.headers.get("Content-Type", "") and \
                    up.content_length is not None and up.content_length <= MAX_HELD:
                self.response, call.bytes_out = await _renamed(call.request, up, headers, obs, rename)
                scope.size = call.bytes_out
                ok[0] = scope.ok = not failed_status(up.status)
                self.outcome = "ok" if ok[0] else "upstream_error"
                return
            # The usual small answer, whole already, is made here without a coroutine.
            whole = whole_answer(call.request, up, headers, obs, capture)
            self.response, call.bytes_out = (whole if whole is not None else
                                             await stream_back(call.request, up, headers, obs, capture, scope))
            scope.size = call.bytes_out
            ok[0] = scope.ok = not failed_status(up.status)
            self.outcome = "ok" if ok[0] else "upstream_error"

    def renamer(self, scope: LeaseScope, sse: bool) -> ModelRename | None:
        """What puts the client's model name back into the answer, when its node was sent another
        (docs/CONFIG.md#rewriting-requests); None when the node got the client's own name."""
        call = self.call
        asked = call.asked_model
        assert asked is not None and scope.lease is not None
        sent = aliased(scope.lease.target.node.rewrite, call.model)
        return None if sent == asked else ModelRename(asked, sse)

    def _relaying(self, scope: LeaseScope, up: Upstream, obs: Observer | None) -> _Relaying:
        """Around copying the node's answer to the client (every sink's one copy of it): see
        ``_Relaying``. The body sets ``ok[0]`` when the answer ended well."""
        return _Relaying(self, scope, up, obs)

    def result(self, res: Result) -> None:
        self.response = web.Response(status=res.http_status, body=res.body, content_type=res.content_type)

    @property
    def started(self) -> bool:
        r = self.response
        return (self.scope is not None and self.scope.started) or (r is not None and r.prepared)

    async def fail(self, f: Failure) -> web.StreamResponse:
        call = self.call
        if self.started or call.request.transport is None:
            # Bytes went out already: there is no honest error to write; end the connection.
            cut_client(call.request)
            call.status = f.http_status or 502
            raise web.HTTPBadGateway() if f.type != "upstream_timeout" else web.HTTPGatewayTimeout()
        if f.body is not None and f.http_status is not None and not failed_status(f.http_status):
            # A refusal in the backend's own shape (ComfyUI's validation error): the client's API.
            call.status = f.http_status
            return web.Response(status=f.http_status, body=f.body, content_type=f.content_type or "application/json",
                                headers={"X-Request-Id": call.request_id})
        return call.error(f.http_status or 502, f.type, f.message, f.retry_after)


class StreamSink(SyncSink):
    """``"stream": true`` on an openai route (docs/API.md "OpenAI streams")."""

    __slots__ = ("keeper", "stream", "strip", "tick_sec")

    def __init__(self, rt: Runtime, call: Call):
        super().__init__(rt, call)
        self.tick_sec = rt.cfg.server.heartbeat_sec
        self.stream: web.StreamResponse | None = None
        # The usage chunk the gateway asked for on the client's behalf is not the client's.
        ex = call.exchange
        self.strip = UsageStripper() if ex is not None and gateway_added_usage(ex) else None
        #: what went out, kept while the stream may be continued on another node (continuation.py)
        self.keeper: StreamKeeper | None = None

    @property
    def started(self) -> bool:
        return self.stream is not None or super().started

    def keep_stream(self) -> StreamKeeper:
        if self.keeper is None:
            self.keeper = StreamKeeper()
        return self.keeper

    async def begin(self, scope: LeaseScope) -> None:
        """Before the wait: a request that has to queue gets its 200 and a first comment at once."""
        self.scope = scope
        if scope.ticket.state == WAITING:
            await self.tick(True, scope)

    async def _open(self) -> web.StreamResponse:
        call = self.call
        if self.stream is None:
            headers = {**call.headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                       "X-Accel-Buffering": "no", "X-Request-Id": call.request_id, "Server": SERVER}
            if call.node != "-":
                headers["X-KiloLine-Node"] = call.node
            resp = web.StreamResponse(status=200, headers=headers)
            if self.scope is not None:
                self.scope.started = True
            await resp.prepare(call.request)
            self.stream = self.response = resp
            call.status = 200
        return self.stream

    async def tick(self, queued: bool, scope: LeaseScope | None = None) -> None:
        resp = await self._open()
        if queued:
            rt, call = self.rt, self.call
            sched = rt.scheduler
            now = rt.clock()
            ticket = call.ticket
            pos = sched.position(ticket, now) if ticket is not None else None
            est = rt.est_wait(ticket.route, pos or 0, now) if ticket is not None else None
            # JSON spelling (null, not None), as in the sse events.
            note = b"queued position=%s est_wait_sec=%s" % (orjson.dumps(pos), orjson.dumps(est))
            await resp.write(self.keepalive(note))
        else:
            await resp.write(self.keepalive(b"waiting for the node"))

    def keepalive(self, note: bytes) -> bytes:
        """The stream's keep-alive while it waits, saying why: an SSE comment (OpenAI SDKs skip it)."""
        return b": " + note + b"\n\n"

    def error_frame(self, type_: str, message: str, status: int) -> bytes:
        """How an error ends the stream once its 200 went out."""
        return error_event(type_, message, status)

    async def deliver(self, scope: LeaseScope, up: Upstream, obs: Observer | None,
                      capture: bytearray | None = None) -> None:
        is_stream = up.status == 200 and "text/event-stream" in up.headers.get("Content-Type", "")
        if self.stream is None and not is_stream:
            # The node answered before the request had to wait: its own status and body.
            return await super().deliver(scope, up, obs, capture)
        call = self.call
        self.scope = scope
        resp = await self._open()
        with self._relaying(scope, up, obs) as ok:
            if up.status != 200 or "text/event-stream" not in up.headers.get("Content-Type", ""):
                body = await up.read()
                if up.status == 200:
                    # A node that ignored "stream": pass its JSON through as one data line.
                    if obs is not None:
                        obs.feed(body)
                    if call.asked_model is not None and (rename := self.renamer(scope, sse=False)) is not None:
                        body = rename.rename(body)
                    await _write(scope, resp, b"data: " + body.strip() + b"\n\ndata: [DONE]\n\n")
                    ok[0] = True
                else:
                    message, type_ = node_message(body, up.status)
                    await _write(scope, resp, self.error_frame(type_, message, up.status))
                    call.status = up.status  # the access log tells what the client really got
                    ok[0] = not failed_status(up.status)
                    self.outcome = "ok" if ok[0] else "upstream_error"
            else:
                await self._relay(scope, resp, up, obs)
                ok[0] = True
            scope.size = call.bytes_out
            scope.ok = ok[0]
            if not ok[0]:
                self.outcome = "upstream_error"
        await resp.write_eof()

    async def _relay(self, scope: LeaseScope, resp: web.StreamResponse, up: Upstream, obs: Observer | None) -> None:
        """The node's event stream to the client: every piece seen by ``obs``, the usage chunk the
        gateway asked for cut out. Through aiohttp's writer until the response head has gone
        out with a piece; then, on our own client (chunked, uncompressed), each piece is written
        from the node connection's callback (``UpstreamResponse.relay``)."""
        call, strip, keeper = self.call, self.strip, self.keeper
        # The client's model name in every event, when its node was sent another: off (None) on
        # every stream whose route renames nothing, so the per-token path stays as it was.
        # After the keeper: the seam's chunks take the first node's name, then the client's.
        rename = self.renamer(scope, sse=True) if call.asked_model is not None else None
        request = call.request
        writer = request.writer
        direct = (isinstance(up, UpstreamResponse) and getattr(writer, "chunked", False) is True
                  and not resp.compression and writer.length is None)
        content = up.content
        while chunk := await content.readany():
            if obs is not None:
                obs.feed(chunk)
            out = strip.feed(chunk) if strip is not None else chunk
            if keeper is not None:
                out = keeper.feed(out)  # whole events only, and through the seam after one
            if rename is not None:
                out = rename.feed(out)
            if out:
                # _write's flag inline: one coroutine less per relayed chunk
                scope.writing = True
                try:
                    await resp.write(out)
                finally:
                    scope.writing = False
                call.bytes_out += len(out)
                if direct:
                    break  # the head is out: the rest goes from the node's callback
        else:
            direct = False  # the body ended
        if direct:
            assert isinstance(up, UpstreamResponse)
            proto = request.protocol
            tr = proto.transport
            if tr is None:
                raise ClientConnectionResetError("Cannot write to closing transport")  # as aiohttp's writer
            tap = relay_tap(obs, strip)
            if keeper is not None:
                tap = _kept(tap, keeper)
            if rename is not None:
                tap = rename.after(tap)

            def push(data: bytes) -> bool:
                # The per-token path: the observer and the usage cut in one call, one write.
                out = tap(data)
                if not out:
                    return False
                if tr.is_closing():
                    raise ClientConnectionResetError("Cannot write to closing transport")  # as aiohttp's writer
                n = len(out)
                tr.write(b"%x\r\n%s\r\n" % (n, out))  # one chunk of the chunked body
                call.bytes_out += n
                # The client's socket buffer is full: wait for it. The transport sends at once
                # when it can, so an empty buffer (the C call) says no without the property's.
                return tr.get_write_buffer_size() != 0 and proto.writing_paused

            async def drain() -> None:
                scope.writing = True  # waiting on the client: a deadline now is its doing
                try:
                    await writer.drain()
                finally:
                    scope.writing = False

            await up.relay(push, drain)
        rest = strip.flush() if strip is not None else b""
        if keeper is not None:
            rest = keeper.feed(rest) + keeper.flush()
        if rename is not None:
            rest = rename.feed(rest) + rename.flush()
        if rest:
            await _write(scope, resp, rest)
            call.bytes_out += len(rest)

    async def fail(self, f: Failure) -> web.StreamResponse:
        if self.stream is None:
            return await super().fail(f)
        self.call.status = f.http_status or 502  # the 200 went out; the log tells the truth
        try:
            await self.stream.write(self.error_frame(f.type, f.message, f.http_status or 502))
            await self.stream.write_eof()
        except (ConnectionError, RuntimeError):
            pass
        return self.stream


def _kept(tap: Callable[[bytes], bytes], keeper: StreamKeeper) -> Callable[[bytes], bytes]:
    """``tap``, then ``keeper`` (a stream that may be continued: whole events, the seam)."""

    def kept(data: bytes) -> bytes:
        return keeper.feed(tap(data))

    return kept


async def _renamed(request: web.Request, up: Upstream, headers: CIMultiDict[str], obs: Observer | None,
                   rename: ModelRename) -> tuple[web.Response, int]:
    """A JSON answer of a known length up to MAX_HELD, read whole, with the client's model name
    put back (a longer one, or one of unknown length, streams as it came)."""
    body = await up.read()
    if obs is not None:
        obs.feed(body)
    body = rename.rename(body)
    headers["Server"] = SERVER
    return web.Response(status=up.status, reason=up.reason, headers=headers, body=body), len(body)


class _Relaying:
    """``with _Relaying(sink, scope, up, obs) as ok:`` around copying the node's answer to the
    client: a client gone, a node failing mid-body, and the node connection and observer closed
    whatever happened. A class, not a generator context manager: it runs once per request, and
    contextlib's generator machinery costs twice its own work."""

    __slots__ = ("obs", "ok", "scope", "sink", "up")

    def __init__(self, sink: SyncSink, scope: LeaseScope, up: Upstream, obs: Observer | None):
        self.sink, self.scope, self.up, self.obs = sink, scope, up, obs
        self.ok = [False]

    def __enter__(self) -> list[bool]:
        return self.ok

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if e is None:
                return
            if isinstance(e, ConnectionResetError):
                # The client hung up (aiohttp's ClientConnectionResetError is also a ClientError, so
                # this comes first): not the node's fault, no breaker count.
                self.sink.outcome = "client_gone"
            elif isinstance(e, (aiohttp.ClientError, TimeoutError)):
                # The node failed mid-body: no retry is possible once bytes went out; cut the client.
                raise _mid_response(self.scope, self.sink.call.node, e) from None
        finally:
            self.up.release()
            if self.obs is not None:
                self.obs.done(self.ok[0])


def _mid_response(scope: LeaseScope, node: str, e: BaseException) -> Failure:
    """The node failed after its answer began: the verdict, and the failure the client gets."""
    cut = mid_response(e)
    scope.node_failed(cut)
    return Failure.mid_response(node, cut)


async def _write(scope: LeaseScope, resp: web.StreamResponse, data: bytes) -> None:
    scope.writing = True
    try:
        await resp.write(data)
    finally:
        scope.writing = False


def error_event(type_: str, message: str, status: int) -> bytes:
    # OpenAI's shape: code is a string; `status` is the HTTP status it would have had.
    err = {"error": {"message": message, "type": type_, "code": type_, "status": status}}
    return b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n"


def node_message(body: bytes, status: int) -> tuple[str, str]:
    """The node's own error message, whichever backend's shape it has."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return f"node answered HTTP {status}", "upstream_error"
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"]), str(err.get("type") or "upstream_error")
        if isinstance(err, str):
            return err, "upstream_error"
    return f"node answered HTTP {status}", "upstream_error"
