"""One websocket over several gateways (docs/CLUSTER.md, docs/API.md "ComfyUI over several GPUs"):
a browser's ``/ws?clientId=`` is on one gateway, its ``POST /prompt`` reaches another (a load
balancer spreads its requests); every event of the prompt, previews included, reaches the socket
in order, for its key alone (the admin key hears all), and a lost prompt's end reaches it too.
Real redis-server, two gateways in this process, two fake ComfyUI nodes."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from comfy_gpus import graph, hear, kinds_of, node_of, post, preview_ids
from conftest import ADMIN, auth, base_config

from kilolined.cluster.comfyws import counts_for, expired, listener_field, listeners

from .harness import RedisServer

PREFIX = "kl-cws:"


async def two_gateways(redis: RedisServer, fakegpus: Any, gateway: Any,
                       **route: Any) -> tuple[dict[str, Any], Any, Any]:
    a = await fakegpus("comfyui", step_ms=20, previews=True)
    b = await fakegpus("comfyui", step_ms=20, previews=True)
    made = []
    for gid in ("gw0", "gw1"):
        cfg = base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=1, **route)
        cfg["routes"]["gen"].update(nodes=["a", "b"], standby=[])
        cfg["cluster"] = {"redis_url": redis.url, "gateway_id": gid, "lease_ttl_sec": 2, "key_prefix": PREFIX}
        made.append(await gateway(cfg))
    return {"a": a, "b": b}, made[0], made[1]


async def quiet(ws: aiohttp.ClientWebSocketResponse) -> list[int]:
    """The socket hears nothing but the queue's count: the counts it heard."""
    counts = []
    with pytest.raises(TimeoutError):
        while (got := await ws.receive_json(timeout=0.3))["type"] == "status":
            counts.append(got["data"]["status"]["exec_info"]["queue_remaining"])
    return counts


async def until_progress(ws: aiohttp.ClientWebSocketResponse) -> list[tuple[str, Any]]:
    """The socket's text frames until the first ``progress``: the sampler runs."""
    frames: list[tuple[str, Any]] = []
    while not frames or frames[-1][0] != "progress":
        msg = await ws.receive(timeout=10)
        if msg.type == aiohttp.WSMsgType.TEXT:
            got = msg.json()
            frames.append((got["type"], got["data"]))
    return frames


async def test_a_socket_on_one_gateway_hears_a_prompt_posted_through_another(
        redis_server: RedisServer, fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    _, gw0, gw1 = await two_gateways(redis_server, fakegpus, gateway)
    url = gw0.url + "/gen/ws?clientId=page"
    async with http.ws_connect(url, headers=auth()) as ws, http.ws_connect(url, headers=auth("bob")) as bobs, \
            http.ws_connect(url, headers=ADMIN) as admins:
        for sock in (ws, bobs, admins):
            await sock.receive_json(timeout=5)
        await ws.send_json({"type": "feature_flags", "data": {"supports_preview_metadata": True}})
        assert (await ws.receive_json(timeout=5))["type"] == "feature_flags"
        pid = (await post(http, gw1, {"prompt": graph(4, 1), "client_id": "page"}))["prompt_id"]
        frames, seen_by_admin = await hear(ws, {pid}), await hear(admins, {pid})
        # another key under the same client id hears nothing of it, and counts none of it
        assert set(await quiet(bobs)) <= {0}
    kinds = kinds_of(frames, pid)
    assert kinds[0] == "execution_start" and kinds[-1] == "executing", kinds
    assert {"executing", "progress", "progress_state", "executed", "execution_success"} <= set(kinds)
    # in order: every step, then the output, then the end
    assert [d["value"] for k, d in frames if k == "progress"] == [1, 2, 3, 4]
    assert kinds.index("executed") < kinds.index("execution_success") < len(kinds) - 1
    executed = next(d for k, d in frames if k == "executed")
    assert executed["output"]["images"][0]["type"] == "output"
    # previews: with their prompt id to the socket that asked for them, plain (type 1) to the other
    assert preview_ids(frames) == [pid] * 4
    assert len([d for k, d in seen_by_admin if k == "binary" and d[:4] == b"\x00\x00\x00\x01"]) == 4
    assert kinds_of(seen_by_admin, pid) == kinds
    # the socket's queue counts the prompt the other gateway ran, and is empty at its end
    for heard in (frames, seen_by_admin):
        remaining = [d["status"]["exec_info"]["queue_remaining"] for k, d in heard if k == "status"]
        assert 1 in remaining and remaining[-1] == 0


async def test_a_lost_prompt_ends_on_a_socket_of_another_gateway(
        redis_server: RedisServer, fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    nodes, gw0, gw1 = await two_gateways(redis_server, fakegpus, gateway, retry_on_failover=0)
    async with http.ws_connect(gw0.url + "/gen/ws?clientId=page", headers=auth()) as ws:
        await ws.receive_json(timeout=5)
        pid = (await post(http, gw1, {"prompt": graph(200, 1), "client_id": "page"}))["prompt_id"]
        frames = await until_progress(ws)
        await nodes[node_of(gw1, pid)].kill()
        frames += await hear(ws, {pid})
    kinds = kinds_of(frames, pid)
    assert kinds[-2:] == ["execution_error", "executing"], kinds
    error = next(d for k, d in frames if k == "execution_error")
    assert error["node_type"] == "KSampler" and error["exception_message"].startswith("node lost")


async def test_a_prompt_re_queued_to_the_other_node_is_heard_to_its_end(
        redis_server: RedisServer, fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    nodes, gw0, gw1 = await two_gateways(redis_server, fakegpus, gateway, retry_on_failover=1)
    async with http.ws_connect(gw0.url + "/gen/ws?clientId=page", headers=auth()) as ws:
        await ws.receive_json(timeout=5)
        pid = (await post(http, gw1, {"prompt": graph(60, 1), "client_id": "page"}))["prompt_id"]
        frames = await until_progress(ws)
        first = node_of(gw1, pid)
        await nodes[first].kill()
        frames += await hear(ws, {pid})
    assert node_of(gw1, pid) != first
    kinds = kinds_of(frames, pid)
    assert kinds.count("execution_start") == 2 and "execution_error" not in kinds, kinds
    assert kinds[-2:] == ["execution_success", "executing"], kinds


def test_who_listens_leaves_out_this_gateway_and_the_gateways_gone() -> None:
    fields = {listener_field(inst, key): until for inst, key, until in (
        ("gw0#1", "alice", "2000"), ("gw0#1", "*", "2000"), ("gw1#2", "alice", "2000"), ("gw2#3", "bob", "500"),
        ("gw3#4", "carol", "junk"))} | {"not json": "2000"}
    assert listeners(fields, "gw1#2", now_ms=1000) == {"gw0#1": {"alice", "*"}}
    assert sorted(expired(fields, now_ms=1000)) == sorted([listener_field("gw2#3", "bob"),
                                                           listener_field("gw3#4", "carol")])
    assert counts_for({"alice"}, {"alice": 2, "bob": 1}) == {"alice": 2}
    assert counts_for({"bob", "*"}, {"alice": 2, "bob": 1}) == {"alice": 2, "bob": 1}


async def test_without_redis_a_socket_hears_its_own_gateways_prompts(
        redis_server: RedisServer, fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    _, gw0, _ = await two_gateways(redis_server, fakegpus, gateway)
    redis_server.kill()
    async with http.ws_connect(gw0.url + "/gen/ws?clientId=page", headers=auth()) as ws:
        await ws.receive_json(timeout=5)
        pid = (await post(http, gw0, {"prompt": graph(2, 1), "client_id": "page"}))["prompt_id"]
        kinds = kinds_of(await hear(ws, {pid}), pid)
    assert "execution_success" in kinds and kinds[-1] == "executing"
