"""Vast.ai's REST API v0 behind the fleet's Provider interface (wire as the official ``vastai``
client speaks it: ``Authorization: Bearer``, ``PUT /api/v0/search/asks/``, ``PUT
/api/v0/asks/{offer}/`` → ``new_contract``, ``GET``/``DELETE /api/v0/instances/{id}/``, stop and
resume as ``PUT /api/v0/instances/{id}/`` with ``{"state": "stopped"|"running"}``, the instance
list from ``GET /api/v1/instances/``). A 429's ``Retry-After`` is handed to the caller.
"""

from __future__ import annotations

import json
import math
from typing import Any

from kilolined.core.config import FleetOfferConfig, FleetTemplateConfig
from kilolined.fleet.provider import (
    BOOTING,
    GONE,
    RUNNING,
    STOPPED,
    Instance,
    Offer,
    ProviderError,
    Status,
    pool_of,
    price_per_hour,
)
from kilolined.fleet.wire import ProviderHTTP

DEFAULT_BASE = "https://console.vast.ai"
SEARCH_LIMIT = 64
_GONE = {"offline", "destroyed", "deleted", "unknown"}
_DOWN = {"exited", "stopped"}  # stopped by its renter or reclaimed by its host: the disk is kept


class VastAI:
    def __init__(self, api_key: str, api_base: str | None = None, *, timeout_sec: float = 30):
        self._http = ProviderHTTP((api_base or DEFAULT_BASE).rstrip("/"), {"Authorization": f"Bearer {api_key}"},
                                  timeout_sec)

    async def close(self) -> None:
        await self._http.close()

    async def search(self, offer: FleetOfferConfig, exclude_machines: frozenset[str], max_price: float) -> list[Offer]:
        q: dict[str, Any] = {
            "verified": {"eq": True}, "external": {"eq": False}, "rentable": {"eq": True}, "rented": {"eq": False},
            "gpu_name": {"eq": offer.gpu_name}, "num_gpus": {"eq": offer.num_gpus},
            "reliability": {"gte": offer.min_reliability}, "dph_total": {"lte": max_price},
            "order": [["dph_total", "asc"]], "type": "bid" if offer.interruptible else "on-demand",
            "limit": SEARCH_LIMIT,
        }
        if exclude_machines:
            q["machine_id"] = {"notin": sorted(_int_or_str(m) for m in exclude_machines)}
        body = await self._http.call("PUT", "/api/v0/search/asks/", {"select_cols": ["*"], "q": q})
        return [o for o in (_offer(x) for x in _list(body, "offers")) if o is not None]

    async def create(self, offer: Offer, cfg: FleetOfferConfig, template: FleetTemplateConfig, label: str) -> str:
        env = {**template.env, f"-p {template.port}:{template.port}": "1"}  # Vast opens a port by an env entry
        payload: dict[str, Any] = {"client_id": "me", "image": template.image, "env": env, "disk": template.disk_gb,
                                   "label": label, "runtype": "args"}
        if cfg.interruptible:
            payload["price"] = offer.price  # the bid, $/hour
        body = await self._http.call("PUT", f"/api/v0/asks/{offer.id}/", payload)
        cid = body.get("new_contract") if isinstance(body, dict) else None
        if cid is None:
            raise ProviderError("server", "create answered without new_contract")
        return str(cid)

    async def status(self, instance_id: str, port: int) -> Instance | None:
        try:
            body = await self._http.call("GET", f"/api/v0/instances/{instance_id}/", query={"owner": "me"})
        except ProviderError as e:
            if e.kind == "client" and "404" in str(e):
                return None
            raise
        row = body.get("instances") if isinstance(body, dict) else None
        return _instance(row, port) if isinstance(row, dict) else None

    async def stop(self, instance_id: str) -> None:
        await self._http.call("PUT", f"/api/v0/instances/{instance_id}/", {"state": "stopped"})

    async def resume(self, instance_id: str, num_gpus: int) -> None:
        await self._http.call("PUT", f"/api/v0/instances/{instance_id}/", {"state": "running"})

    async def destroy(self, instance_id: str) -> None:
        try:
            await self._http.call("DELETE", f"/api/v0/instances/{instance_id}/", {})
        except ProviderError as e:
            if not (e.kind == "client" and "404" in str(e)):  # already gone is what was asked
                raise

    async def list_own(self, port: int) -> list[Instance]:
        out: list[Instance] = []
        params: dict[str, str] = {"select_filters": json.dumps({}), "limit": "25",
                                  "order_by": json.dumps([{"col": "id", "dir": "asc"}])}
        for _ in range(400):  # pages of 25: 10,000 instances is past any account this serves
            body = await self._http.call("GET", "/api/v1/instances/", query=params)
            for row in _list(body, "instances"):
                inst = _instance(row, port)
                if inst is not None and pool_of(inst.label) is not None:
                    out.append(inst)
            token = body.get("next_token") if isinstance(body, dict) else None
            if not token:
                break
            params["after_token"] = str(token)
        return out


def _list(body: Any, key: str) -> list[dict[str, Any]]:
    v = body.get(key) if isinstance(body, dict) else None
    return [x for x in v if isinstance(x, dict)] if isinstance(v, list) else []


def _int_or_str(m: str) -> int | str:
    return int(m) if m.isdigit() else m


def _num(v: Any, default: float = 0.0) -> float:
    try:
        n = float(v)
    except (TypeError, ValueError, OverflowError):
        return default
    return n if math.isfinite(n) else default  # NaN/Infinity (JSON parsers take them) are not numbers here


def _offer(x: dict[str, Any]) -> Offer | None:
    price = price_per_hour(x.get("dph_total"))
    if x.get("id") is None or price is None:
        return None  # an offer without a usable price is not one the cap can weigh
    machine = x.get("machine_id")
    return Offer(id=str(x["id"]), machine=None if machine is None else str(machine), price=price,
                 reliability=_num(x.get("reliability", x.get("reliability2")), 0.0),
                 gpu_name=str(x.get("gpu_name") or ""), num_gpus=int(_num(x.get("num_gpus"), 0)))


def _status(row: dict[str, Any]) -> Status:
    actual = str(row.get("actual_status") or "").lower()
    intended = str(row.get("intended_status") or "").lower()
    if actual == "running":
        return RUNNING
    if actual in _GONE or intended == "destroyed":
        return GONE
    if actual in _DOWN or intended == "stopped":
        return STOPPED
    return BOOTING  # created, loading, scheduling: not there yet


def _instance(row: dict[str, Any], port: int) -> Instance | None:
    if row.get("id") is None:
        return None
    url = None
    ip = row.get("public_ipaddr")
    mapped = (row.get("ports") or {}).get(f"{port}/tcp") if isinstance(row.get("ports"), dict) else None
    if ip and isinstance(mapped, list) and mapped and isinstance(mapped[0], dict) and mapped[0].get("HostPort"):
        url = f"http://{str(ip).strip()}:{mapped[0]['HostPort']}"
    machine = row.get("machine_id")
    return Instance(id=str(row["id"]), label=row.get("label"), status=_status(row),
                    price=price_per_hour(row.get("dph_total")) or 0.0,  # 0: not given (the rent's price stays)
                    machine=None if machine is None else str(machine), url=url)

