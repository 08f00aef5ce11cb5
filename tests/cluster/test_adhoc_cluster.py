"""/v1/proxy's ad-hoc targets in cluster mode (docs/API.md#v1proxy, docs/CLUSTER.md): what a
route made for a client-named target writes into Redis goes with the route. Clients name targets
freely; each gateway bounds what it keeps for them (kilolined/ops/adhoc.py), and Redis, shared
and long-lived, must not keep the rest: a key that walks through targets would otherwise grow it
without end."""

from __future__ import annotations

import asyncio
from typing import Any

from conftest import auth, base_config, wait_until

from .harness import RedisServer

PREFIX = "kl-ah:"


async def adhoc_keys(r: Any) -> list[str]:
    return sorted(k for k in await r.keys(PREFIX + "*") if ":adhoc:" in k) + [
        f"nin {n}" for n in await r.hkeys(PREFIX + "nin") if n.startswith("adhoc:")] + [
        f"routes {m}" for m in await r.smembers(PREFIX + "routes") if m.startswith("adhoc:")]


async def no_adhoc_keys(r: Any) -> None:
    async def gone() -> bool:
        return not await adhoc_keys(r)
    await wait_until(gone, timeout=5)


async def cluster_gateway(redis: RedisServer, fakegpus: Any, gateway: Any, gid: str = "gw0",
                          ttl: float = 1.0) -> Any:
    """A gateway of the cluster whose key ``bob`` may name any loopback target."""
    cfg = base_config({"a": (await fakegpus(steps=1, step_ms=5)).url})
    cfg["keys"]["bob"]["adhoc_targets"] = ["http://127.0.0.1:*"]
    cfg["cluster"] = {"redis_url": redis.url, "gateway_id": gid, "lease_ttl_sec": ttl, "key_prefix": PREFIX}
    return await gateway(cfg)


async def proxied(http: Any, gw: Any, target: Any, **body: Any) -> None:
    async with http.post(gw.url + "/v1/proxy/generate", json=body,
                         headers={**auth("bob"), "X-Target-Host": target.url, "X-Concurrency-Slot": "1"}) as resp:
        assert resp.status == 200, await resp.text()


def go_idle(gw: Any, after: float = 0.1) -> None:
    """Its ad-hoc routes dropped once idle ``after`` seconds, from the next sweep on."""
    gw.rt.adhoc.idle_sec = after
    gw.rt.adhoc._next_sweep = 0.0


async def test_an_idle_adhoc_route_leaves_nothing_in_redis(redis_server: RedisServer, fakegpus, gateway,
                                                           http) -> None:
    targets = [await fakegpus(steps=1, step_ms=5) for _ in range(2)]
    gw = await cluster_gateway(redis_server, fakegpus, gateway, ttl=1.5)
    r = redis_server.client()
    try:
        await asyncio.gather(*(proxied(http, gw, g) for g in targets for _ in range(3)))
        assert len(gw.rt.adhoc) == 2
        assert await adhoc_keys(r), "the ad-hoc routes were never in Redis: this test would prove nothing"
        # Idle: dropped by this gateway, and its keys from Redis with it.
        go_idle(gw, 0.2)
        await wait_until(lambda: len(gw.rt.adhoc) == 0, timeout=5)
        await no_adhoc_keys(r)
        # The same target again: a route made afresh, served, and counted in Redis again.
        await proxied(http, gw, targets[0])
        assert await adhoc_keys(r)
    finally:
        await r.aclose()


async def test_a_route_another_gateway_runs_on_keeps_its_keys(redis_server: RedisServer, fakegpus, gateway,
                                                              http) -> None:
    """Gateway A drops its idle route for (bob, T) while gateway B runs bob's request on T: Redis
    keeps the route's counts (B's lease is one of them), B's request ends well, and the keys go
    once B drops the route too."""
    slow = await fakegpus(steps=1, step_ms=5)
    a = await cluster_gateway(redis_server, fakegpus, gateway, "gwa", ttl=1.5)
    b = await cluster_gateway(redis_server, fakegpus, gateway, "gwb", ttl=1.5)
    r = redis_server.client()
    try:
        await proxied(http, a, slow)
        running = asyncio.create_task(proxied(http, b, slow, steps=1, step_ms=4000))
        await wait_until(lambda: slow.stats["running"] == 1, timeout=5)
        go_idle(a)
        await wait_until(lambda: len(a.rt.adhoc) == 0, timeout=5)
        await asyncio.sleep(0.3)  # A's FORGET has run (and found the route in use)
        assert not running.done() and slow.stats["running"] == 1  # B's request still runs (4 s)
        route = "adhoc:" + slow.url + "#bob"
        assert await r.hget(PREFIX + "in:" + route, "adhoc:" + slow.url) == "1"
        assert await r.sismember(PREFIX + "routes", route)
        # One slot, whichever gateway asks: A's next request waits for B's to end.
        await asyncio.gather(running, proxied(http, a, slow))
        assert slow.stats["max_concurrent"] == 1
        go_idle(a)
        go_idle(b)
        await no_adhoc_keys(r)
    finally:
        await r.aclose()


async def test_a_route_dropped_while_redis_is_away_is_forgotten_when_it_answers(redis_server: RedisServer,
                                                                                fakegpus, gateway, http) -> None:
    target = await fakegpus(steps=1, step_ms=5)
    gw = await cluster_gateway(redis_server, fakegpus, gateway)
    r = redis_server.client()
    try:
        await proxied(http, gw, target)
        assert await adhoc_keys(r)
        redis_server.freeze()
        try:
            await wait_until(lambda: not gw.rt.cluster.redis_up, timeout=10)
            go_idle(gw)
            await wait_until(lambda: len(gw.rt.adhoc) == 0, timeout=5)
        finally:
            redis_server.thaw()
        await wait_until(lambda: gw.rt.cluster.redis_up, timeout=10)
        await no_adhoc_keys(r)
    finally:
        await r.aclose()


async def test_a_route_dropped_behind_the_fence_is_forgotten_once_it_falls(redis_server: RedisServer,
                                                                          fakegpus, gateway, http) -> None:
    """While the fence stands (Redis came back empty: leases still running may not be counted
    yet) nothing is forgotten; the gateway asks again at its heartbeats until it falls."""
    target = await fakegpus(steps=1, step_ms=5)
    gw = await cluster_gateway(redis_server, fakegpus, gateway)
    r = redis_server.client()
    try:
        await proxied(http, gw, target)
        made = await adhoc_keys(r)
        assert made
        await r.set(PREFIX + "fence", 2**52)  # far in the future: it stands until taken down
        go_idle(gw)
        await wait_until(lambda: len(gw.rt.adhoc) == 0, timeout=5)
        await asyncio.sleep(1.0)  # three heartbeats: each asked, each was told "not now"
        assert await adhoc_keys(r) == made
        await r.delete(PREFIX + "fence")
        await no_adhoc_keys(r)
    finally:
        await r.aclose()
