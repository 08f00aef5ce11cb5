"""Cluster mode (docs/CLUSTER.md): a ComfyUI input uploaded through one gateway is held in Redis
for the others, so the prompt that uses it may reach any gateway."""

from __future__ import annotations

from typing import Any

import aiohttp
from comfy_files_client import images, img2img, run_job, upload, view
from conftest import auth, base_config, wait_until

from kilolined.fakegpu.comfy_graph import make_png

from .harness import RedisServer

PREFIX = "kl-cf:"


async def two_gateways(redis: RedisServer, gateway: Any, node: Any, **comfy: Any) -> list[Any]:
    made = []
    for gid in ("gw0", "gw1"):
        cfg = base_config({"a": node.url}, kind="comfyui", max_concurrency=1)
        if comfy:
            cfg["routes"]["gen"]["comfy"] = comfy
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


async def test_an_output_made_through_one_gateway_is_served_by_another_from_redis(
        redis_server: RedisServer, fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    """No bucket: outputs are in Redis, so /view on any gateway serves them after their node is gone."""
    node = await fakegpus("comfyui", steps=1, step_ms=5)
    gw0, gw1 = await two_gateways(redis_server, gateway, node)
    name = (await upload(http, gw0.url, "cat.png", make_png("cat")))["name"]
    out = images(await run_job(http, gw0, img2img(name)))[0]
    await wait_until(lambda: gw0.rt.adapter_state["comfyfiles"].copies == 0)
    status, made = await view(http, gw0, out)
    assert status == 200 and made.startswith(b"\x89PNG")
    await node.kill()
    assert await view(http, gw1, out) == (200, made)
    assert (await view(http, gw1, out, who="bob"))[0] == 404
    # Payloads are in Redis, not the gateways' memory.
    assert gw0.rt.adapter_state["comfyfiles"].files("gen").held().bytes == len(make_png("cat"))


async def test_outputs_in_redis_are_bounded_cluster_wide(redis_server: RedisServer, fakegpus: Any, gateway: Any,
                                                         http: aiohttp.ClientSession) -> None:
    """``max_files_mb`` holds over the cluster: the oldest outputs are dropped for newer ones
    made through the other gateway (each output here is ~230 bytes: two fit in 600)."""
    node = await fakegpus("comfyui", steps=1, step_ms=5)
    gw0, gw1 = await two_gateways(redis_server, gateway, node, max_files_mb=600 / 1024 / 1024)
    outs = []
    for gw, who in ((gw0, "cat"), (gw1, "dog"), (gw0, "owl"), (gw1, "elk")):
        name = (await upload(http, gw.url, f"{who}.png", make_png(who)))["name"]
        outs.append(images(await run_job(http, gw, img2img(name, prefix=who)))[0])
        await wait_until(lambda gw=gw: gw.rt.adapter_state["comfyfiles"].copies == 0)
    await node.kill()
    assert [(await view(http, gw0, o))[0] for o in outs] == [404, 404, 200, 200]
    redis = redis_server.client()
    assert 0 < int(await redis.get(f"{PREFIX}comfyout:gen:bytes")) <= 600
    await redis.aclose()


async def test_two_gateways_never_give_one_name_to_two_outputs(redis_server: RedisServer, fakegpus: Any,
                                                               gateway: Any, http: aiohttp.ClientSession) -> None:
    """Each gateway's node writes kl_00001_.png: the route names are reserved in Redis, so the
    second is kl_00002_.png and both are served, from either gateway, after their nodes are gone."""
    a = await fakegpus("comfyui", steps=1, step_ms=5)
    b = await fakegpus("comfyui", steps=1, step_ms=5)
    gws = []
    for gid, node in (("gw0", a), ("gw1", b)):
        cfg = base_config({gid + "-node": node.url}, kind="comfyui", max_concurrency=1)
        cfg["cluster"] = {"redis_url": redis_server.url, "gateway_id": gid, "lease_ttl_sec": 2, "key_prefix": PREFIX}
        gws.append(await gateway(cfg))
    outs, made = [], []
    for gw, who in zip(gws, ("cat", "dog"), strict=True):
        name = (await upload(http, gw.url, f"{who}.png", make_png(who)))["name"]
        outs.append(images(await run_job(http, gw, img2img(name, prefix="kl")))[0])
        await wait_until(lambda gw=gw: gw.rt.adapter_state["comfyfiles"].copies == 0)
        made.append((await view(http, gw, outs[-1]))[1])
    assert [o["filename"] for o in outs] == ["kl_00001_.png", "kl_00002_.png"]
    assert made[0] != made[1]
    await a.kill()
    await b.kill()
    for gw in gws:
        assert [await view(http, gw, o) for o in outs] == [(200, made[0]), (200, made[1])]


async def test_history_of_a_prompt_sent_through_another_gateway(redis_server: RedisServer, fakegpus: Any,
                                                                gateway: Any, http: aiohttp.ClientSession) -> None:
    """``/history/{id}`` on any gateway: the entry as its client was given it, its key's alone."""
    node = await fakegpus("comfyui", steps=1, step_ms=5)
    gw0, gw1 = await two_gateways(redis_server, gateway, node)
    name = (await upload(http, gw0.url, "cat.png", make_png("cat")))["name"]
    async with http.post(gw0.url + "/gen/prompt", json={"prompt": img2img(name), "client_id": "mine"},
                         headers=auth()) as r:
        assert r.status == 200, await r.text()
        pid = (await r.json())["prompt_id"]

    async def entry(gw: Any, who: str = "alice") -> dict[str, Any]:
        async with http.get(gw.url + f"/gen/history/{pid}", headers=auth(who)) as r:
            assert r.status == 200
            return dict(await r.json())

    await wait_until(lambda: gw0.rt.adapter_state["comfyfiles"].copies == 0 and node.stats["served"] == 1)
    mine = (await entry(gw0))[pid]
    await wait_until(lambda: entry(gw1))  # written once the prompt's end is handled
    there = (await entry(gw1))[pid]
    assert there["outputs"] == mine["outputs"] and there["prompt"][3]["client_id"] == "mine"
    assert await entry(gw1, "bob") == {}
    async with http.get(gw1.url + f"/gen/api/jobs/{pid}", headers=auth()) as r:
        assert r.status == 200 and (await r.json())["status"] == "completed"
    async with http.get(gw1.url + f"/gen/api/jobs/{pid}", headers=auth("bob")) as r:
        assert r.status == 404
    # Deleted from the history where it was sent: gone from every gateway's; its file stays.
    async with http.post(gw0.url + "/gen/history", json={"delete": [pid]}, headers=auth()) as r:
        assert r.status == 200
    assert await entry(gw1) == {}
    await node.kill()
    status, data = await view(http, gw1, images(there)[0])
    assert status == 200 and data.startswith(b"\x89PNG")
