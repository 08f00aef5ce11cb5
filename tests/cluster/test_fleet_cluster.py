"""The fleet in cluster mode (docs/FLEET.md): two gateway processes sharing one Redis and one
fake Vast.ai market. Only the leader rents and destroys; both route to what it rented."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
from conftest import auth
from fleet_market import API_KEY, HEALTH, live, pool

from .harness import make_gateways, start_all, until


async def pool_nodes(gw: Any) -> set[str]:
    st = await gw.state()
    return {n for n, v in st["nodes"].items() if v.get("pool") == "p" and v["health"] == "up"}


async def test_only_the_leader_rents_and_every_gateway_routes_to_the_pool(
        tmp_path: Path, redis_server: Any, gateways: list[Any], market: Any, fakegpus: Any,
        http: aiohttp.ClientSession) -> None:
    fp = await market()
    static = await fakegpus()
    procs = make_gateways(2, tmp_path, redis_server.url, static.url)
    for g in procs:
        g.cfg["routes"]["pool"] = {"path": "/pool", "nodes": [], "max_concurrency": 2, "queue_timeout_sec": 60,
                                   "request_timeout_sec": 30, "retry_on_failover": 3}
        g.cfg["fleet"] = {"providers": {"vast": {"kind": "vastai", "api_key": API_KEY, "api_base": fp.url}},
                          "pools": {"p": pool(size=2)}, "max_spend_per_hour": 2.0}
        g.cfg["fleet"]["pools"]["p"]["node"]["health"] = HEALTH
    gateways.extend(procs)
    await start_all(procs)

    async def both_have(n: int, without: str | None = None) -> bool:
        seen = [await pool_nodes(g) for g in procs]
        return all(len(s) == n and (without is None or without not in s) for s in seen)
    await until(lambda: both_have(2), "both gateways route to the 2 rented nodes", timeout=40)
    assert len(fp.instances) == 2, "more than one gateway rented"
    for g in procs:
        async with http.post(g.url + "/pool/generate", json={}, headers=auth()) as r:
            assert r.status == 200, await r.text()
    victim = live(fp)[0]
    async with http.post(f"{fp.url}/_fake/reclaim/{victim.id}") as r:
        assert r.status == 200
    await until(lambda: both_have(2, without=f"p-{victim.id}"), "the replacement on both gateways", timeout=40)
    assert len(fp.instances) == 3, "a loss was answered by more than one rent"
    for g in procs:
        assert API_KEY not in g.log.read_text()
