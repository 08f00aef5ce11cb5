"""Vast.ai's REST API v0 on the fake market, as the official `vastai` client (1.9) speaks it.

Routes (all under `Authorization: Bearer <key>`; docs/BACKENDS.md, "Fake providers", has the
shapes): `PUT /api/v0/search/asks/` and `POST /api/v0/bundles/` (search), `PUT
/api/v0/asks/{offer}/` (create → `new_contract`), `GET /api/v0/instances/` and the paginated
`GET /api/v1/instances/` (list), `GET|PUT|DELETE /api/v0/instances/{id}/` (show; label, or stop
and resume with `{"state": "stopped"|"running"}` as the client's stop_instance/start_instance send
it; destroy).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from functools import partial
from typing import Any

from aiohttp import web

from kilolined.fakegpu.base import is_number
from kilolined.fakegpu.provider import FakeProvider, Instance, Offer, Wire

# Query keys that are not offer fields (vastai's search_offers adds them to the filter dict).
_QUERY_META = frozenset({"order", "type", "limit", "allocated_storage", "disable_bundling", "select_cols"})
_FIRST_INSTANCE_ID = 20_000_000

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def vast_json(data: Any, status: int = 200) -> web.Response:
    # The CLI refuses a body whose Content-Type is not exactly "application/json" (no charset).
    return web.Response(body=json.dumps(data).encode(), status=status, content_type="application/json")


def vast_error(status: int, error: str, msg: str) -> web.Response:
    return vast_json({"success": False, "error": error, "msg": msg}, status=status)


def offer_row(offer: Offer, host: str, bid: bool) -> dict[str, Any]:
    """An offer as search returns it; `dph_total` is the min bid when searching `type: bid`."""
    price = offer.min_bid if bid else offer.dph_total
    return {
        "id": offer.id, "ask_contract_id": offer.id, "bundle_id": offer.id,
        "machine_id": offer.machine_id, "host_id": offer.machine_id,
        "gpu_name": offer.gpu_name, "num_gpus": offer.num_gpus,
        "gpu_ram": offer.gpu_ram_gb * 1000, "gpu_total_ram": offer.gpu_ram_gb * 1000 * offer.num_gpus,
        "dph_total": price, "dph_base": price, "min_bid": offer.min_bid, "is_bid": bid,
        "reliability": offer.reliability, "reliability2": offer.reliability,
        "score": round(offer.reliability * 100 / price, 3),
        "verified": True, "verification": "verified", "rentable": True, "rented": False, "external": False,
        "hosting_type": 0, "geolocation": offer.geolocation, "public_ipaddr": host,
        "cuda_max_good": 12.4, "driver_version": "550.54.14", "disk_space": 200.0,
        "cpu_cores": 16, "cpu_cores_effective": 16.0, "cpu_ram": 64000, "inet_up": 1000.0, "inet_down": 1000.0,
        "direct_port_count": 100,
    }


def _coerce(have: Any, want: Any) -> Any:
    """`want` as the type of `have`: the CLI's query parser sends every number as a string."""
    if isinstance(have, bool):
        return want if isinstance(want, bool) else str(want).lower() == "true"
    if is_number(have):
        try:
            return float(want)
        except (TypeError, ValueError):
            return None
    return want


def _holds(have: Any, op: str, want: Any) -> bool:
    if op in ("in", "notin"):
        items = want if isinstance(want, list) else [want]
        found = any(_coerce(have, w) == have for w in items)
        return found if op == "in" else not found
    value = _coerce(have, want)
    if op == "eq":
        return bool(have == value)
    if op == "neq":
        return bool(have != value)
    if value is None or isinstance(have, bool) or not (is_number(have) and is_number(value)):
        return False
    return {"gt": have > value, "gte": have >= value, "lt": have < value, "lte": have <= value}.get(op, False)


def matches(row: Mapping[str, Any], filters: Mapping[str, Any]) -> bool:
    """Vast's filter dict ({field: {op: value}}) against one row; fields the row lacks are ignored."""
    for key, cond in filters.items():
        if key in _QUERY_META or key not in row:
            continue
        ops = cond if isinstance(cond, dict) else {"eq": cond}
        if not all(_holds(row[key], op, want) for op, want in ops.items()):
            return False
    return True


def ordered(rows: list[dict[str, Any]], order: Any) -> list[dict[str, Any]]:
    """Sort by `[[field, "asc"|"desc"], ...]` or `[{"col": f, "dir": d}, ...]`, first key first."""
    keys: list[tuple[str, bool]] = []
    for item in order if isinstance(order, list) else []:
        if isinstance(item, dict):
            keys.append((str(item.get("col", "")), item.get("dir") == "desc"))
        elif isinstance(item, list | tuple) and item:
            keys.append((str(item[0]), len(item) > 1 and item[1] == "desc"))
    for name, desc in reversed(keys):
        rows.sort(key=partial(_sort_key, name=name), reverse=desc)
    return rows


def _sort_key(row: Mapping[str, Any], name: str) -> tuple[bool, Any]:
    value = row.get(name)
    return (value is None, 0 if value is None else value)


def container_ports(env: Mapping[str, str]) -> list[tuple[int, str]]:
    """The ports asked for with `-p 8188:8188` env keys (vastai's parse_env), container side."""
    ports: list[tuple[int, str]] = []
    for key in env:
        if key.startswith("-p "):
            inner = key[3:].split(":")[-1].split("/")[0]
            if inner.isdigit() and (int(inner), "tcp") not in ports:
                ports.append((int(inner), "tcp"))
    return ports


def instance_row(inst: Instance, host: str) -> dict[str, Any]:
    """An instance as `GET /api/v0/instances/{id}/` shows it."""
    running = inst.status == "running"
    port = inst.host_port
    mapping = {f"{p}/tcp": [{"HostIp": "0.0.0.0", "HostPort": str(port)}] for p, _ in inst.ports} if port else {}
    status_msg = {"loading": "Loading image (fake)", "running": "success, running (fake)",
                  "exited": "host reclaimed the machine (fake)", "stopped": "stopped by its renter (fake)"
                  }.get(inst.status, "")
    down = inst.status in ("exited", "stopped")
    # Vast shows a stopped instance as exited, intended stopped, as it shows a reclaimed one.
    return {
        "id": int(inst.id), "machine_id": inst.offer.machine_id, "host_id": inst.offer.machine_id,
        "actual_status": "exited" if down else inst.status, "intended_status": "stopped" if down else "running",
        "cur_state": "stopped" if down else "running", "next_state": "stopped" if down else "running",
        "status_msg": status_msg, "label": inst.label or None,
        "image_uuid": inst.image, "image_runtype": "args", "gpu_name": inst.offer.gpu_name,
        "num_gpus": inst.offer.num_gpus, "gpu_ram": inst.offer.gpu_ram_gb * 1000,
        "dph_total": inst.price, "dph_base": inst.price, "is_bid": inst.interruptible,
        "min_bid": inst.offer.min_bid, "reliability2": inst.offer.reliability,
        "geolocation": inst.offer.geolocation, "start_date": inst.created_at, "end_date": None,
        "public_ipaddr": host if running else None, "ports": mapping,
        "extra_env": [[k, v] for k, v in inst.env.items() if not k.startswith("-")],
        "ssh_host": None, "ssh_port": None, "direct_port_start": -1, "direct_port_end": -1,
    }


class VastWire(Wire):
    name = "vastai"

    def instance_id(self, n: int) -> str:
        return str(_FIRST_INSTANCE_ID + n)

    def error(self, status: int, message: str) -> web.Response:
        code = {401: "not_authorized", 404: "no_such_instance", 429: "too_many_requests"}.get(status, "error")
        return vast_error(status, code, message)

    def add_routes(self, app: web.Application, market: FakeProvider) -> None:
        api = _VastApi(market)
        for method, path, op, handler in (
            ("PUT", "/api/v0/search/asks/", "search", api.search),
            ("POST", "/api/v0/bundles/", "search", api.search),
            ("PUT", "/api/v0/asks/{offer}/", "create", api.create),
            ("GET", "/api/v0/instances/", "list", api.list_v0),
            ("GET", "/api/v1/instances/", "list", api.list_v1),
            ("GET", "/api/v0/instances/{id}/", "status", api.show),
            ("PUT", "/api/v0/instances/{id}/", None, api.put_instance),
            ("DELETE", "/api/v0/instances/{id}/", "destroy", api.destroy),
        ):
            wrapped = api.guard(op, handler)
            # With and without the trailing slash: the client always sends it, a hand-written one may not.
            app.router.add_route(method, path, wrapped)
            app.router.add_route(method, path.rstrip("/"), wrapped)


class _VastApi:
    def __init__(self, market: FakeProvider) -> None:
        self.market = market

    def guard(self, op: str | None, handler: Handler) -> Handler:
        """Auth first, then an injected failure, then the call itself (a handler whose op depends
        on its body, op None, asks for the failure itself)."""
        async def guarded(request: web.Request) -> web.StreamResponse:
            if not self.market.authorized(request):
                return vast_error(401, "not_authorized", "invalid or missing API key")
            failure = self.market.failure_response(op) if op is not None else None
            if failure is not None:
                return failure
            return await handler(request)
        return guarded

    async def _body(self, request: web.Request) -> dict[str, Any] | None:
        try:
            data = json.loads(await request.read() or b"{}")
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    def _instance(self, request: web.Request) -> Instance | None:
        inst = self.market.instances.get(request.match_info["id"])
        return inst if inst is not None and inst.status != "destroyed" else None

    async def search(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if body is None:
            return vast_error(400, "invalid_args", "body must be a JSON object")
        # The new endpoint wraps the query as {"select_cols": [...], "q": {...}}; /bundles/ sends it bare.
        query = body.get("q", body) if request.method == "PUT" else body
        if not isinstance(query, dict):
            return vast_error(400, "invalid_args", "q must be a JSON object")
        bid = query.get("type") in ("bid", "interruptible")
        rows = [offer_row(o, self.market.host, bid) for o in self.market.available()]
        rows = ordered([r for r in rows if matches(r, query)], query.get("order", [["score", "desc"]]))
        limit = query.get("limit")
        if isinstance(limit, int) and limit > 0:
            rows = rows[:limit]
        return vast_json({"offers": rows})

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if body is None:
            return vast_error(400, "invalid_args", "body must be a JSON object")
        problem = _create_problem(body)
        if problem:
            return vast_error(400, "invalid_args", problem)
        raw = request.match_info["offer"]
        offer = self.market.offer(int(raw)) if raw.isdigit() else None
        if offer is None or offer not in self.market.available():
            return vast_error(400, "no_such_ask", f"Instance type by id {raw} is not available.")
        price = body.get("price")
        if price is not None and price < offer.min_bid:
            return vast_error(400, "invalid_price", f"bid {price} is below the offer's min_bid {offer.min_bid}")
        env = {str(k): str(v) for k, v in (body.get("env") or {}).items()}
        inst = self.market.rent(offer, image=body["image"], label=body.get("label") or "", env=env,
                                ports=container_ports(env), price=offer.dph_total if price is None else price,
                                interruptible=price is not None)
        return vast_json({"success": True, "new_contract": int(inst.id)})

    def _rows(self) -> list[dict[str, Any]]:
        return [instance_row(i, self.market.host) for i in self.market.live()]

    async def list_v0(self, request: web.Request) -> web.StreamResponse:
        return vast_json({"instances": self._rows()})

    async def list_v1(self, request: web.Request) -> web.StreamResponse:
        """The paginated list the client's show_instances walks: JSON-encoded query args."""
        try:
            filters = json.loads(request.query.get("select_filters", "{}"))
            order = json.loads(request.query.get("order_by", '[{"col": "id", "dir": "asc"}]'))
            limit = max(1, min(int(request.query.get("limit", "25")), 1000))
            start = int(request.query.get("after_token", "0"))
        except ValueError:
            return vast_error(400, "invalid_args", "select_filters, order_by, limit or after_token is malformed")
        if not isinstance(filters, dict):
            return vast_error(400, "invalid_args", "select_filters must be a JSON object")
        rows = ordered([r for r in self._rows() if matches(r, filters)], order)
        page = rows[start:start + limit]
        labels: dict[str, int] = {}
        for r in rows:
            labels[r["label"] or ""] = labels.get(r["label"] or "", 0) + 1
        more = start + limit < len(rows)
        return vast_json({"instances": page, "next_token": str(start + limit) if more else None,
                          "total_instances": len(rows), "label_counts": labels})

    async def show(self, request: web.Request) -> web.StreamResponse:
        inst = self._instance(request)
        return vast_json({"instances": instance_row(inst, self.market.host) if inst else None})

    async def put_instance(self, request: web.Request) -> web.StreamResponse:
        """`{"label": ...}` relabels; `{"state": "stopped"|"running"}` stops or resumes."""
        body = await self._body(request)
        if body is not None and set(body) == {"state"} and body["state"] in ("stopped", "running"):
            op = "stop" if body["state"] == "stopped" else "resume"
        elif body is not None and set(body) == {"label"} and isinstance(body["label"], str | None):
            op = "label"
        else:
            return vast_error(400, "invalid_args", "the fake takes {\"label\": string} or "
                                                   "{\"state\": \"stopped\"|\"running\"}")
        failure = self.market.failure_response(op)
        if failure is not None:
            return failure
        inst = self._instance(request)
        if inst is None:
            return vast_error(404, "no_such_instance", f"no instance {request.match_info['id']}")
        if op == "label":
            inst.label = body["label"] or ""
        elif op == "stop":
            await self.market.stop_instance(inst)
        else:
            self.market.resume(inst)
        return vast_json({"success": True})

    async def destroy(self, request: web.Request) -> web.StreamResponse:
        inst = self._instance(request)
        if inst is None:
            return vast_error(404, "no_such_instance", f"no instance {request.match_info['id']}")
        await self.market.destroy(inst)
        return vast_json({"success": True})


def _create_problem(body: Mapping[str, Any]) -> str | None:
    if not isinstance(body.get("image"), str) or not body["image"]:
        return "image: required, a non-empty string"
    if body.get("env") is not None and not isinstance(body["env"], dict):
        return "env: must be an object"
    if body.get("label") is not None and not isinstance(body["label"], str):
        return "label: must be a string"
    price = body.get("price")
    if price is not None and not (is_number(price) and price > 0):
        return "price: must be a number > 0 (a bid per hour)"
    return None
