"""A prompt a client deletes from its node's queue ends there, as in ComfyUI: it never runs (not
even re-queued to another node, which is what the gateway does with a prompt that vanished from
a node that restarted), its slot is freed, a job ends ``cancelled``, and it has no history entry
(ComfyUI writes none for a prompt deleted before it ran). And a job that fails or is interrupted
on its node is in the route's history and jobs list as ComfyUI lists it (docs/API.md "ComfyUI
over several GPUs"). One gateway, and two over a real Redis with the delete sent through the
gateway that does not hold the prompt."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from comfy_client import ASYNC
from comfy_gpus import get, graph
from conftest import auth, base_config, wait_until

from kilolined.adapters.comfy_control import comfy_state

from .comfy_cluster import two_gateways
from .harness import RedisServer

DELETES = [("/queue", {"delete": ["{pid}"]}), ("/queue", {"clear": True}), ("/api/jobs/{pid}/cancel", {}),
           ("/api/jobs/cancel", {"job_ids": ["{pid}"]})]
HOW = ["delete", "clear", "cancel", "cancel_many"]


async def submit(http: aiohttp.ClientSession, gw: Any, body: dict[str, Any], mode: str) -> str | None:
    """The prompt id of a sync prompt; None for a job (its id is read from the queue)."""
    async with http.post(gw.url + "/gen/prompt", json=body,
                         headers={**auth(), **(ASYNC if mode == "async" else {})}) as r:
        assert r.status in (200, 202), await r.text()
        doc = await r.json()
    return doc["prompt_id"] if mode == "sync" else doc["job_id"]


async def pending_ids(http: aiohttp.ClientSession, gw: Any) -> list[str]:
    return [item[1] for item in (await get(http, gw, "/queue", auth()))["queue_pending"]]


async def delete(http: aiohttp.ClientSession, gw: Any, how: tuple[str, dict[str, Any]], pid: str) -> None:
    path, body = how
    filled = {k: [pid] if v == ["{pid}"] else v for k, v in body.items()}
    async with http.post(gw.url + "/gen" + path.replace("{pid}", pid), json=filled, headers=auth()) as r:
        assert r.status == 200, await r.text()


def ended(gw: Any, pid: str) -> bool:
    p = comfy_state(gw.rt).owners("gen").get(pid)
    assert p is not None
    return p.ended


def served(*nodes: Any) -> int:
    return sum(int(n.stats["served"]) for n in nodes)


async def stop_all(http: aiohttp.ClientSession, nodes: list[Any], gws: list[Any]) -> None:
    async def idle() -> bool:  # nothing left running for the gateways to wait for when they stop
        for node in nodes:
            async with http.post(node.url + "/interrupt", json={}):
                pass
        return all(sum(gw.rt.scheduler.node_inflight.values()) == 0 for gw in gws)

    await wait_until(idle, step=0.1)


@pytest.mark.parametrize("how", DELETES, ids=HOW)
@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_prompt_deleted_from_its_nodes_queue_never_runs(fakegpus: Any, gateway: Any,
                                                                http: aiohttp.ClientSession, mode: str,
                                                                how: tuple[str, dict[str, Any]]) -> None:
    a = await fakegpus("comfyui", step_ms=20, parallel=1)  # the node's own queue holds the second
    b = await fakegpus("comfyui", step_ms=20)  # a standby it could be re-queued to
    gw = await gateway(base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=2))
    async with http.ws_connect(gw.url + "/gen/ws?clientId=page", headers=auth()) as ws:
        await submit(http, gw, {"prompt": graph(2000, 1)}, "sync")
        job = await submit(http, gw, {"prompt": graph(3, 2), "client_id": "page"}, mode)
        await wait_until(lambda: a.stats["pending"] == 1)
        [pid] = await pending_ids(http, gw)
        await delete(http, gw, how, pid)
        await wait_until(lambda: ended(gw, pid))
        frames: list[tuple[str, Any]] = []
        counts: list[int] = []
        while 2 not in counts or counts[-1] != 1:  # the page hears the route's queue shrink, 2 → 1
            got = await ws.receive_json(timeout=5)
            if got["type"] == "status":
                counts.append(got["data"]["status"]["exec_info"]["queue_remaining"])
            data = got["data"]
            frames.append(("status", data["status"]["exec_info"]["queue_remaining"]) if got["type"] == "status"
                          else (got["type"], data.get("prompt_id")))
    assert [f for f in frames if f[1] == pid] == []  # and nothing else of it: it never ran
    assert sum(gw.rt.scheduler.node_inflight.values()) == 1  # its slot is free; the first holds its own
    assert await get(http, gw, f"/history/{pid}", auth()) == {}
    assert await pending_ids(http, gw) == []
    if mode == "async":
        await wait_until(lambda: gw.jobs.jobs[job].status == "cancelled")
    await stop_all(http, [a, b], [gw])
    assert served(a, b) == 0  # neither there nor anywhere else


@pytest.mark.parametrize("how", DELETES, ids=HOW)
@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_prompt_deleted_through_the_other_gateway_never_runs(
        redis_server: RedisServer, fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, mode: str,
        how: tuple[str, dict[str, Any]]) -> None:
    a = await fakegpus("comfyui", step_ms=20, parallel=1)
    b = await fakegpus("comfyui", step_ms=20, parallel=1)
    gw0, gw1 = await two_gateways(redis_server, gateway, {"a": a, "b": b}, max_concurrency=2)
    await submit(http, gw0, {"prompt": graph(2000, 1)}, "sync")
    await submit(http, gw0, {"prompt": graph(2000, 2)}, "sync")  # one on each node: the third waits on one
    job = await submit(http, gw0, {"prompt": graph(3, 3)}, mode)
    await wait_until(lambda: a.stats["pending"] + b.stats["pending"] == 1)

    async def on_gw1() -> list[str]:
        return await pending_ids(http, gw1)

    await wait_until(on_gw1)
    [pid] = await on_gw1()
    await delete(http, gw1, how, pid)
    await wait_until(lambda: ended(gw0, pid))
    assert sum(gw0.rt.scheduler.node_inflight.values()) == 2
    for gw in (gw0, gw1):
        assert await get(http, gw, f"/history/{pid}", auth()) == {}
    if mode == "async":
        await wait_until(lambda: gw0.jobs.jobs[job].status == "cancelled")
    await stop_all(http, [a, b], [gw0, gw1])
    assert served(a, b) == 0


@pytest.mark.parametrize("how", ["fails", "interrupted"])
async def test_a_job_that_fails_or_is_interrupted_is_in_the_history(fakegpus: Any, gateway: Any,
                                                                    http: aiohttp.ClientSession, how: str) -> None:
    node = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"a": node.url}, kind="comfyui"))
    prompt = graph(3 if how == "fails" else 2000, 1)
    if how == "fails":
        prompt["8"] = {"class_type": "FailNode", "inputs": {"message": "sampler exploded", "x": ["3", 0]}}
    job = await submit(http, gw, {"prompt": prompt}, "async")
    if how == "interrupted":
        await wait_until(lambda: node.stats["running"] == 1)
        async with http.post(gw.url + "/gen/interrupt", json={}, headers=auth()) as r:
            assert r.status == 200
    await wait_until(lambda: gw.jobs.jobs[job].status in ("failed", "cancelled"))
    assert gw.jobs.jobs[job].status == ("failed" if how == "fails" else "cancelled")
    history = await get(http, gw, "/history", auth())
    [(pid, entry)] = history.items()
    assert entry["status"]["status_str"] == "error"
    end = "execution_error" if how == "fails" else "execution_interrupted"
    assert end in [m[0] for m in entry["status"]["messages"]]
    jobs = (await get(http, gw, "/api/jobs", auth()))["jobs"]
    assert [(j["id"], j["status"]) for j in jobs] == [(pid, "failed" if how == "fails" else "cancelled")]


async def test_a_failed_job_is_in_the_other_gateways_history(redis_server: RedisServer, fakegpus: Any,
                                                             gateway: Any, http: aiohttp.ClientSession) -> None:
    node = await fakegpus("comfyui", step_ms=20)
    gw0, gw1 = await two_gateways(redis_server, gateway, {"a": node})
    prompt = graph(3, 1)
    prompt["8"] = {"class_type": "FailNode", "inputs": {"message": "sampler exploded", "x": ["3", 0]}}
    job = await submit(http, gw0, {"prompt": prompt}, "async")
    await wait_until(lambda: gw0.jobs.jobs[job].status == "failed")

    async def listed() -> dict[str, Any]:
        return dict(await get(http, gw1, "/history", auth()))

    await wait_until(listed)
    [(pid, entry)] = (await listed()).items()
    assert entry["status"]["status_str"] == "error" and "traceback" not in str(entry)
    assert [(j["id"], j["status"]) for j in (await get(http, gw1, "/api/jobs", auth()))["jobs"]] == [(pid, "failed")]


@pytest.mark.parametrize("how", DELETES, ids=HOW)
@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_prompt_waiting_in_the_gateways_queue_is_removed_by_its_key(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, mode: str, how: tuple[str, dict[str, Any]]) -> None:
    node = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"a": node.url}, kind="comfyui", max_concurrency=1))
    await submit(http, gw, {"prompt": graph(2000, 1)}, "sync")  # holds the only slot
    pid = "4f4c3b9e-1a5f-4d1e-9d2b-0c8c2f5e7a10"  # its own prompt id, as ComfyUI's API allows
    waiting = asyncio.ensure_future(submit(http, gw, {"prompt": graph(3, 2), "prompt_id": pid}, mode))
    queue = gw.rt.scheduler.routes["gen"].waiting
    await wait_until(lambda: len(queue) == 1)
    async with http.post(gw.url + "/gen/queue", json={"clear": True}, headers=auth("bob")) as r:
        assert r.status == 200  # another key's clear leaves it
    assert len(queue) == 1
    await delete(http, gw, how, pid)
    answer = await asyncio.wait_for(waiting, 10)  # a sync POST was answered at once, with the id it gave
    if mode == "sync":
        assert answer == pid
    else:
        await wait_until(lambda: gw.jobs.jobs[answer].status == "cancelled")
    assert len(queue) == 0 and "gen" not in comfy_state(gw.rt).queued  # its place is free
    await stop_all(http, [node], [gw])
    assert served(node) == 0 and await get(http, gw, f"/history/{pid}", auth()) == {}


async def test_a_job_cancelled_by_its_client_while_it_runs_is_in_the_history(fakegpus: Any, gateway: Any,
                                                                              http: aiohttp.ClientSession) -> None:
    node = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"a": node.url}, kind="comfyui"))
    job = await submit(http, gw, {"prompt": graph(2000, 1)}, "async")
    await wait_until(lambda: node.stats["running"] == 1)
    async with http.delete(gw.url + f"/v1/jobs/{job}", headers=auth()) as r:
        assert r.status == 200 and (await r.json())["status"] == "cancelled"

    async def listed() -> dict[str, Any]:
        return dict(await get(http, gw, "/history", auth()))

    await wait_until(listed)  # interrupted on its node: ComfyUI lists it so
    [(pid, entry)] = (await listed()).items()
    assert "execution_interrupted" in [m[0] for m in entry["status"]["messages"]]
    assert [(j["id"], j["status"]) for j in (await get(http, gw, "/api/jobs", auth()))["jobs"]] == [(pid, "cancelled")]
