"""WebSocket pass-through for unqueued paths: frames both ways, closes mirrored. (A comfyui
route's ``/ws`` is the gateway's own socket instead: adapters/comfy_hub.py.)

The node's socket is opened first, so a node that refuses or is unreachable gives the client a
plain HTTP error (via UpstreamFailed) instead of an accepted socket that closes at once. The
gateway's credentials and the browser's ``Origin`` never reach the node (ComfyUI answers 403 to
a foreign Origin on a loopback Host).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

import aiohttp
import orjson
from aiohttp import WSCloseCode, WSMsgType, web

from kilolined.core.errors import error_body
from kilolined.wire.proxy import SERVER, STRIP_REQUEST, UpstreamFailed, node_lost, request_id

log = logging.getLogger("kilolined")

CONNECT_SEC = 10.0
MAX_MSG = 64 * 1024 * 1024  # node → client frames (image previews)
CLIENT_MAX_MSG = 4 * 1024 * 1024  # client → node frames
HEARTBEAT_SEC = 30.0  # notice a peer that vanished without a FIN (spot machines do)
# Never sent on: gateway credentials, the browser's Origin, and the handshake headers that
# aiohttp makes afresh for the upstream connection.
STRIP_WS = STRIP_REQUEST | {
    "origin", "cookie", "sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
    "sec-websocket-protocol", "sec-websocket-accept",
}
_NO_STATUS = 1005  # the peer closed without a code: a normal close
_UNSENDABLE = {_NO_STATUS, WSCloseCode.ABNORMAL_CLOSURE, 1015}  # reserved: never in a close frame


def upstream_ws_headers(request: web.BaseRequest, node_headers: Mapping[str, str]) -> dict[str, str]:
    """The client's headers minus credentials/Origin/hop-by-hop, then the node's configured ones."""
    conn_listed = {t.strip().lower() for t in request.headers.get("Connection", "").split(",") if t.strip()}
    out: dict[str, str] = {}
    for k, v in request.headers.items():
        lk = k.lower()
        if lk in STRIP_WS or lk in conn_listed or lk.startswith("x-kiloline-"):
            continue
        out[k] = v
    out.update(node_headers)
    return out


def _close_code(code: int | None, abnormal: int) -> int:
    """A code we may send on for the peer's close (1006 etc. cannot be sent: map them)."""
    if code == _NO_STATUS:
        return WSCloseCode.OK
    if code is None or code in _UNSENDABLE or not (1000 <= code <= 4999):
        return abnormal
    return code


async def _pump(src: web.WebSocketResponse | aiohttp.ClientWebSocketResponse,
                dst: web.WebSocketResponse | aiohttp.ClientWebSocketResponse) -> None:
    """Copy text and binary frames until src closes (pings are answered by each side itself)."""
    while True:
        msg = await src.receive()
        try:
            if msg.type == WSMsgType.TEXT:
                await dst.send_str(msg.data)
            elif msg.type == WSMsgType.BINARY:
                await dst.send_bytes(msg.data)
            elif msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                return
        except (ConnectionError, RuntimeError):
            return  # dst is gone; the caller closes src


async def connect_node_ws(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str], *,
                          connect_sec: float, heartbeat: float, max_msg_size: int, close_sec: float,
                          protocols: list[str] | tuple[str, ...] = ()) -> aiohttp.ClientWebSocketResponse:
    """Open a websocket to a node; every way it can fail is an UpstreamFailed that names no
    address (the client's relay here, ComfyUI's progress socket in adapters/comfyui.py)."""
    try:
        async with asyncio.timeout(connect_sec):
            return await session.ws_connect(
                url, headers=headers, protocols=protocols, autoping=True, heartbeat=heartbeat,
                max_msg_size=max_msg_size, timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=close_sec))
    except TimeoutError:
        raise UpstreamFailed("websocket handshake timed out", timeout=True)
    except aiohttp.WSServerHandshakeError as e:
        raise UpstreamFailed(f"node refused the websocket (HTTP {e.status})", answered=True)
    except aiohttp.ClientConnectorError:
        raise node_lost("connection refused")
    except (aiohttp.ClientError, OSError) as e:
        log.info("node websocket %s", type(e).__name__)
        raise node_lost("websocket connection failed")


async def proxy_websocket(request: web.Request, session: aiohttp.ClientSession, url: str,
                          headers: dict[str, str], *,
                          response_headers: Mapping[str, str] | None = None) -> web.WebSocketResponse:
    """Pipe the client's websocket to ``url`` on the node; returns when either side has closed.

    ``headers`` are the node's (sent as given, after the client's filtered ones). Raises
    UpstreamFailed when the node's socket cannot be opened; the error holds no node address.
    """
    if not web.WebSocketResponse().can_prepare(request).ok:
        # Checked before dialling the node: a broken handshake must not cost an upstream socket.
        body = orjson.dumps(error_body("bad_request", "invalid websocket handshake", request_id(request), None))
        raise web.HTTPBadRequest(body=body, content_type="application/json")
    protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
    upstream = await connect_node_ws(session, url, upstream_ws_headers(request, headers), protocols=protocols,
                                     connect_sec=CONNECT_SEC, heartbeat=HEARTBEAT_SEC, max_msg_size=MAX_MSG,
                                     close_sec=5.0)

    # Offer the client exactly the subprotocol the node chose.
    client = web.WebSocketResponse(protocols=(upstream.protocol,) if upstream.protocol else (),
                                   autoping=True, heartbeat=HEARTBEAT_SEC, max_msg_size=CLIENT_MAX_MSG)
    for k, v in (response_headers or {}).items():
        client.headers[k] = v
    client.headers["Server"] = SERVER
    try:
        await client.prepare(request)
    except BaseException:
        await upstream.close()
        raise

    await _relay(client, upstream)
    return client


async def _relay(client: web.WebSocketResponse, upstream: aiohttp.ClientWebSocketResponse) -> None:
    to_node = asyncio.create_task(_pump(client, upstream))
    to_client = asyncio.create_task(_pump(upstream, client))
    node_first = False
    try:
        done, _ = await asyncio.wait({to_node, to_client}, return_when=asyncio.FIRST_COMPLETED)
        node_first = to_client in done
    finally:
        for t in (to_node, to_client):
            t.cancel()
        await asyncio.gather(to_node, to_client, return_exceptions=True)
        # Mirror whoever closed first; its code goes on to the other side unless it cannot be sent.
        code = _close_code(upstream.close_code if node_first else client.close_code, WSCloseCode.GOING_AWAY)
        with contextlib.suppress(Exception):
            await client.close(code=code)
        with contextlib.suppress(Exception):
            await upstream.close(code=code)
