"""Cluster mode (docs/CLUSTER.md): a ComfyUI route's history, queue and jobs lists, its control
endpoints and its jobs' files are the same on every gateway of one Redis: two gateways, two
fake ComfyUI nodes, a real redis-server. Each gateway writes its own prompts to Redis
(cluster/comfylists.py); with that path off, the other gateway knows nothing of them and every
test here fails."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from comfy_files_client import ASYNC, img2img, upload
from comfy_gpus import graph
from conftest import ADMIN, auth, wait_until

from kilolined.cluster.comfylists import SharedLists
from kilolined.fakegpu.comfy_graph import make_png

from .comfy_cluster import two_gateways
from .harness import RedisServer


async def post(http: aiohttp.ClientSession, gw: Any, body: dict[str, Any], who: str = "alice") -> dict[str, Any]:
    async with http.post(gw.url + "/gen/prompt", json=body, headers=auth(who)) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


async def get(http: aiohttp.ClientSession, gw: Any, path: str, headers: dict[str, str]) -> Any:
    async with http.get(gw.url + "/gen" + path, headers=headers) as r:
        assert r.status == 200, (path, r.status, await r.text())
        return await r.json()


async def control(http: aiohttp.ClientSession, gw: Any, path: str, body: dict[str, Any], who: str) -> Any:
    async with http.post(gw.url + "/gen" + path, json=body, headers=auth(who)) as r:
        assert r.status == 200, (path, r.status, await r.text())
        return await r.json() if r.content_type == "application/json" else None


def running(fakes: list[Any]) -> int:
    return sum(int(f.stats["running"]) for f in fakes)


async def test_a_prompt_through_one_gateway_is_in_the_others_queue_jobs_and_history(
        redis_server: RedisServer, fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    a = await fakegpus("comfyui", step_ms=20)
    b = await fakegpus("comfyui", step_ms=20)
    gw0, gw1 = await two_gateways(redis_server, gateway, {"a": a, "b": b})
    long = await post(http, gw0, {"prompt": graph(2000, 1), "client_id": "mine"})
    pid = long["prompt_id"]
    await wait_until(lambda: running([a, b]) == 1)

    # The queue, as ComfyUI's: under the number and the client id the client was given.
    async def on_gw1_queue() -> bool:
        return bool((await get(http, gw1, "/queue", auth()))["queue_running"])

    await wait_until(on_gw1_queue)
    queue = await get(http, gw1, "/queue", auth())
    assert [item[1] for item in queue["queue_running"]] == [pid] and queue["queue_pending"] == []
    item = queue["queue_running"][0]
    assert item[0] == long["number"] and item[3]["client_id"] == "mine"
    assert await get(http, gw1, "/api/queue", auth()) == queue
    assert await get(http, gw1, "/queue", ADMIN) == queue
    assert await get(http, gw1, "/queue", auth("bob")) == {"queue_running": [], "queue_pending": []}
    assert await get(http, gw1, "/prompt", auth()) == {"exec_info": {"queue_remaining": 1}}
    assert await get(http, gw1, "/prompt", auth("bob")) == {"exec_info": {"queue_remaining": 0}}
    jobs = await get(http, gw1, "/api/jobs", auth())
    assert [(j["id"], j["status"], j["priority"]) for j in jobs["jobs"]] == [(pid, "in_progress", long["number"])]
    assert (await get(http, gw1, "/api/jobs", auth("bob")))["jobs"] == []
    assert [j["id"] for j in (await get(http, gw1, "/api/jobs", ADMIN))["jobs"]] == [pid]
    assert (await get(http, gw1, f"/api/jobs/{pid}", auth()))["status"] == "in_progress"
    async with http.get(gw1.url + f"/gen/api/jobs/{pid}", headers=auth("bob")) as r:
        assert r.status == 404

    # Stopped through the other gateway: by its key only.
    for path, body in (("/interrupt", {"prompt_id": pid}), ("/interrupt", {}), (f"/api/jobs/{pid}/cancel", {})):
        await control(http, gw1, path, body, "bob")
    assert a.stats["interrupts"] + b.stats["interrupts"] == 0
    await control(http, gw1, "/interrupt", {"prompt_id": pid}, "alice")
    await wait_until(lambda: a.stats["interrupts"] + b.stats["interrupts"] == 1)

    # Its history, then a second prompt's after it, in the order they ended.
    short = await post(http, gw0, {"prompt": graph(3, 2), "client_id": "mine"})
    both = [pid, short["prompt_id"]]

    async def ended_on_gw1() -> bool:
        return list(await get(http, gw1, "/history", auth())) == both

    await wait_until(ended_on_gw1)
    history = await get(http, gw1, "/history", auth())
    assert history == await get(http, gw0, "/history", auth())
    assert [history[p]["status"]["status_str"] for p in both] == ["error", "success"]
    assert history[short["prompt_id"]]["prompt"][0] == short["number"]
    assert history[short["prompt_id"]]["prompt"][3]["client_id"] == "mine"
    assert list(await get(http, gw1, "/history?max_items=1", auth())) == both[1:]
    assert list(await get(http, gw1, "/history?max_items=1&offset=0", auth())) == both[:1]
    assert await get(http, gw1, "/history", auth("bob")) == {}
    assert list(await get(http, gw1, "/history", ADMIN)) == both
    jobs = await get(http, gw1, "/api/jobs?sort_order=asc", auth())
    assert [(j["id"], j["status"]) for j in jobs["jobs"]] == [(pid, "cancelled"), (short["prompt_id"], "completed")]
    assert (await get(http, gw1, "/api/jobs?status=completed", auth()))["pagination"]["total"] == 1
    assert (await get(http, gw1, "/api/jobs", auth("bob")))["jobs"] == []
    assert await get(http, gw1, "/queue", auth()) == {"queue_running": [], "queue_pending": []}
    assert await get(http, gw1, "/prompt", auth()) == {"exec_info": {"queue_remaining": 0}}

    # Cleared through the other gateway: gone from both.
    await control(http, gw1, "/history", {"clear": True}, "bob")
    assert list(await get(http, gw0, "/history", auth())) == both
    await control(http, gw1, "/history", {"clear": True}, "alice")
    assert await get(http, gw0, "/history", auth()) == {} and await get(http, gw1, "/history", ADMIN) == {}
    assert await get(http, gw0, f"/history/{pid}", auth()) == {}
    assert (await get(http, gw0, "/api/jobs", auth()))["jobs"] == []


async def test_without_redis_a_gateway_still_has_its_own_history(redis_server: RedisServer, fakegpus: Any,
                                                                  gateway: Any, http: aiohttp.ClientSession) -> None:
    node = await fakegpus("comfyui", step_ms=5)
    gw0, gw1 = await two_gateways(redis_server, gateway, {"a": node})
    pid = (await post(http, gw0, {"prompt": graph(2, 1)}))["prompt_id"]

    async def on_gw1() -> bool:
        return pid in await get(http, gw1, "/history", auth())

    await wait_until(on_gw1)
    redis_server.kill()
    assert list(await get(http, gw0, "/history", auth())) == [pid]
    assert list(await get(http, gw0, f"/history/{pid}", auth())) == [pid]
    assert await get(http, gw1, "/history", auth()) == {}


async def test_a_prompt_waiting_on_its_node_is_dequeued_through_the_other_gateway(
        redis_server: RedisServer, fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    node = await fakegpus("comfyui", step_ms=20, parallel=1)  # the node's own queue holds the second
    gw0, gw1 = await two_gateways(redis_server, gateway, {"a": node}, max_concurrency=2)
    first = (await post(http, gw0, {"prompt": graph(2000, 1)}))["prompt_id"]
    second = (await post(http, gw0, {"prompt": graph(2000, 2)}))["prompt_id"]
    await wait_until(lambda: node.stats["pending"] == 1)

    async def pending_on_gw1() -> list[Any]:
        return list((await get(http, gw1, "/queue", auth()))["queue_pending"])

    await wait_until(pending_on_gw1)
    assert [item[1] for item in await pending_on_gw1()] == [second]
    assert [j["id"] for j in (await get(http, gw1, "/api/jobs?status=pending", auth()))["jobs"]] == [second]
    for path, body in (("/queue", {"delete": [second]}), ("/queue", {"clear": True}),
                       ("/api/jobs/cancel", {"job_ids": [second]})):
        await control(http, gw1, path, body, "bob")
    assert node.stats["queue_deletes"] == 0
    await control(http, gw1, "/queue", {"delete": [second]}, "alice")
    assert node.stats["queue_deletes"] == 1
    assert await control(http, gw1, f"/api/jobs/{first}/cancel", {}, "alice") == {"cancelled": True}
    await wait_until(lambda: node.stats["interrupts"] == 1)

    async def idle() -> bool:  # nothing left running for the gateways to wait for when they stop
        async with http.post(node.url + "/interrupt", json={}):
            pass
        return sum(gw0.rt.scheduler.node_inflight.values()) == 0

    await wait_until(idle, step=0.1)


async def test_a_jobs_files_download_from_another_gateway_after_its_own_stopped(
        redis_server: RedisServer, fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    node = await fakegpus("comfyui", steps=1, step_ms=5)
    gw0, gw1 = await two_gateways(redis_server, gateway, {"a": node})
    name = (await upload(http, gw0.url, "cat.png", make_png("cat")))["name"]
    async with http.post(gw0.url + "/gen/prompt", json={"prompt": img2img(name)}, headers={**auth(), **ASYNC}) as r:
        assert r.status == 202, await r.text()
        job = await r.json()
    await wait_until(lambda: gw0.jobs.jobs[job["job_id"]].status == "completed", timeout=20)
    await wait_until(lambda: gw0.rt.adapter_state["comfyfiles"].copies == 0)
    url = f"/v1/jobs/{job['job_id']}/files/0"
    async with http.get(gw0.url + url, headers=auth()) as r:
        assert r.status == 200
        made = await r.read()
    assert made.startswith(b"\x89PNG")
    await gw0.server.shutdown()
    await node.kill()
    await asyncio.sleep(0)
    async with http.get(gw1.url + url, headers=auth()) as r:
        assert r.status == 200 and await r.read() == made
    async with http.get(gw1.url + url, headers=auth("bob")) as r:
        assert r.status == 404
    async with http.get(gw1.url + f"/v1/jobs/{job['job_id']}/files/1", headers=auth()) as r:
        assert r.status == 404


async def test_the_shared_lists_are_bounded_and_expire(redis_server: RedisServer) -> None:
    """Every key the lists write expires (``jobs.result_ttl_sec``, a waiting record twice the
    request timeout), and the ended lists keep the route's last ``cap`` prompts (their jobs
    records with them); a prompt's entry takes its waiting record's place."""
    redis = redis_server.client()
    tasks: set[asyncio.Task[Any]] = set()

    def spawn(coro: Any) -> None:
        t = asyncio.create_task(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    lists = SharedLists(redis, "kl-b:", spawn)
    for pid in ("p1", "p2", "p3"):
        lists.waiting_now("gen", pid, {"subject": "alice", "node": "a", "number": 1}, max_age=60)
    lists.waiting_now("gen", "p3", None, max_age=60)  # ended without an entry
    entry = {"prompt": [1, "p1", {}, {}, []], "outputs": {}, "status": {"status_str": "success", "messages": []}}
    for pid in ("p1", "p2"):
        assert await lists.put_entry("gen", pid, "alice", {**entry, "prompt": [1, pid, {}, {}, []]}, {"id": pid},
                                     ttl=30, cap=1)
    assert list(await lists.waiting("gen")) == []  # p1, p2 ended with entries; p3 without
    assert await lists.ended("gen", "alice") == ["p2"] and await lists.ended("gen", None) == ["p2"]
    assert await lists.jobs("gen", ["p1", "p2"]) == {"p2": {"id": "p2"}}
    lists.waiting_now("gen", "p4", {"subject": "bob", "node": "a", "number": 2}, max_age=60)
    await lists.put_entry("gen", "p5", "bob", entry, {"id": "p5"}, ttl=30, cap=1)
    keys = list(await redis.keys("kl-b:*"))
    assert sorted(keys) == sorted(["kl-b:comfywait:gen", "kl-b:comfywait:gen:at", "kl-b:comfyhist:gen:p1",
                                   "kl-b:comfyhist:gen:p2", "kl-b:comfyhist:gen:p5", "kl-b:comfyended:gen",
                                   "kl-b:comfyended:gen:alice", "kl-b:comfyended:gen:bob", "kl-b:comfysum:gen"])
    for k in keys:
        limit = 60_000 if k.startswith("kl-b:comfywait:") else 30_000
        assert 0 < await redis.pttl(k) <= limit, k
    await lists.forget_entries("gen", ["p5"])
    assert await lists.ended("gen", "bob") == [] and await lists.entry("gen", "p5") is None
    # A delete takes the entry out of its key's own list, whatever characters the key's name has.
    odd = "bob smith/ü:%~"
    assert await lists.put_entry("gen", "p6", odd, entry, {"id": "p6"}, ttl=30, cap=5)
    assert await lists.ended("gen", odd) == ["p6"]
    assert await lists.forget_entries("gen", ["p6", "gone"])
    assert await lists.ended("gen", odd) == [] and await lists.ended("gen", None) == []
    assert await lists.jobs("gen", ["p6"]) == {} and await lists.entry("gen", "p6") is None
    # A prompt deleted from its node's queue is marked for the gateway that holds it, for a while.
    assert await lists.drop("gen", ["p7"], max_age=60)
    assert await lists.dropped("gen", "p7") and not await lists.dropped("gen", "p8")
    assert 0 < await redis.pttl("kl-b:comfydrop:gen:p7") <= 60_000
    redis_server.kill()
    assert await lists.ended("gen", "alice") is None  # not known, rather than none
    await redis.aclose()
