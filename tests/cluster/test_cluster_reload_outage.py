"""A reload while Redis is down holds after Redis is back; a changed ``cluster:`` is refused.

The outage share is cut from the configs a reload brings, and those (not the ones from before
the outage) are what the gateway and the Lua views grant from once Redis returns.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from conftest import ADMIN, auth

from kilolined.fakegpu import FakeGPU

from .harness import GatewayProc, RedisServer, make_gateways, start_all, until

pytestmark = pytest.mark.gpu(step_ms=50)


async def reload(s: aiohttp.ClientSession, gw: GatewayProc, cfg: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    gw.path.write_text(yaml.safe_dump(cfg))
    async with s.post(gw.url + "/admin/reload", headers=ADMIN) as r:
        return r.status, await r.json()


async def burst(s: aiohttp.ClientSession, gw: GatewayProc, n: int) -> list[int]:
    async def one() -> int:
        async with s.post(gw.url + "/gen/generate", json={}, headers=auth()) as r:
            await r.read()
            return r.status
    return list(await asyncio.gather(*(one() for _ in range(n))))


async def test_a_reload_during_an_outage_holds_after_redis_returns(
        redis_server: RedisServer, gateways: list[GatewayProc], gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(1, tmp_path, redis_server.url, gpu.url, max_concurrency=4)
    await start_all(gateways)
    gw = gateways[0]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        assert await burst(s, gw, 24) == [200] * 24
        assert gpu.stats["max_concurrent"] == 4
        redis_server.kill()

        async def redis_down() -> bool:
            return (await gw.state())["cluster"]["redis"] == "down"

        await until(redis_down, "the gateway never noticed Redis was gone")
        cfg = {**gw.cfg, "routes": {"gen": {**gw.cfg["routes"]["gen"], "max_concurrency": 2}}}
        status, body = await reload(s, gw, cfg)
        assert status == 200, body
        gpu.reset()
        assert await burst(s, gw, 16) == [200] * 16
        assert gpu.stats["max_concurrent"] == 2  # alone, its share of the new N (1 of 1 gateway)
        redis_server.start()

        async def redis_up() -> bool:
            return (await gw.state())["cluster"]["redis"] == "up"

        await until(redis_up, "the gateway never came back to Redis")
        gpu.reset()
        assert await burst(s, gw, 24) == [200] * 24
        assert gpu.stats["max_concurrent"] == 2, "Redis' return brought back the N from before the reload"


async def test_a_changed_cluster_section_is_refused_on_reload(
        redis_server: RedisServer, gateways: list[GatewayProc], gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(1, tmp_path, redis_server.url, gpu.url)
    await start_all(gateways)
    gw = gateways[0]
    async with aiohttp.ClientSession() as s:
        before = (await gw.state())["config"]
        cfg = {**gw.cfg, "cluster": {**gw.cfg["cluster"], "lease_ttl_sec": 9}}
        cfg["routes"] = {"gen": {**gw.cfg["routes"]["gen"], "max_concurrency": 1}}
        status, body = await reload(s, gw, cfg)
        assert status in (400, 409, 422), body
        assert "restart" in str(body), body
        after = (await gw.state())["config"]
        assert after["version"] == before["version"]  # nothing of the file was applied
