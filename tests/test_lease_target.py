"""A lease carries its target (queue.Target): the route's and node's config as of its grant.

A reload mid-request changes what new requests get, never a running request's timeouts halfway
(docs/ARCHITECTURE.md, "Ownership").
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from conftest import ADMIN, Gateway, auth, base_config, wait_until

from kilolined.fakegpu import FakeGPU


async def test_a_reload_mid_request_does_not_move_its_timeout(
        fakegpus: Callable[..., Awaitable[FakeGPU]], gateway: Callable[..., Awaitable[Gateway]],
        http: aiohttp.ClientSession) -> None:
    gpu = await fakegpus("openai", step_ms=100)
    cfg: dict[str, Any] = base_config({"a": gpu.url}, kind="openai", path="/v1", request_timeout_sec=2)
    gw = await gateway(cfg)

    async def one() -> tuple[int, bytes]:
        # 100 tokens, 10 s, streamed: it answers at once, and runs past the route's 2 s.
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": True}
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
            return r.status, await r.read()

    running = asyncio.ensure_future(one())
    await wait_until(lambda: gpu.stats["running"] >= 1)
    longer = copy.deepcopy(cfg)
    longer["routes"]["gen"]["request_timeout_sec"] = 60
    gw.write_config(longer)
    async with http.post(gw.url + "/admin/reload", headers=ADMIN) as r:
        assert r.status == 200, await r.text()
    assert gw.rt.cfg.routes["gen"].request_timeout_sec == 60
    status, body = await asyncio.wait_for(running, 30)
    # Ended mid-stream by the timeout it was granted with, and says so.
    assert status == 200 and b"within 2s" in body, (status, body)
