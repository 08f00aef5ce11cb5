"""Cluster mode (docs/CLUSTER.md) with ComfyUI's user data (docs/API.md "User data"): a key's
saved workflow written through one gateway is its own through the other, on both nodes, and the
settings one page writes through one gateway and another page through the other both stay. Two
gateways, two fake ComfyUI nodes with separate user directories, a real redis-server."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
from conftest import auth

from kilolined.adapters.comfy_userdata import key_dir

from .comfy_cluster import two_gateways
from .harness import RedisServer

WF = "/gen/api/userdata/workflows%2Fmine.json"


async def call(http: aiohttp.ClientSession, method: str, url: str, who: str,
               body: bytes | None = None) -> tuple[int, Any]:
    async with http.request(method, url, data=body, headers=auth(who)) as r:
        raw = await r.read()
        return r.status, orjson.loads(raw) if raw and r.content_type.endswith("json") else raw


async def test_a_keys_user_data_is_its_own_through_every_gateway(
        redis_server: RedisServer, fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    a, b = await fakegpus("comfyui"), await fakegpus("comfyui")
    gw0, gw1 = await two_gateways(redis_server, gateway, {"a": a, "b": b})
    assert (await call(http, "POST", gw0.url + WF, "alice", b'{"v": 1}'))[0] == 200
    for node in (a, b):  # on both nodes, in alice's own directory
        assert node.backend.user.files[f"{key_dir('alice')}/workflows/mine.json"].data == b'{"v": 1}'
    assert await call(http, "GET", gw1.url + WF, "alice") == (200, {"v": 1})
    assert await call(http, "GET", gw1.url + "/gen/api/userdata?dir=workflows", "alice") == (200, ["mine.json"])
    assert (await call(http, "GET", gw1.url + WF, "bob"))[0] == 404

    # two pages of one key, each on its own gateway, store a setting each: both are kept
    assert (await call(http, "POST", gw0.url + "/gen/api/settings/Comfy.A", "alice", b'"x"'))[0] == 200
    assert (await call(http, "POST", gw1.url + "/gen/api/settings/Comfy.B", "alice", b'"y"'))[0] == 200
    for gw in (gw0, gw1):
        status, settings = await call(http, "GET", gw.url + "/gen/api/settings", "alice")
        assert status == 200 and settings == {"Comfy.A": "x", "Comfy.B": "y"}
    assert await call(http, "GET", gw1.url + "/gen/api/settings", "bob") == (200, {})
