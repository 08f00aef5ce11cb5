"""The ComfyUI web UI's content-hashed files, answered by the gateway (kilolined/core/page_assets.py
says which, and why they may be kept).

The first GET of one is passed to a node as any page file is (edge/unqueued.py: any live node,
the next one when it fails); a 200 with a length that fits is read whole, kept with its gzip, and
answered from what is kept. Whoever asks for the same file meanwhile waits for that one fetch.
Anything else — another status, a node's own Content-Encoding, a file over the bound, a HEAD
before the file is held — passes through as the node answers. The request has passed the route's
auth before it gets here, as every page request does.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kilolined.core.config import RouteConfig
from kilolined.core.page_assets import IMMUTABLE, Key, PageAsset, accepts_gzip, make_asset
from kilolined.edge.unqueued import forward_unqueued
from kilolined.modes.call import Call
from kilolined.ops.runtime import Runtime
from kilolined.wire.proxy import SERVER, UntypedResponse, Upstream, node_lost


async def serve_page_asset(rt: Runtime, call: Call, rcfg: RouteConfig, ext: str) -> web.StreamResponse:
    """A GET/HEAD of ``/assets/<name>-<hash>.<ext>`` on a comfyui route."""
    assets = rt.page_assets
    key = (call.route_name, call.unqueued_path)  # the same name is the same bytes on every node
    got = assets.get(key)
    if got is None:
        fetching = assets.filling.get(key)
        if fetching is not None:
            got = await asyncio.shield(fetching)
        elif call.request.method == "GET":
            return await _fetch(rt, call, rcfg, key, ext)
    if got is None:
        return await forward_unqueued(rt, call, rcfg)
    return answer(call, got)


async def _fetch(rt: Runtime, call: Call, rcfg: RouteConfig, key: Key, ext: str) -> web.StreamResponse:
    """The one fetch of a file: from the first node that answers, kept when it may be."""
    assets = rt.page_assets
    fetched: asyncio.Future[PageAsset | None] = asyncio.get_running_loop().create_future()
    assets.filling[key] = fetched

    async def keep(up: Upstream, headers: CIMultiDict[str], node: str) -> web.StreamResponse | None:
        size = up.content_length
        if up.status != 200 or "Content-Encoding" in headers or size is None or not assets.fits(size):
            return None
        try:
            body = await up.read()
        except (aiohttp.ClientError, OSError) as e:  # the node went before its file did: ask the next
            raise node_lost(type(e).__name__) from None
        asset = await asyncio.to_thread(make_asset, body, headers.get("Content-Type", ""), ext)
        assets.put(key, asset)
        fetched.set_result(asset)
        resp = answer(call, asset)
        resp.headers["X-KiloLine-Node"] = node  # this answer came from a node; the next ones do not
        return resp

    try:
        return await forward_unqueued(rt, call, rcfg, keep)
    finally:
        if assets.filling.get(key) is fetched:
            del assets.filling[key]
        if not fetched.done():
            fetched.set_result(None)  # not kept: who waited asks a node itself


def answer(call: Call, asset: PageAsset) -> web.Response:
    """The held file, gzipped when the client takes gzip; 304 when it has it already."""
    request = call.request
    gz = asset.gzipped is not None and accepts_gzip(request.headers.get("Accept-Encoding"))
    headers: dict[str, str] = {"Server": SERVER, "X-Request-Id": call.request_id, "Cache-Control": IMMUTABLE,
                               "ETag": asset.gzip_etag() if gz else asset.etag}
    if asset.gzipped is not None:
        headers["Vary"] = "Accept-Encoding"  # two representations of one URL
    if asset.matches(request.headers.get("If-None-Match")):
        return web.Response(status=304, headers=headers)
    if gz:
        headers["Content-Encoding"] = "gzip"
    body = asset.gzipped if gz and asset.gzipped is not None else asset.identity
    call.bytes_out = len(body)
    if not asset.content_type:
        return UntypedResponse(body=body, headers=headers)
    headers["Content-Type"] = asset.content_type
    return web.Response(body=body, headers=headers)
