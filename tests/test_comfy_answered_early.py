"""A ``POST /prompt`` that must wait in the gateway's queue is answered at once, as ComfyUI answers
a prompt it queues (docs/API.md "ComfyUI over several GPUs"): its id (the client's, or one the
gateway makes), the route's next number, no node errors. The gateway runs it from then on, as an
async job: the client may go away. It waits in ``GET /queue``'s pending list, removable by its
id, and runs on its node under that id and number. A node that refuses it ends it as ComfyUI ends
a failed prompt: an ``execution_error`` on the client's ``/ws`` and an error entry in its history.

Two fake ComfyUI nodes, one slot each: two long prompts hold both slots while the others wait."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
from comfy_files_client import img2img
from comfy_gpus import get, graph, hear, kinds_of, node_of, post
from conftest import auth, base_config, wait_until

LONG = 2000  # steps: a prompt that holds its slot until it is interrupted


async def two_busy_nodes(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession,
                         client_id: str = "page") -> tuple[dict[str, Any], Any, list[dict[str, Any]]]:
    """Two nodes of one slot each, both rendering a long prompt of alice's (answered by the nodes)."""
    a = await fakegpus("comfyui", step_ms=20)
    b = await fakegpus("comfyui", step_ms=20)
    cfg = base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=1)
    cfg["routes"]["gen"].update(nodes=["a", "b"], standby=[])
    gw = await gateway(cfg)
    long = await asyncio.gather(post(http, gw, {"prompt": graph(LONG, 1), "client_id": client_id}),
                                post(http, gw, {"prompt": graph(LONG, 2), "client_id": client_id}))
    await wait_until(lambda: a.stats["running"] == 1 and b.stats["running"] == 1)
    return {"a": a, "b": b}, gw, long


async def end_long(http: aiohttp.ClientSession, gw: Any, long: list[dict[str, Any]]) -> None:
    for x in long:
        async with http.post(gw.url + "/gen/interrupt", json={"prompt_id": x["prompt_id"]}, headers=auth()) as r:
            assert r.status == 200


async def answered(gw: Any, body: dict[str, Any], who: str = "alice") -> dict[str, Any]:
    """POST /prompt from a client that closes its connection once answered (bounded: on a
    gateway that holds the POST until a slot is free, this fails rather than hangs)."""
    async with aiohttp.ClientSession() as client:
        return await asyncio.wait_for(post(client, gw, body, who), 5)


async def test_waiting_prompts_are_answered_at_once_and_run_after(fakegpus: Any, gateway: Any,
                                                                   http: aiohttp.ClientSession) -> None:
    nodes, gw, long = await two_busy_nodes(fakegpus, gateway, http)
    given = str(uuid.uuid4())
    third = await answered(gw, {"prompt": graph(3, 3), "client_id": "page"})
    fourth = await answered(gw, {"prompt": graph(3, 4), "prompt_id": given})
    # answered while both slots still render, as ComfyUI answers a prompt it queues
    assert nodes["a"].stats["running"] == nodes["b"].stats["running"] == 1
    assert third["node_errors"] == {} and str(uuid.UUID(third["prompt_id"])) == third["prompt_id"]
    assert fourth == {"prompt_id": given, "number": fourth["number"], "node_errors": {}}
    assert fourth["number"] > third["number"] > max(x["number"] for x in long)
    waiting = [third, fourth]

    queue = await get(http, gw, "/queue", auth())
    assert {item[1] for item in queue["queue_running"]} == {x["prompt_id"] for x in long}
    assert [item[:2] for item in queue["queue_pending"]] == [[x["number"], x["prompt_id"]] for x in waiting]
    assert queue["queue_pending"][0][2] == graph(3, 3) and queue["queue_pending"][0][3]["client_id"] == "page"
    assert "client_id" not in queue["queue_pending"][1][3]
    assert await get(http, gw, "/prompt", auth()) == {"exec_info": {"queue_remaining": 4}}
    job = await get(http, gw, f"/api/jobs/{given}", auth())
    assert job["status"] == "pending" and job["priority"] == fourth["number"]
    assert await get(http, gw, "/queue", auth("bob")) == {"queue_running": [], "queue_pending": []}
    assert await get(http, gw, "/prompt", auth("bob")) == {"exec_info": {"queue_remaining": 0}}

    # the slots free up: the waiting prompts run on the nodes, under the ids and numbers given
    await end_long(http, gw, long)

    async def ran() -> bool:
        history = await get(http, gw, "/history", auth())
        return all(x["prompt_id"] in history for x in waiting)

    await wait_until(ran, timeout=10)
    for x in waiting:
        pid = x["prompt_id"]
        entry = (await get(http, gw, f"/history/{pid}", auth()))[pid]
        assert entry["status"]["status_str"] == "success" and entry["outputs"]["9"]["images"]
        assert entry["prompt"][0] == x["number"]
        assert pid in nodes[node_of(gw, pid)].backend.history  # the node ran it under that id
    assert (await get(http, gw, "/history/" + third["prompt_id"], auth()))[third["prompt_id"]]["prompt"][3][
        "client_id"] == "page"
    assert await get(http, gw, "/queue", auth()) == {"queue_running": [], "queue_pending": []}


async def test_a_prompt_answered_early_that_its_node_refuses_ends_in_an_error(fakegpus: Any, gateway: Any,
                                                                                http: aiohttp.ClientSession) -> None:
    nodes, gw, long = await two_busy_nodes(fakegpus, gateway, http)
    async with http.ws_connect(gw.url + "/gen/ws?clientId=page", headers=auth()) as ws:
        await ws.receive_json(timeout=5)
        refused = await answered(gw, {"prompt": img2img("missing.png"), "client_id": "page"})
        pid = refused["prompt_id"]
        await end_long(http, gw, long)
        frames = await hear(ws, {pid})
    kinds = kinds_of(frames, pid)
    assert kinds == ["execution_error", "executing"], kinds  # it never started
    after = [k for k, _ in frames][[k for k, _ in frames].index("execution_error"):]
    assert after[:3] == ["execution_error", "status", "executing"]
    error = next(d for k, d in frames if k == "execution_error")
    assert error["node_id"] == "1" and error["node_type"] == "LoadImage"
    assert error["exception_type"] == "prompt_outputs_failed_validation"
    assert "Invalid image file: missing.png" in error["exception_message"]
    entry = (await get(http, gw, f"/history/{pid}", auth()))[pid]
    assert entry["status"] == {"status_str": "error", "completed": False, "messages": [["execution_error", error]]}
    assert entry["prompt"][:3] == [refused["number"], pid, img2img("missing.png")] and entry["outputs"] == {}
    assert (await get(http, gw, f"/api/jobs/{pid}", auth()))["status"] == "failed"
    assert await get(http, gw, f"/history/{pid}", auth("bob")) == {}
    assert not any(pid in n.backend.history for n in nodes.values())

    # with a slot free, the same prompt is the node's to answer: its 400 and node_errors, as ComfyUI's
    await wait_until(lambda: sum(gw.rt.scheduler.node_inflight.values()) == 0)
    async with http.post(gw.url + "/gen/prompt", json={"prompt": img2img("missing.png")}, headers=auth()) as r:
        assert r.status == 400
        body = await r.json()
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert body["node_errors"]["1"]["class_type"] == "LoadImage"


async def test_a_waiting_prompt_deleted_by_its_id_never_runs(fakegpus: Any, gateway: Any,
                                                             http: aiohttp.ClientSession) -> None:
    nodes, gw, long = await two_busy_nodes(fakegpus, gateway, http)
    deleted = await answered(gw, {"prompt": graph(3, 3)})
    cancelled = await answered(gw, {"prompt": graph(3, 4)})
    kept = await answered(gw, {"prompt": graph(3, 5)})
    ids = [x["prompt_id"] for x in (deleted, cancelled, kept)]
    # another key neither sees nor removes them
    for path, body in (("/queue", {"delete": ids}), ("/queue", {"clear": True}),
                       (f"/api/jobs/{ids[1]}/cancel", {})):
        async with http.post(gw.url + "/gen" + path, json=body, headers=auth("bob")) as r:
            assert r.status == 200, path
    assert await get(http, gw, "/queue", auth("bob")) == {"queue_running": [], "queue_pending": []}
    assert [item[1] for item in (await get(http, gw, "/queue", auth()))["queue_pending"]] == ids
    # its own key removes them by the ids it was given
    async with http.post(gw.url + "/gen/queue", json={"delete": [ids[0]]}, headers=auth()) as r:
        assert r.status == 200
    async with http.post(gw.url + f"/gen/api/jobs/{ids[1]}/cancel", json={}, headers=auth()) as r:
        assert (await r.json()) == {"cancelled": True}
    assert [item[1] for item in (await get(http, gw, "/queue", auth()))["queue_pending"]] == ids[2:]

    await end_long(http, gw, long)

    async def kept_ran() -> bool:
        return ids[2] in await get(http, gw, "/history", auth())

    await wait_until(kept_ran, timeout=10)
    await wait_until(lambda: all(j.status in ("completed", "failed", "cancelled") for j in gw.jobs.jobs.values()))
    ran = {pid for n in nodes.values() for pid in n.backend.history}
    assert ids[2] in ran and not ran & set(ids[:2])
    history = await get(http, gw, "/history", auth())
    assert ids[0] not in history and ids[1] not in history
