"""Cluster mode (docs/CLUSTER.md): a ``POST /prompt`` answered early by one gateway (every slot of
the cluster busy) is in every gateway's ``GET /queue``, and a client deletes it through another
gateway than the one holding it: it never runs. Two gateways, one fake ComfyUI node, a real
redis-server."""

from __future__ import annotations

from typing import Any

import aiohttp
from comfy_gpus import get, graph, post
from conftest import auth, wait_until

from .comfy_cluster import two_gateways
from .harness import RedisServer


async def pending(http: aiohttp.ClientSession, gw: Any, who: str = "alice") -> list[list[Any]]:
    return list((await get(http, gw, "/queue", auth(who)))["queue_pending"])


async def test_a_prompt_in_one_gateways_queue_is_listed_and_deleted_through_the_other(
        redis_server: RedisServer, fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    node = await fakegpus("comfyui", step_ms=20)
    gw0, gw1 = await two_gateways(redis_server, gateway, {"a": node})
    long = await post(http, gw0, {"prompt": graph(2000, 1)})  # the cluster's only slot
    await wait_until(lambda: node.stats["running"] == 1)
    gone = await post(http, gw0, {"prompt": graph(3, 2), "client_id": "page"})  # answered at once
    kept = await post(http, gw0, {"prompt": graph(3, 3)})
    ids = [gone["prompt_id"], kept["prompt_id"]]

    async def listed_on_gw1() -> bool:
        return [item[1] for item in await pending(http, gw1)] == ids

    await wait_until(listed_on_gw1)
    item = (await pending(http, gw1))[0]
    assert item[0] == gone["number"] and item[2] == graph(3, 2) and item[3]["client_id"] == "page"
    assert [item[1] for item in await pending(http, gw0)] == ids  # once, though it is in Redis too
    assert await pending(http, gw1, "bob") == []
    assert (await get(http, gw1, f"/api/jobs/{ids[0]}", auth()))["status"] == "pending"

    async with http.post(gw1.url + "/gen/queue", json={"delete": [ids[0]]}, headers=auth("bob")) as r:
        assert r.status == 200  # another key's delete leaves it
    assert len(await pending(http, gw1)) == 2
    async with http.post(gw1.url + "/gen/queue", json={"delete": [ids[0]]}, headers=auth()) as r:
        assert r.status == 200
    assert [item[1] for item in await pending(http, gw1)] == ids[1:]

    async with http.post(gw0.url + "/gen/interrupt", json={"prompt_id": long["prompt_id"]}, headers=auth()) as r:
        assert r.status == 200

    async def kept_ran() -> bool:
        return ids[1] in await get(http, gw1, "/history", auth())

    await wait_until(kept_ran, timeout=10)
    await wait_until(lambda: all(j.status in ("completed", "failed", "cancelled") for j in gw0.jobs.jobs.values()))
    assert ids[1] in node.backend.history and ids[0] not in node.backend.history  # the deleted one never ran
    assert ids[0] not in await get(http, gw0, "/history", auth())
    assert await pending(http, gw0) == await pending(http, gw1) == []
