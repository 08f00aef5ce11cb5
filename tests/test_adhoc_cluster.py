"""/v1/proxy's ad-hoc targets in cluster mode (docs/API.md#v1proxy, docs/CLUSTER.md): what a
route made for a client-named target writes into Redis goes with the route. Clients name targets
freely; each gateway bounds what it keeps for them (kilolined/ops/adhoc.py), and Redis, shared
and long-lived, must not keep the rest: a key that walks through targets would otherwise grow it
without end."""

from __future__ import annotations

import asyncio
from typing import Any

from cluster_harness import RedisServer, redis_server
from conftest import auth, base_config, wait_until

__all__ = ["redis_server"]  # fixtures
PREFIX = "kl-ah:"


async def adhoc_keys(r: Any) -> list[str]:
    return sorted(k for k in await r.keys(PREFIX + "*") if ":adhoc:" in k) + [
        f"nin {n}" for n in await r.hkeys(PREFIX + "nin") if n.startswith("adhoc:")] + [
        f"routes {m}" for m in await r.smembers(PREFIX + "routes") if m.startswith("adhoc:")]


async def test_an_idle_adhoc_route_leaves_nothing_in_redis(redis_server: RedisServer, fakegpus, gateway,
                                                           http) -> None:
    targets = [await fakegpus(steps=1, step_ms=5) for _ in range(3)]
    cfg = base_config({"a": targets[0].url})
    cfg["keys"]["bob"]["adhoc_targets"] = ["http://127.0.0.1:*"]
    cfg["cluster"] = {"redis_url": redis_server.url, "gateway_id": "gw0", "lease_ttl_sec": 1.5, "key_prefix": PREFIX}
    gw = await gateway(cfg)
    r = redis_server.client()
    try:
        async def send(g: Any) -> None:
            async with http.post(gw.url + "/v1/proxy/generate", json={},
                                 headers={**auth("bob"), "X-Target-Host": g.url, "X-Concurrency-Slot": "2"}) as resp:
                assert resp.status == 200, await resp.text()

        await asyncio.gather(*(send(g) for g in targets[1:] for _ in range(3)))
        assert len(gw.rt.adhoc) == 2
        made = await adhoc_keys(r)
        assert made, "the ad-hoc routes were never in Redis: this test would prove nothing"
        # Idle: dropped by this gateway, and its keys from Redis with it.
        gw.rt.adhoc.idle_sec = 0.2
        gw.rt.adhoc._next_sweep = 0.0
        await wait_until(lambda: len(gw.rt.adhoc) == 0, timeout=5)

        async def gone() -> bool:
            return not await adhoc_keys(r)
        await wait_until(gone, timeout=5)
        # The same target again: a route made afresh, served, and counted in Redis again.
        await send(targets[1])
        assert await adhoc_keys(r)
    finally:
        await r.aclose()


async def test_a_route_another_gateway_runs_on_keeps_its_keys(redis_server: RedisServer, fakegpus, gateway,
                                                              http) -> None:
    """Gateway A drops its idle route for (bob, T) while gateway B runs bob's request on T: Redis
    keeps the route's counts (B's lease is one of them), B's request ends well, and the keys go
    once B drops the route too."""
    slow = await fakegpus(steps=1, step_ms=5)
    other = await fakegpus(steps=1, step_ms=5)
    gws = []
    for gid in ("gwa", "gwb"):
        cfg = base_config({"a": other.url})
        cfg["keys"]["bob"]["adhoc_targets"] = ["http://127.0.0.1:*"]
        cfg["cluster"] = {"redis_url": redis_server.url, "gateway_id": gid, "lease_ttl_sec": 1.5,
                          "key_prefix": PREFIX}
        gws.append(await gateway(cfg))
    a, b = gws
    r = redis_server.client()
    headers = {**auth("bob"), "X-Target-Host": slow.url, "X-Concurrency-Slot": "1"}
    try:
        async with http.post(a.url + "/v1/proxy/generate", json={}, headers=headers) as resp:
            assert resp.status == 200
        running = asyncio.create_task(http.post(b.url + "/v1/proxy/generate", json={"steps": 1, "step_ms": 4000},
                                                headers=headers))
        await wait_until(lambda: slow.stats["running"] == 1, timeout=5)
        a.rt.adhoc.idle_sec = 0.1
        a.rt.adhoc._next_sweep = 0.0
        await wait_until(lambda: len(a.rt.adhoc) == 0, timeout=5)
        await asyncio.sleep(0.3)  # A's FORGET has run (and found the route in use)
        assert not running.done() and slow.stats["running"] == 1  # B's request still runs (4 s)
        route = "adhoc:" + slow.url + "#bob"
        assert await r.hget(PREFIX + "in:" + route, "adhoc:" + slow.url) == "1"
        assert await r.sismember(PREFIX + "routes", route)
        # One slot, whichever gateway asks: A's next request waits for B's to end.
        again = asyncio.create_task(http.post(a.url + "/v1/proxy/generate", json={}, headers=headers))
        resp = await running
        assert resp.status == 200
        resp.release()
        resp = await again
        assert resp.status == 200
        resp.release()
        assert slow.stats["max_concurrent"] == 1
        for g in (a, b):
            g.rt.adhoc.idle_sec = 0.1
            g.rt.adhoc._next_sweep = 0.0

        async def gone() -> bool:
            return not await adhoc_keys(r)
        await wait_until(gone, timeout=5)
    finally:
        await r.aclose()


async def test_a_route_dropped_while_redis_is_away_is_forgotten_when_it_answers(redis_server: RedisServer,
                                                                                fakegpus, gateway, http) -> None:
    target = await fakegpus(steps=1, step_ms=5)
    other = await fakegpus(steps=1, step_ms=5)
    cfg = base_config({"a": other.url})
    cfg["keys"]["bob"]["adhoc_targets"] = ["http://127.0.0.1:*"]
    cfg["cluster"] = {"redis_url": redis_server.url, "gateway_id": "gw0", "lease_ttl_sec": 1.0, "key_prefix": PREFIX}
    gw = await gateway(cfg)
    r = redis_server.client()
    try:
        async with http.post(gw.url + "/v1/proxy/generate", json={},
                             headers={**auth("bob"), "X-Target-Host": target.url}) as resp:
            assert resp.status == 200
        assert await adhoc_keys(r)
        redis_server.freeze()
        try:
            await wait_until(lambda: not gw.rt.cluster.redis_up, timeout=10)
            gw.rt.adhoc.idle_sec = 0.1
            gw.rt.adhoc._next_sweep = 0.0
            await wait_until(lambda: len(gw.rt.adhoc) == 0, timeout=5)
        finally:
            redis_server.thaw()
        await wait_until(lambda: gw.rt.cluster.redis_up, timeout=10)

        async def gone() -> bool:
            return not await adhoc_keys(r)
        await wait_until(gone, timeout=5)
    finally:
        await r.aclose()


async def test_a_route_dropped_behind_the_fence_is_forgotten_once_it_falls(redis_server: RedisServer,
                                                                          fakegpus, gateway, http) -> None:
    """While the fence stands (Redis came back empty: leases still running may not be counted
    yet) nothing is forgotten; the gateway asks again at its heartbeats until it falls."""
    target = await fakegpus(steps=1, step_ms=5)
    other = await fakegpus(steps=1, step_ms=5)
    cfg = base_config({"a": other.url})
    cfg["keys"]["bob"]["adhoc_targets"] = ["http://127.0.0.1:*"]
    cfg["cluster"] = {"redis_url": redis_server.url, "gateway_id": "gw0", "lease_ttl_sec": 1.0, "key_prefix": PREFIX}
    gw = await gateway(cfg)
    r = redis_server.client()
    try:
        async with http.post(gw.url + "/v1/proxy/generate", json={},
                             headers={**auth("bob"), "X-Target-Host": target.url}) as resp:
            assert resp.status == 200
        made = await adhoc_keys(r)
        assert made
        await r.set(PREFIX + "fence", 2**52)  # far in the future: it stands until taken down
        gw.rt.adhoc.idle_sec = 0.1
        gw.rt.adhoc._next_sweep = 0.0
        await wait_until(lambda: len(gw.rt.adhoc) == 0, timeout=5)
        await asyncio.sleep(1.0)  # three heartbeats: each asked, each was told "not now"
        assert await adhoc_keys(r) == made
        await r.delete(PREFIX + "fence")

        async def gone() -> bool:
            return not await adhoc_keys(r)
        await wait_until(gone, timeout=5)
    finally:
        await r.aclose()
