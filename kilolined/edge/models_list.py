"""``GET {path}/models`` on a path that several OpenAI routes share: what a client may ask for
(docs/CONFIG.md#routes-that-match-the-request), in the OpenAI list shape: the models of the
routes' nodes that a request naming them reaches a route serving them with. A model
only a route's node serves, while requests naming it match another route, is not listed: asked
for, it would be refused (or, on a node that does not check, answered by another model).

Each node is asked its own ``/models`` (the same tail the client sent) at once, without a slot,
unless it declares its ``models`` (docs/CONFIG.md#multi-model-nodes): those are its answer;
a node that fails or does not answer in time is left out, and the answer is 502 only when none
answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from kilolined.modes.call import Call
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.routing import may_ask

ASK_SEC = 5.0


def is_models_list(method: str, tail: str) -> bool:
    return method == "GET" and tail.split("?", 1)[0].rstrip("/") in ("/models", "/v1/models")


def ids(answer: Any) -> frozenset[str]:
    data = answer.get("data") if isinstance(answer, dict) else None
    return frozenset(m["id"] for m in (data if isinstance(data, list) else [])
                     if isinstance(m, dict) and isinstance(m.get("id"), str))


def merge(answers: Sequence[Any]) -> list[dict[str, Any]]:
    """The models of every answer, each id once (first seen wins), in the order seen. Pure."""
    seen: dict[str, dict[str, Any]] = {}
    for a in answers:
        data = a.get("data") if isinstance(a, dict) else None
        for m in data if isinstance(data, list) else []:
            if isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"] not in seen:
                seen[m["id"]] = m
    return list(seen.values())


def _listing(ids: Sequence[str], owner: str) -> dict[str, Any]:
    return {"data": [{"id": m, "object": "model", "owned_by": owner} for m in ids]}


async def templates_list(call: Call, templates: Sequence[str]) -> web.Response:
    """``GET {path}/v1/models`` on a ``comfyui`` route with templates: the names the Images API
    takes as ``model`` (docs/API.md "Images over ComfyUI workflows"), which no node knows of."""
    return web.json_response({"object": "list", **_listing(sorted(templates), "kiloline")},
                             headers={**call.headers, "X-Request-Id": call.request_id})


async def _ask(rt: Runtime, node: str, tail: str) -> Any:
    ns = rt.scheduler.nodes[node]
    names = ns.cfg.rewrite.model if ns.cfg.rewrite is not None else {}
    if names and ns.cfg.models is None:
        # A hosted API's names are its rewrite.model: what the gateway sends it (its own catalog is not asked).
        return _listing(list(names), node)
    if isinstance(ns.cfg.models, list):
        # Declared models (docs/CONFIG.md#multi-model-nodes) are what the gateway routes by: say those.
        return with_aliases(_listing(ns.cfg.models, node), names, node)
    try:
        async with rt.session(node).get(ns.cfg.url + tail, headers=ns.cfg.headers,
                                        timeout=aiohttp.ClientTimeout(total=ASK_SEC)) as r:
            if r.status != 200:
                return None
            return with_aliases(orjson.loads(await r.read()), names, node)
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
        return None


def with_aliases(answer: Any, aliases: Mapping[str, str], owner: str) -> Any:
    """A model list with the aliases (client name -> served name) of the models it holds added
    after them: what a client may ask for (docs/CONFIG.md#rewriting-requests). Pure."""
    data = answer.get("data") if isinstance(answer, dict) else None
    if not aliases or not isinstance(data, list):
        return answer
    held = {m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)}
    extra = [{"id": a, "object": "model", "owned_by": owner} for a, t in aliases.items() if t in held and a not in held]
    return {**answer, "data": data + extra}


async def models_union(rt: Runtime, call: Call, routes: Sequence[str]) -> web.Response:
    nodes: list[str] = []
    for name in routes:
        rq = rt.scheduler.routes[name]
        nodes += [n for n in rq.all_nodes if n not in nodes and n in rt.scheduler.nodes]
    by_node = dict(zip(nodes, await asyncio.gather(*(_ask(rt, n, call.tail) for n in nodes)), strict=True))
    answers = [a for a in by_node.values() if a is not None]
    if not answers:
        return call.error(502, "upstream_error", "no node of this path answered its model list")
    served = [(rt.scheduler.routes[name].cfg.match,
               frozenset().union(*(ids(by_node.get(n)) for n in rt.scheduler.routes[name].all_nodes)))
              for name in routes]
    listed = [m for m in merge(answers) if may_ask(m["id"], served)]
    return web.json_response({"object": "list", "data": listed},
                             headers={**call.headers, "X-Request-Id": call.request_id})


async def with_names(rt: Runtime, call: Call, routes: Sequence[str]) -> web.Response:
    """``models_union``, then what a client may also ask for on routes that rename models
    (docs/CONFIG.md#rewriting-requests): the names the routes' overflow nodes take (their
    ``rewrite.model``, never their provider's whole catalogue) and each route's aliases of a
    listed model."""
    resp = await models_union(rt, call, routes)
    body = resp.body
    if resp.status != 200 or not isinstance(body, bytes | bytearray):
        return resp
    listed = orjson.loads(body)["data"]
    extra = [n for name in routes for n in rt.scheduler.routes[name].cfg.overflow_nodes if n in rt.scheduler.nodes]
    if extra:
        listed = merge([{"data": listed}, *[a for a in await asyncio.gather(*(_ask(rt, n, call.tail) for n in extra))
                                             if a is not None]])
    for name in routes:
        rw = rt.scheduler.routes[name].cfg.rewrite
        if rw is not None:
            listed = with_aliases({"data": listed}, rw.model, "kiloline")["data"]
    return web.json_response({"object": "list", "data": listed},
                             headers={**call.headers, "X-Request-Id": call.request_id})
