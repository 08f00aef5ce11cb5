"""The bill over HTTP (docs/API.md#usage): ``GET /admin/usage`` for the operator, every key's;
``GET /v1/usage`` for a key, its own and what remains of its budgets.

Both read this gateway's bill (kilolined/scheduling/bill.py): in cluster mode each gateway
answers for the requests it served, while the budgets' remaining is the cluster's. Reading the
bill does no GPU work: no rate token is taken and no budget spent.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from kilolined.core.auth import presented_key
from kilolined.core.config import BudgetConfig
from kilolined.core.errors import error_response
from kilolined.edge.context import RT
from kilolined.edge.guard import guard
from kilolined.ops.runtime import Runtime
from kilolined.scheduling.bill import BadQuery, Query, Row, group, parse_query, to_csv, total
from kilolined.scheduling.limits import seconds_to_period_end
from kilolined.wire.proxy import request_id

#: a budget limit and the counter it is checked against
LIMITS = (("requests_per_day", "requests"), ("tokens_per_day", "tokens"), ("gpu_seconds_per_day", "gpu_seconds"))


def _rt(request: web.Request) -> Runtime:
    return request.app[RT]


def _query(request: web.Request) -> Query | web.Response:
    try:
        return parse_query(dict(request.query))
    except BadQuery as e:
        return error_response(400, "bad_request", str(e), request_id=request_id(request))


def _answer(request: web.Request, q: Query, selected: list[tuple[Row, list[float]]],
            extra: dict[str, Any]) -> web.Response:
    """The ``selected`` bill rows grouped as asked: JSON, or CSV (the lines alone) when the client
    accepts ``text/csv``."""
    rows = group(selected, q.group_by)
    headers = {"X-Request-Id": request_id(request), "Cache-Control": "no-store"}
    if "text/csv" in request.headers.get("Accept", ""):
        return web.Response(text=to_csv(rows, q.group_by), content_type="text/csv", charset="utf-8",
                            headers=headers)
    body = {"from": q.first, "to": q.last, "group_by": list(q.group_by), "rows": rows, "total": total(selected),
            **extra}
    return web.Response(body=orjson.dumps(body), content_type="application/json", headers=headers)


async def admin_usage(request: web.Request) -> web.Response:
    rt = _rt(request)
    if not rt.keys.is_admin(presented_key(request)):
        return error_response(401, "unauthorized", "admin key required", request_id=request_id(request))
    q = _query(request)
    if isinstance(q, web.Response):
        return q
    return _answer(request, q, list(rt.bill.select(q.first, q.last)), {})


async def key_usage(request: web.Request) -> web.Response:
    rt = _rt(request)
    principal = rt.keys.lookup(presented_key(request))
    if principal is None:
        return error_response(401, "unauthorized", "missing or unknown API key", request_id=request_id(request))
    q = _query(request)
    if isinstance(q, web.Response):
        return q
    key = principal.key_id
    rows = list(rt.bill.select(q.first, q.last, key=key))
    budget = principal.cfg.budget
    remaining = None if budget is None else await _remaining(rt, key, budget)
    return _answer(request, q, rows, {"key": key, "budget": remaining})


async def _remaining(rt: Runtime, key: str, budget: BudgetConfig) -> dict[str, Any]:
    """The key's budgets in their current window: each limit, what was spent of it, what is left."""
    wall = time.time()
    spent = await rt.limits.spent(key, wall)
    limits = {name: getattr(budget, name) for name, _ in LIMITS if getattr(budget, name) is not None}
    used = {name: spent[field] for name, field in LIMITS if name in limits}
    return {"period": budget.period, "window": rt.budgets.label(key, wall),
            "resets_in_sec": seconds_to_period_end(budget.period, wall),
            "limits": limits, "spent": used,
            "remaining": {name: max(0, limits[name] - used[name]) for name in limits}}


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_get("/admin/usage", guard(admin_usage))
    r.add_get("/v1/usage", guard(key_usage))
