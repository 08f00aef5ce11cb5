"""Cluster mode: the bodies a gateway holds for requests waiting in Redis's queue count against
server.max_queued_body_mb_per_key as in single mode, and a waiting request whose client left gives
its share back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from conftest import auth

from kilolined.fakegpu import FakeGPU

from .harness import GatewayProc, RedisServer, make_gateways, start_all

BODY = b'{"pad": "' + b"x" * (300 * 1024) + b'"}'  # 300 KiB: one waits within 512 KiB, two do not


pytestmark = pytest.mark.gpu(steps=1, step_ms=1)


async def test_a_keys_waiting_bodies_are_bounded_in_cluster_mode(
        redis_server: RedisServer, gateways: list[GatewayProc], gpu: FakeGPU, tmp_path: Path) -> None:
    gateways += make_gateways(1, tmp_path, redis_server.url, gpu.url, max_concurrency=1)
    gateways[0].cfg["server"]["max_queued_body_mb_per_key"] = 0.5
    await start_all(gateways)
    gw = gateways[0]
    gpu.set_control(hang=True)
    async with aiohttp.ClientSession() as s:

        async def post() -> tuple[int, str]:
            async with s.post(gw.url + "/gen/generate", data=BODY,
                              headers={**auth(), "Content-Type": "application/json"}) as r:
                return r.status, await r.text()

        async def depth_is(n: int) -> bool:
            return int((await gw.state())["routes"]["gen"]["queue_depth"]) == n

        async def until(pred: Callable[[], Awaitable[bool]], what: str) -> None:
            for _ in range(400):
                if await pred():
                    return
                await asyncio.sleep(0.025)
            raise AssertionError(what)

        async def hanging() -> bool:
            return bool(gpu.stats["hanging"] == 1)

        running = asyncio.ensure_future(post())
        await until(hanging, "the first request runs")
        waiting = asyncio.ensure_future(post())
        await until(lambda: depth_is(1), "the second waits")
        status, text = await post()
        assert status == 429 and "max_queued_body_mb_per_key" in text, text
        waiting.cancel()  # its client leaves: its body's share is given back
        await until(lambda: depth_is(0), "the second left the queue")
        waiting = asyncio.ensure_future(post())
        await until(lambda: depth_is(1), "a new one waits in its place")
        status, text = await post()
        assert status == 429, text
        gpu.set_control(hang=False)
        running.cancel()
        assert (await asyncio.wait_for(waiting, 20))[0] == 200
