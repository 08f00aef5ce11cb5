"""The answer to an Images API request on a ``comfyui`` route: OpenAI's ``{"created", "data"}``.

Each output image of the finished prompt (its history's files of type ``output``, in the order
the history lists them) is one ``data`` item: its bytes as ``b64_json``, read from the node that
made it, or its ``url`` on the gateway's ``{path}/view`` under the route's name for it, which the
file store answers after the node is gone (comfy_store.py).
"""

from __future__ import annotations

import base64
import time
from typing import Any
from urllib.parse import urlencode

import aiohttp

from kilolined.adapters.comfy_files import OUTPUT
from kilolined.adapters.comfy_node import lease_api
from kilolined.adapters.comfy_store import COPY_SEC, files_state, output_files
from kilolined.core.outcome import Failure
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.queue import Lease
from kilolined.wire.proxy import Exchange


def gateway_base(rt: Runtime, ex: Exchange) -> str:
    """Where clients reach the gateway: ``server.public_url``, else the request's own origin."""
    public = rt.cfg.server.public_url
    return public.rstrip("/") if public else f"{ex.request.scheme}://{ex.request.host}"


async def _node_bytes(rt: Runtime, lease: Lease, ex: Exchange, sub: str, name: str) -> bytes:
    node = lease_api(rt, lease, ex.request_id)
    query = urlencode({"filename": name, "subfolder": sub, "type": OUTPUT})
    limit = files_state(rt).files(lease.route).max_bytes
    try:
        async with node.session.get(f"{node.url}/view?{query}", headers=node.headers,
                                    timeout=aiohttp.ClientTimeout(total=COPY_SEC)) as r:
            if r.status != 200:
                raise aiohttp.ClientError(f"HTTP {r.status}")
            data = await r.content.read(limit + 1)
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise Failure.upstream(f"node {lease.node} made the image but did not give it ({e})", False) from None
    if len(data) > limit:
        raise Failure.upstream("an output image is larger than the route's comfy.max_files_mb", False)
    return data


async def images_answer(rt: Runtime, lease: Lease, entry: dict[str, Any], shown: dict[str, Any],
                        response_format: Any, ex: Exchange) -> dict[str, Any]:
    """OpenAI's images response for the finished prompt: ``entry`` is its history with the node's
    file names, ``shown`` the same with the route's (as prompt_finished gave them)."""
    made = [(sub, name) for kind, sub, name in output_files(entry) if kind == OUTPUT]
    named = [(sub, name) for kind, sub, name in output_files(shown) if kind == OUTPUT]
    if not made:
        raise Failure.upstream("the workflow ran but saved no image (its template needs a SaveImage)", False)
    data: list[dict[str, str]] = []
    if response_format == "url":
        base = gateway_base(rt, ex) + rt.cfg.routes[lease.route].path.rstrip("/")
        for sub, name in named:
            data.append({"url": f"{base}/view?{urlencode({'filename': name, 'subfolder': sub, 'type': OUTPUT})}"})
    else:
        for sub, name in made:
            raw = await _node_bytes(rt, lease, ex, sub, name)
            data.append({"b64_json": base64.b64encode(raw).decode()})
    return {"created": int(time.time()), "data": data}
