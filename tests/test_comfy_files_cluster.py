"""Cluster mode (docs/CLUSTER.md): a ComfyUI input uploaded through one gateway is held in Redis
for the others, so the prompt that uses it may reach any gateway."""

from __future__ import annotations

from typing import Any

import aiohttp
from cluster_harness import RedisServer, redis_server
from conftest import auth, base_config, wait_until
from test_comfy_files import img2img, upload

from kilolined.fakegpu.comfy_graph import make_png

__all__ = ["redis_server"]  # fixtures
PREFIX = "kl-cf:"


async def two_gateways(redis: RedisServer, gateway: Any, node: Any) -> list[Any]:
    made = []
    for gid in ("gw0", "gw1"):
        cfg = base_config({"a": node.url}, kind="comfyui", max_concurrency=1)
        cfg["cluster"] = {"redis_url": redis.url, "gateway_id": gid, "lease_ttl_sec": 2, "key_prefix": PREFIX}
        made.append(await gateway(cfg))
    return made


async def test_an_upload_on_one_gateway_serves_a_prompt_on_another(redis_server: RedisServer, fakegpus: Any,
                                                                   gateway: Any,
                                                                   http: aiohttp.ClientSession) -> None:
    node = await fakegpus("comfyui", steps=1, step_ms=5)
    gw0, gw1 = await two_gateways(redis_server, gateway, node)
    png = make_png("cat")
    assert (await upload(http, gw0.url, "cat.png", png))["name"] == "cat.png"
    # The other gateway renames a clash as the first would, and serves the file.
    assert (await upload(http, gw1.url, "cat.png", make_png("dog")))["name"] == "cat (1).png"
    async with http.get(gw1.url + "/gen/view", params={"filename": "cat.png", "type": "input"},
                        headers=auth()) as r:
        assert r.status == 200 and await r.read() == png
    async with http.get(gw1.url + "/gen/view", params={"filename": "cat.png", "type": "input"},
                        headers=auth("bob")) as r:
        assert r.status == 404
    async with http.post(gw1.url + "/gen/prompt", json={"prompt": img2img("cat.png")}, headers=auth()) as r:
        assert r.status == 200, await r.text()
    await wait_until(lambda: node.stats["served"] == 1)
    assert node.backend.images[("input", "", "cat.png")] == png
