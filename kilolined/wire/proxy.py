"""The streaming forwarder: header hygiene, one upstream exchange, bytes back to the client.

A failure before any byte reached the client raises ``UpstreamFailed`` (the caller may re-queue
the request on another node); after that, the client connection is cut, as a proxy must.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict

from kilolined.core.verdict import Cause, NodeVerdict
from kilolined.wire.node_urls import for_client, links_to_route
from kilolined.wire.upstream import ConnectFailed, HeadTooLarge, NodePool, Stalled, UpstreamResponse

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Connection", "Proxy-Authenticate", "Proxy-Authorization", "TE",
        "Trailer", "Transfer-Encoding", "Upgrade",
    )
)
# Never forwarded to a node: credentials for the gateway and the gateway's own control headers.
STRIP_REQUEST = HOP_BY_HOP | {
    "host", "content-length", "authorization", "x-api-key", "x-target-host", "x-concurrency-slot",
    "x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "x-request-id", "prefer", "expect",
    "forwarded", "x-real-ip",
}
STRIP_RESPONSE = HOP_BY_HOP | {"content-length", "server", "date"}
# A node's answers that mean it did no work: the request is re-queued (docs/API.md "Re-queue").
# A 500 or 504 passes to the client as it is, never re-sent: the work may have run (a 504 from a
# proxy in front of the node, a model that crashed mid-generation). Both count for the breaker.
RETRY_STATUSES = frozenset((502, 503))
SERVER = "kilolined"  # every answer's Server header: no versions (docs/SECURITY.md)
# A node's answer: from the hot-path pool, or from aiohttp's client (ComfyUI's side calls, files).
Upstream = UpstreamResponse | aiohttp.ClientResponse
log = logging.getLogger("kilolined")
CAPTURE_MAX = 1024 * 1024  # what an adapter may ask to see of a sync answer (ComfyUI's prompt id)
_SANE_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class Observer:
    """Sees each chunk of a response on its way to the client; must be cheap."""

    __slots__ = ()

    def feed(self, chunk: bytes) -> None:
        pass

    def done(self, ok: bool) -> None:
        pass


class UpstreamFailed(Exception):
    """The node failed before any byte reached the client.

    ``answered``: the node gave an answer (an HTTP status, a history without the prompt), so it
    is alive; otherwise it is *lost* (refused, reset, silent), and a request re-queued from it
    goes back to it only once it has been seen alive again (queue.Scheduler.barred)."""

    def __init__(self, reason: str, *, timeout: bool = False, response: Upstream | None = None,
                 answered: bool = False, cause: Cause | None = None, unsent: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.timeout = timeout
        self.response = response  # set when the node answered 502/503 (passed on if out of retries)
        self.answered = answered or response is not None
        self.unsent = unsent  # no connection: the node never got the request, whatever its method
        #: what happened, typed (the words are ``reason``): by default a timeout, a failing
        #: status answered, else a node lost
        self.cause = cause or (Cause.TIMEOUT if timeout else Cause.STATUS if response is not None else Cause.LOST)

    @property
    def verdict(self) -> NodeVerdict:
        return NodeVerdict(self.cause, self.reason)


def lost(what: str) -> str:
    """The node stopped answering: the words a client and an alert see name that, never an
    exception class (the class goes to the log, where the operator can use it)."""
    return f"node lost ({what})"


def mid_response(e: BaseException) -> NodeVerdict:
    """What happened when a node failed after its answer began (read timeout, dropped socket)."""
    if isinstance(e, UpstreamFailed):
        return NodeVerdict(e.cause, e.reason, mid_body=True)
    if isinstance(e, Stalled):
        return NodeVerdict(Cause.STALL, str(e), mid_body=True)
    if isinstance(e, TimeoutError):
        return NodeVerdict(Cause.TIMEOUT, "timed out mid-response", mid_body=True)
    return NodeVerdict(Cause.LOST, lost("connection dropped mid-response"), mid_body=True)


def node_lost(what: str, unsent: bool = False) -> UpstreamFailed:
    """A node lost before any byte of its answer: the scope re-queues the request."""
    return UpstreamFailed(lost(what), unsent=unsent)


@functools.lru_cache(maxsize=1024)
def host_of(node_url: str) -> str:
    """The Host header for a node: its URL's authority without userinfo (one split per node,
    not per request: node URLs are few and come from the config)."""
    return node_url.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]


def request_id(request: web.BaseRequest) -> str:
    rid = request.headers.get("X-Request-Id")
    # 128 bits, 4× cheaper than uuid4; the client's own only when it is sane (no regex run without one)
    return rid if rid and _SANE_ID.fullmatch(rid) else os.urandom(16).hex()


@functools.lru_cache(maxsize=16)
def _networks(trusted: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """``server.trusted_proxies`` parsed once per config, not per request."""
    return tuple(ipaddress.ip_network(c, strict=False) for c in trusted)


def peer_trusted(request: web.BaseRequest, trusted: Iterable[str]) -> bool:
    """The peer is one of ``server.trusted_proxies``: what it says of the client (X-Forwarded-For,
    Forwarded, X-Real-Ip) is believed and passed on."""
    return bool(trusted) and _is_trusted(request.remote or "", _networks(tuple(trusted)))


def _is_trusted(a: str, nets: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(a.strip())
    except ValueError:
        return False
    return any(ip in n for n in nets)


def client_ip(request: web.BaseRequest, trusted: Iterable[str]) -> str:
    """The peer, or — when the peer is a trusted proxy — the last untrusted X-Forwarded-For hop."""
    peer = request.remote or "unknown"
    if not peer_trusted(request, trusted):
        return peer
    nets = _networks(tuple(trusted))
    hops = [h.strip() for h in request.headers.get("X-Forwarded-For", "").split(",") if h.strip()]
    for h in reversed(hops):
        if not _is_trusted(h, nets):
            try:
                return str(ipaddress.ip_address(h))
            except ValueError:
                return peer
    return peer


def forwarded_for(peer: str) -> str:
    """A ``Forwarded`` element naming ``peer`` (RFC 7239 §6: an IPv6 address in quotes and brackets)."""
    return f'for="[{peer}]"' if ":" in peer else f"for={peer}"


def parse_body(body: bytes) -> Any:
    """A request body as JSON; None when it is empty or not JSON."""
    if not body:
        return None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


@dataclass(slots=True)
class Exchange:
    """One client request as the forwarder needs it (the body is kept for a re-queue)."""

    request: web.Request
    method: str
    tail: str  # path tail on the node, with the query string
    body: bytes
    request_id: str
    client_ip: str
    #: the peer is a trusted proxy: the client chain it sends (X-Forwarded-For, Forwarded,
    #: X-Real-Ip) is passed on; from anyone else it is replaced by the peer (docs/SECURITY.md)
    trusted_peer: bool = False
    drop_headers: frozenset[str] = frozenset()
    extra_headers: dict[str, str] = field(default_factory=dict)
    body_override: bytes | None = None
    # The parse of ``body`` and the bytes object it was made from: several stages read an OpenAI
    # body's fields (affinity, stream, usage, budgets), and parsing a long prompt once is enough.
    _doc: Any = field(default=None, init=False, repr=False, compare=False)
    _doc_of: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def body_doc(self) -> Any:
        """The client's body parsed as JSON (None when empty or not JSON), parsed once per body:
        a ``body`` replaced by other bytes is parsed again, never answered from the old parse.
        ``body_override`` (what a node is sent) is not the client's body and is not read here."""
        body = self.body
        if self._doc_of is not body:
            self._doc = parse_body(body)
            self._doc_of = body
        return self._doc

    def upstream_header_pairs(self, node_headers: dict[str, str], node_url: str) -> list[tuple[str, str]]:
        """What the node is sent: the client's end-to-end headers without credentials and our own
        controls, then X-Forwarded-For/-Proto, X-Request-Id and Host (and Forwarded, X-Real-Ip
        when the client sent them); the node's configured headers and the adapter's extra ones
        replace any header of the same name."""
        req = self.request
        src = req.headers
        extra = self.extra_headers
        override = {k.lower() for k in node_headers} | {k.lower() for k in extra} if node_headers or extra else ()
        conn = src.get("Connection")
        drop = self.drop_headers
        skip = STRIP_REQUEST
        if conn or override or drop:  # rare: one set to test against instead of four
            listed = {t.strip().lower() for t in conn.split(",")} if conn else set()
            skip = skip | listed | set(override) | drop
        out = [(k, v) for k, v in src.items() if (lk := k.lower()) not in skip and not lk.startswith("x-kiloline-")]
        xff = src.get("X-Forwarded-For")
        peer = req.remote or ""
        trusted = self.trusted_peer
        ours: tuple[tuple[str, str], ...] = (
            ("X-Forwarded-For", f"{xff}, {peer}" if xff and trusted else (self.client_ip or peer)),
            ("X-Forwarded-Proto", req.scheme),
            ("X-Request-Id", self.request_id),
            ("Host", host_of(node_url)),
        )
        # What a client says of itself in the other spellings: believed from a trusted proxy only,
        # as X-Forwarded-For (a node reading Forwarded or X-Real-Ip must not see a forged address).
        fwd = ", ".join(src.getall("Forwarded", ()))  # several headers are one list (RFC 9110 §5.3)
        if fwd:
            ours += (("Forwarded", f"{fwd}, {forwarded_for(peer)}" if trusted else forwarded_for(peer)),)
        real = src.get("X-Real-Ip")
        if real is not None:
            ours += (("X-Real-Ip", real if trusted else (self.client_ip or peer)),)
        out.extend(ours if not override else [(k, v) for k, v in ours if k.lower() not in override])
        out.extend(node_headers.items())
        out.extend(extra.items())
        return out

    def upstream_headers(self, node_headers: dict[str, str], node_url: str) -> CIMultiDict[str]:
        """The same, for aiohttp's client (ComfyUI's submission)."""
        return CIMultiDict(self.upstream_header_pairs(node_headers, node_url))


async def open_upstream(
    pool: NodePool, ex: Exchange, node_url: str, node_headers: dict[str, str], timeout: float,
    body: bytes | None = None, sent: Callable[[], None] | None = None,
) -> UpstreamResponse:
    """Send the request (``body``: this node's own, else the exchange's) and wait for the response
    headers (``sent`` is called once it is written). Raises UpstreamFailed on any failure."""
    if body is None:
        body = ex.body if ex.body_override is None else ex.body_override
    try:
        return await pool.request(ex.method, ex.tail, ex.upstream_header_pairs(node_headers, node_url), body, timeout,
                                  sent)
    except TimeoutError:
        raise UpstreamFailed(f"no response within {timeout:g}s", timeout=True)
    except ConnectFailed:
        raise node_lost("connection refused", unsent=True)
    except HeadTooLarge as e:
        raise UpstreamFailed(str(e), answered=True)  # it is alive, and answered out of bounds
    except aiohttp.ServerDisconnectedError:
        raise node_lost("connection reset")
    except (aiohttp.ClientError, OSError, ValueError) as e:
        # str(e) can hold the node's address; the type name cannot.
        log.info("[%s] upstream %s", host_of(node_url), type(e).__name__)
        raise node_lost("connection failed")


def response_headers(up: Upstream, node_url: str, route_path: str) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    items = up.raw_headers if isinstance(up, UpstreamResponse) else list(up.headers.items())
    listed: set[str] = set()  # what the node's Connection header names is hop-by-hop too
    for k, v in items:
        lk = k.lower()
        if lk in STRIP_RESPONSE:
            if lk == "connection":
                for t in v.split(","):  # a loop, not a generator: one token per node answer, mostly
                    listed.add(t.strip().lower())
            continue
        if lk in ("location", "content-location"):
            # Redirects must not reveal the node, nor leave the route: back through the route.
            v = for_client(v, node_url, route_path)
        elif lk == "link":
            v = links_to_route(v, node_url, route_path)
        out.add(k, v)
    for name in listed - STRIP_RESPONSE:  # "Connection: keep-alive" (most nodes): nothing more to drop
        out.popall(name, None)
    return out


def whole_body_here(up: UpstreamResponse, method: str) -> bool:
    """The node's whole answer is buffered and may be sent as one ``web.Response``.

    Not for HEAD (the node's Content-Length describes a body that is not sent) nor 1xx/204/304
    (no body, and no Content-Length may be invented for them).
    """
    return up.complete and method != "HEAD" and up.status >= 200 and up.status not in (204, 304)


def cut_client(request: web.BaseRequest) -> None:
    """End the client connection abruptly: after bytes were sent there is no honest error to write."""
    tr = request.transport
    if tr is not None:
        tr.abort()


class WriteFlag(Protocol):
    """Raised while bytes go to the client: a deadline then is the client's doing, not the node's."""

    writing: bool
    started: bool  # the response's head went out: no other answer can follow


async def stream_back(
    request: web.Request, up: Upstream, headers: CIMultiDict[str], obs: Observer | None = None,
    capture: bytearray | None = None, flag: WriteFlag | None = None,
) -> tuple[web.StreamResponse, int]:
    """Copy the node's answer to the client; returns the response and the bytes sent.

    A small answer that arrived whole with its headers goes back as one ``web.Response`` (one
    write of headers and body); anything else is streamed, never buffered whole. Every chunk is
    shown to ``obs`` and copied into ``capture`` (up to 1 MiB) on the way. Upstream read errors
    propagate after the response has started: the caller cuts the client.
    """
    whole = whole_answer(request, up, headers, obs, capture)
    if whole is not None:
        return whole
    cls = web.StreamResponse if "Content-Type" in headers else UntypedStream
    resp = cls(status=up.status, reason=up.reason, headers=headers)
    if up.content_length is not None:
        resp.content_length = up.content_length
    if flag is not None:
        flag.started = True
    await resp.prepare(request)
    sent = 0
    content = up.content
    while chunk := await content.readany():  # no async-generator layer per chunk
        _seen(chunk, obs, capture)
        if flag is None:
            await resp.write(chunk)
        else:
            flag.writing = True
            await resp.write(chunk)
            flag.writing = False
        sent += len(chunk)
    await resp.write_eof()
    return resp, sent


def whole_answer(request: web.Request, up: Upstream, headers: CIMultiDict[str], obs: Observer | None = None,
                 capture: bytearray | None = None) -> tuple[web.Response, int] | None:
    """``stream_back``'s answer when the node's whole answer arrived with its headers: one
    ``web.Response`` (one write of headers and body) and its size, made without a coroutine;
    None when it must be streamed. Sets the answer's Server header either way."""
    headers["Server"] = SERVER  # the node's own is stripped (STRIP_RESPONSE)
    if isinstance(up, UpstreamResponse) and whole_body_here(up, request.method):
        body = up.body()
        _seen(body, obs, capture)
        cls = web.Response if "Content-Type" in headers else UntypedResponse
        return cls(status=up.status, reason=up.reason, headers=headers, body=body), len(body)
    return None


# aiohttp gives every answer with a body a Content-Type (application/octet-stream) when it has
# none. A node's answer without one goes to the client without one, as nginx and HAProxy relay it
# (the client may sniff the type; octet-stream would tell it not to).
class UntypedResponse(web.Response):
    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self.headers.popall("Content-Type", None)


class UntypedStream(web.StreamResponse):
    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self.headers.popall("Content-Type", None)


def _seen(chunk: bytes, obs: Observer | None, capture: bytearray | None) -> None:
    if obs is not None:
        obs.feed(chunk)
    if capture is not None and len(capture) < CAPTURE_MAX:
        capture += chunk
