"""One ComfyUI over two GPUs (docs/API.md "ComfyUI over several GPUs"): two fake ComfyUI nodes
behind one comfyui route, each with one slot, over loopback.

- one websocket: a client's ``/ws`` on the gateway hears every event of its prompts (previews
  included) from whichever node runs them;
- one history, one queue, one jobs list, merged over the nodes, as the client knows its prompts;
- per key: another key sees, hears and stops nothing of them; the admin key and a
  ``comfy.shared`` route see everything;
- the page is not GPU work: its files and metadata are answered while every slot renders;
- ``{path}`` redirects to ``{path}/``, a node's root-relative ``Location`` keeps the prefix, and
  the frontend's root-absolute assets load under the prefix.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from comfy_gpus import get, graph, hear, kinds_of, node_of, post, preview_ids
from conftest import ADMIN, auth, base_config, wait_until

from kilolined.adapters.comfy_control import comfy_state
from kilolined.adapters.comfy_hub import OUTBOX_MAX, OUTBOX_MAX_BYTES, Client
from kilolined.adapters.comfy_record import Viewer
from kilolined.fakegpu.comfy_page import SCRIPT, STYLE
from kilolined.wire.redirects import keep_prefix

ENDS = ("execution_success", "execution_error", "execution_interrupted")


async def two_nodes(fakegpus: Any, gateway: Any, **route: Any) -> tuple[Any, Any, Any]:
    a = await fakegpus("comfyui", step_ms=20, previews=True)
    b = await fakegpus("comfyui", step_ms=20, previews=True)
    cfg = base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=1, **route)
    cfg["routes"]["gen"].update(nodes=["a", "b"], standby=[])
    return a, b, await gateway(cfg)


# --- one websocket -----------------------------------------------------------------------------

async def test_one_socket_hears_the_prompts_of_both_nodes(fakegpus: Any, gateway: Any,
                                                          http: aiohttp.ClientSession) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway)
    async with http.ws_connect(gw.url + "/gen/ws?clientId=mine", headers=auth()) as ws, \
            http.ws_connect(gw.url + "/gen/ws?clientId=mine", headers=auth()) as plain:
        hello = await ws.receive_json(timeout=5)
        assert hello == {"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 0}}, "sid": "mine"}}
        await plain.receive_json(timeout=5)
        await ws.send_json({"type": "feature_flags", "data": {"supports_preview_metadata": True}})
        flags = await ws.receive_json(timeout=5)
        assert flags["type"] == "feature_flags" and flags["data"]["supports_preview_metadata"] is True
        first, second = await asyncio.gather(post(http, gw, {"prompt": graph(6, 1), "client_id": "mine"}),
                                             post(http, gw, {"prompt": graph(6, 2), "client_id": "mine"}))
        pids = {first["prompt_id"], second["prompt_id"]}
        frames, plain_frames = await asyncio.gather(hear(ws, pids), hear(plain, pids))
    # one prompt ran on each node, and the socket heard all of both
    assert {node_of(gw, pid) for pid in pids} == {"a", "b"}
    assert a.stats["served"] == b.stats["served"] == 1
    for pid in pids:
        kinds = kinds_of(frames, pid)
        assert kinds[:2] == ["execution_start", "execution_cached"], kinds
        assert {"executing", "progress", "progress_state", "executed", "execution_success"} <= set(kinds)
        assert kinds[-1] == "executing"
        assert [d["value"] for k, d in frames if k == "progress" and d["prompt_id"] == pid] == list(range(1, 7))
        assert kinds == kinds_of(plain_frames, pid)
    # previews: with their prompt id to the socket that asked for it, plain type 1 to the other
    assert sorted(preview_ids(frames)) == sorted([*pids] * 6)
    plain_previews = [d for k, d in plain_frames if k == "binary"]
    assert len(plain_previews) == 12 and all(struct.unpack(">II", d[:8]) == (1, 2) for d in plain_previews)
    # status is the route's: both prompts counted, whatever node holds them, and 0 at the end
    remaining = [d["status"]["exec_info"]["queue_remaining"] for k, d in frames if k == "status"]
    assert 2 in remaining and remaining[-1] == 0
    # the nodes saw the gateway's client id, never the client's
    assert all(r["query"].startswith("clientId=kilolined-monitor-") for g in (a, b) for r in g.requests
               if r["path"] == "/ws")


async def test_the_socket_hears_the_keys_sse_prompts_too(fakegpus: Any, gateway: Any,
                                                           http: aiohttp.ClientSession) -> None:
    _, _, gw = await two_nodes(fakegpus, gateway)
    async with http.ws_connect(gw.url + "/gen/ws?clientId=mine", headers=auth()) as ws, \
            http.ws_connect(gw.url + "/gen/ws?clientId=mine", headers=auth("bob")) as bobs:
        await ws.receive_json(timeout=5)
        await bobs.receive_json(timeout=5)
        async with http.post(gw.url + "/gen/prompt", json={"prompt": graph(4, 1), "client_id": "mine"},
                             headers={**auth(), "X-KiloLine-Mode": "sse"}) as r:
            body = await r.text()
        pid = orjson.loads(body.split("event: output_ready\ndata: ", 1)[1].split("\n", 1)[0])["result"]["prompt"][1]
        frames = await hear(ws, {pid})
        kinds = kinds_of(frames, pid)
        assert kinds[0] == "execution_start" and "execution_success" in kinds
        assert [d["value"] for k, d in frames if k == "progress"] == [1, 2, 3, 4]
        assert len([k for k, _ in frames if k == "binary"]) == 4  # the job socket's plain previews
        with pytest.raises(TimeoutError):  # another key under the same client id hears nothing of it
            while (await bobs.receive_json(timeout=0.3))["type"] == "status":
                pass


# --- one history, one queue, one jobs list ------------------------------------------------------

async def test_history_queue_and_jobs_are_merged_over_the_nodes(fakegpus: Any, gateway: Any,
                                                                http: aiohttp.ClientSession) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway)
    answers = await asyncio.gather(post(http, gw, {"prompt": graph(2000, 1), "client_id": "mine"}),
                                   post(http, gw, {"prompt": graph(2000, 2)}))
    pids = [x["prompt_id"] for x in answers]
    await wait_until(lambda: a.stats["running"] == 1 and b.stats["running"] == 1)
    queue = await get(http, gw, "/queue", auth())
    assert queue["queue_pending"] == []
    running = {item[1]: item for item in queue["queue_running"]}
    assert set(running) == set(pids)
    for x in answers:  # the number each POST answered, the client_id the client sent (or none)
        assert running[x["prompt_id"]][0] == x["number"]
    assert running[pids[0]][3]["client_id"] == "mine" and "client_id" not in running[pids[1]][3]
    assert await get(http, gw, "/api/queue", auth()) == queue
    assert await get(http, gw, "/prompt", auth()) == {"exec_info": {"queue_remaining": 2}}
    jobs = await get(http, gw, "/api/jobs", auth())
    assert sorted(j["id"] for j in jobs["jobs"]) == sorted(pids)
    assert {j["status"] for j in jobs["jobs"]} == {"in_progress"}
    assert (await get(http, gw, f"/api/jobs/{pids[1]}", auth()))["status"] == "in_progress"
    assert await get(http, gw, f"/history/{pids[0]}", auth()) == {}  # still running

    # /interrupt acts where each prompt runs
    for pid in pids:
        async with http.post(gw.url + "/gen/interrupt", json={"prompt_id": pid}, headers=auth()) as r:
            assert r.status == 200
    await wait_until(lambda: a.stats["interrupts"] == 1 and b.stats["interrupts"] == 1)
    await wait_until(lambda: sum(gw.rt.scheduler.node_inflight.values()) == 0)
    done = await asyncio.gather(post(http, gw, {"prompt": graph(3, 3), "client_id": "mine"}),
                                post(http, gw, {"prompt": graph(3, 4), "client_id": "mine"}))
    pids += [x["prompt_id"] for x in done]

    async def all_ended() -> bool:
        return len(await get(http, gw, "/history", auth())) == 4

    await wait_until(all_ended)
    history = await get(http, gw, "/history", auth())
    assert set(history) == set(pids)
    assert {node_of(gw, pid) for pid in pids[2:]} == {"a", "b"}
    for x in done:
        entry = history[x["prompt_id"]]
        assert entry["status"]["status_str"] == "success" and entry["outputs"]["9"]["images"]
        assert entry["prompt"][0] == x["number"] and entry["prompt"][3]["client_id"] == "mine"
        assert await get(http, gw, f"/history/{x['prompt_id']}", auth()) == {x["prompt_id"]: entry}
    assert [history[p]["status"]["status_str"] for p in pids[:2]] == ["error", "error"]
    assert list(await get(http, gw, "/history?max_items=1", auth())) == list(history)[-1:]
    assert await get(http, gw, "/api/history", auth()) == history
    jobs = await get(http, gw, "/api/jobs?status=completed&sort_order=asc", auth())
    assert sorted(j["id"] for j in jobs["jobs"]) == sorted(pids[2:]) and jobs["pagination"]["total"] == 2
    assert (await get(http, gw, "/api/jobs?status=cancelled", auth()))["pagination"]["total"] == 2
    job = await get(http, gw, f"/api/jobs/{pids[2]}", auth())
    assert job["status"] == "completed" and job["outputs"]["9"]["images"]
    async with http.get(gw.url + "/gen/api/jobs?status=nope", headers=auth()) as r:
        assert r.status == 400 and "Invalid status" in (await r.json())["error"]
    assert await get(http, gw, "/queue", auth()) == {"queue_running": [], "queue_pending": []}
    assert await get(http, gw, "/prompt", auth()) == {"exec_info": {"queue_remaining": 0}}


# --- per key -------------------------------------------------------------------------------------

async def test_a_second_key_sees_hears_and_stops_nothing_of_the_first(fakegpus: Any, gateway: Any,
                                                                      http: aiohttp.ClientSession) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway)
    async with http.ws_connect(gw.url + "/gen/ws?clientId=same", headers=auth("alice")) as alice_ws, \
            http.ws_connect(gw.url + "/gen/ws?clientId=same", headers=auth("bob")) as bob_ws:
        await alice_ws.receive_json(timeout=5)
        await bob_ws.receive_json(timeout=5)
        long = await post(http, gw, {"prompt": graph(2000, 1), "client_id": "same"})
        await wait_until(lambda: a.stats["running"] + b.stats["running"] == 1)
        pid = long["prompt_id"]
        for path in ("/queue", "/api/jobs", "/history", f"/history/{pid}"):
            mine, theirs = await get(http, gw, path, auth("alice")), await get(http, gw, path, auth("bob"))
            assert pid in orjson.dumps(mine).decode() or path.startswith("/history"), path
            assert pid not in orjson.dumps(theirs).decode(), path
        assert await get(http, gw, "/prompt", auth("bob")) == {"exec_info": {"queue_remaining": 0}}
        async with http.get(gw.url + f"/gen/api/jobs/{pid}", headers=auth("bob")) as r:
            assert r.status == 404
        # bob cannot stop it: interrupt, queue delete and cancel are no-ops for him
        for path, body in (("/interrupt", {"prompt_id": pid}), ("/interrupt", {}), ("/queue", {"delete": [pid]}),
                           ("/queue", {"clear": True}), (f"/api/jobs/{pid}/cancel", {})):
            async with http.post(gw.url + "/gen" + path, json=body, headers=auth("bob")) as r:
                assert r.status == 200, path
        assert a.stats["interrupts"] + b.stats["interrupts"] == 0
        # the admin key sees it, and stops it
        assert pid in {j["id"] for j in (await get(http, gw, "/api/jobs", ADMIN))["jobs"]}
        async with http.post(gw.url + f"/gen/api/jobs/{pid}/cancel", json={}, headers=ADMIN) as r:
            assert r.status == 200 and (await r.json()) == {"cancelled": True}
        short = await post(http, gw, {"prompt": graph(3, 2), "client_id": "same"})
        heard = await hear(alice_ws, {pid, short["prompt_id"]})
        assert "execution_interrupted" in kinds_of(heard, pid)
        assert "execution_success" in kinds_of(heard, short["prompt_id"])
        # bob, listening under the same client id, heard only the route's status, and his own count
        await bob_ws.send_str("{}")  # a round trip: every frame meant for him is in by now
        await asyncio.sleep(0)
        bob_heard: list[Any] = []
        while True:
            try:
                msg = await bob_ws.receive(timeout=0.3)
            except TimeoutError:
                break
            bob_heard.append(msg.json() if msg.type == aiohttp.WSMsgType.TEXT else msg.data)
        assert bob_heard and all(m["type"] == "status" and m["data"]["status"]["exec_info"]["queue_remaining"] == 0
                                 for m in bob_heard)
    assert await get(http, gw, "/history", auth("bob")) == {}
    assert set(await get(http, gw, "/history", ADMIN)) == {pid, short["prompt_id"]}
    # the admin key reads and stops prompts; it sends none
    async with http.post(gw.url + "/gen/prompt", json={"prompt": graph(3, 3)}, headers=ADMIN) as r:
        assert r.status == 403


async def test_a_shared_route_is_one_tenant(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    _, _, gw = await two_nodes(fakegpus, gateway, comfy={"shared": True})
    pid = (await post(http, gw, {"prompt": graph(3, 1)}, who="alice"))["prompt_id"]

    async def seen_by_bob() -> bool:
        return pid in await get(http, gw, "/history", auth("bob"))

    await wait_until(seen_by_bob)


# --- the page is not GPU work --------------------------------------------------------------------

async def test_the_page_loads_while_every_slot_renders(fakegpus: Any, gateway: Any,
                                                       http: aiohttp.ClientSession) -> None:
    # a rate of one prompt a minute: the page's ~20 requests below would be refused if they counted
    a, b, gw = await two_nodes(fakegpus, gateway, rate={"per_minute": 1, "burst": 2})
    await asyncio.gather(post(http, gw, {"prompt": graph(2000, 1)}), post(http, gw, {"prompt": graph(2000, 2)}))
    await wait_until(lambda: a.stats["running"] == 1 and b.stats["running"] == 1)
    page = ["/", SCRIPT, STYLE, "/assets/images/logo.svg", "/object_info",
            "/api/object_info", "/object_info/KSampler", "/features", "/api/features", "/system_stats",
            "/embeddings", "/api/extensions", "/queue", "/api/history?max_items=64", "/api/jobs", "/prompt",
            "/api/userdata?dir=workflows", "/settings", "/api/settings", "/favicon.ico"]
    for path in page:
        async with http.get(gw.url + "/gen" + path, headers=auth()) as r:
            # answered (the node's own 404 for what the fake lacks), never queued or rate limited
            assert r.status in (200, 404), (path, r.status)
            assert "RateLimit-Limit" not in r.headers, path
    # every answer came while both renders still held their slots
    assert a.stats["running"] == 1 and b.stats["running"] == 1 and a.stats["served"] + b.stats["served"] == 0
    async with http.get(gw.url + "/gen/", headers=auth()) as r:
        assert "." + SCRIPT in await r.text()
    # a third prompt is GPU work: it waits (and is refused by the rate, not the page's requests)
    async with http.post(gw.url + "/gen/prompt", json={"prompt": graph(3, 3)}, headers=auth()) as r:
        assert r.status == 429
    for g in (a, b):
        async with http.post(g.url + "/interrupt", json={}):
            pass


def real_page_load() -> list[tuple[str, str, dict[str, str]]]:
    """(method, path, extra headers) of one load of ComfyUI 0.19.3's web UI (frontend 1.42), as
    the gateway's access log recorded it in Chromium: ~210 requests, more than a key limited to
    120 a minute could make in a minute if each cost a token."""
    page: list[tuple[str, str, dict[str, str]]] = [("GET", "/", {})]
    page += [("GET", f"/assets/chunk-{i}-Dx0{i}.js", {}) for i in range(130)]
    page += [("GET", p, {}) for p in ("/materialdesignicons.min.css", "/fonts/inter-latin-normal.woff2",
                                      "/user.css", "/templates/index.json", "/templates/index_logo.json",
                                      "/templates/fuse_options.json", "/templates/gsl_starter_1_1-1.webp")]
    page += [("GET", "/api/" + p, {}) for p in (
        "users", "settings", "i18n", "object_info", "system_stats", "extensions", "experiment/models",
        "workflow_templates", "global_subgraphs", "userdata/user.css", "userdata/comfy.templates.json",
        "userdata?dir=workflows&recurse=true&split=false&full_info=true",
        "userdata?dir=subgraphs&recurse=true&split=false&full_info=true",
        "queue", "history?max_items=64")]
    page += [("GET", f"/api/global_subgraphs/{i:064x}", {}) for i in range(40)]
    page += [("GET", "/internal/folder_paths", {}), ("POST", "/api/settings/Comfy.InstalledVersion", {}),
             ("POST", "/api/settings/Comfy.TutorialCompleted", {})]
    page += [("GET", "/api/jobs?status=in_progress,pending&limit=200", {}) for _ in range(10)]
    # the bundle's root-absolute images, found under the route by the page's Referer
    page += [("GET", f"/assets/images/favicon_progress_16x16/frame_{i}.png", {"Referer": "{gw}/gen/"})
             for i in range(10)]
    return page


async def test_a_key_limited_to_120_a_minute_gets_the_whole_real_page_while_every_slot_renders(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    a = await fakegpus("comfyui", step_ms=20)
    b = await fakegpus("comfyui", step_ms=20)
    cfg = base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=1)
    cfg["routes"]["gen"].update(nodes=["a", "b"], standby=[])
    cfg["keys"]["alice"]["rate"] = {"per_minute": 120, "burst": 10}
    gw = await gateway(cfg)
    await asyncio.gather(post(http, gw, {"prompt": graph(2000, 1)}), post(http, gw, {"prompt": graph(2000, 2)}))
    await wait_until(lambda: a.stats["running"] == 1 and b.stats["running"] == 1)
    page = real_page_load()
    assert len(page) > 120 + 10
    browser = asyncio.Semaphore(6)  # a browser's connections per host

    async def fetch(method: str, path: str, extra: dict[str, str]) -> tuple[str, int, bool]:
        headers = {**auth(), **{k: v.format(gw=gw.url) for k, v in extra.items()}}
        url = gw.url + path if "Referer" in extra else gw.url + "/gen" + path
        async with browser, http.request(method, url, headers=headers, json={} if method == "POST" else None) as r:
            await r.read()
            return path, r.status, "RateLimit-Limit" in r.headers

    answers = await asyncio.gather(*(fetch(*req) for req in page))
    # every one answered by a node (its own 404 for what the fake lacks): none refused, none counted
    assert [a for a in answers if a[1] not in (200, 404) or a[2]] == []
    assert a.stats["running"] == 1 and b.stats["running"] == 1 and a.stats["served"] + b.stats["served"] == 0
    for g in (a, b):
        async with http.post(g.url + "/interrupt", json={}):
            pass


@pytest.mark.parametrize("b_is", ["a node", "the standby"])
async def test_the_page_comes_from_the_next_node_when_its_node_is_gone(fakegpus: Any, gateway: Any,
                                                                       http: aiohttp.ClientSession, b_is: str) -> None:
    """The node serving the page dies before a health check can tell (a page load is over in
    seconds, the checks judge in tens): the request it never got, and a GET it dropped, go to the
    next node, as nginx's proxy_next_upstream error does; the next request does not try it first.
    The next node may be the standby: the dead primary still counts as up."""
    a = await fakegpus("comfyui", step_ms=20)
    b = await fakegpus("comfyui", step_ms=20)
    cfg = base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=1)
    cfg["routes"]["gen"].update(nodes=["a", "b"], standby=[]) if b_is == "a node" else \
        cfg["routes"]["gen"].update(nodes=["a"], standby=["b"])
    for n in ("a", "b"):
        cfg["nodes"][n]["health"] = {"path": "/system_stats", "interval_sec": 60}
    gw = await gateway(cfg)
    async with http.get(gw.url + "/gen/", headers=auth()) as r:
        assert r.status == 200 and r.headers["X-KiloLine-Node"] == "a"  # a kept-alive connection to a
    await a.kill()
    for method, path in (("GET", "/"), ("GET", SCRIPT), ("GET", "/object_info"),
                         ("POST", "/api/settings/Comfy.TutorialCompleted"), ("GET", STYLE)):
        async with http.request(method, gw.url + "/gen" + path, headers=auth(),
                                json=True if method == "POST" else None) as r:
            assert r.status != 502 and r.headers["X-KiloLine-Node"] == "b", (method, path, r.status)
    assert gw.rt.scheduler.nodes["a"].healthy  # no health check told the gateway


async def test_an_operators_unqueued_paths_replace_the_default_but_never_free_a_prompt(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1, queue_timeout_sec=1,
                                   unqueued_paths=["*"]))
    await post(http, gw, {"prompt": graph(2000, 1)})
    await wait_until(lambda: fake.stats["running"] == 1)
    # queued behind the render (answered as ComfyUI answers a prompt it queues), not passed through
    async with http.post(gw.url + "/gen/api/prompt", json={"prompt": graph(3, 2)}, headers=auth()) as r:
        assert r.status == 200
        pid = (await r.json())["prompt_id"]

    async def timed_out() -> bool:
        return pid in await get(http, gw, "/history", auth())

    await wait_until(timed_out)
    status = (await get(http, gw, f"/history/{pid}", auth()))[pid]["status"]
    assert status["status_str"] == "error" and "queue" in status["messages"][0][1]["exception_message"]
    assert fake.stats["running"] == 1  # still the first prompt's
    async with http.post(fake.url + "/interrupt", json={}):
        pass


async def test_the_route_path_without_its_slash_redirects(fakegpus: Any, gateway: Any,
                                                          http: aiohttp.ClientSession) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui"))
    for path, where in (("/gen", "/gen/"), ("/gen?steps=3", "/gen/?steps=3")):
        async with http.get(gw.url + path, headers=auth(), allow_redirects=False) as r:
            assert r.status == 301 and r.headers["Location"] == where
    async with http.get(gw.url + "/gen", headers=auth()) as r:  # followed: the page
        assert r.status == 200 and r.url.path == "/gen/" and "<title>ComfyUI</title>" in await r.text()


async def test_root_absolute_page_files_load_under_the_prefix(fakegpus: Any, gateway: Any,
                                                              http: aiohttp.ClientSession) -> None:
    fake = await fakegpus("comfyui", step_ms=20)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui"))
    logo = "/assets/images/logo.svg"
    for referer in (gw.url + "/gen/", gw.url + "/gen" + STYLE):
        async with http.get(gw.url + logo, headers={**auth(), "Referer": referer}) as r:
            assert r.status == 200 and r.content_type == "image/svg+xml", referer
    assert [r["path"] for r in fake.requests if r["path"] == logo] == [logo, logo]
    for headers in ({}, {"Referer": "http://elsewhere.example/gen/"}, {"Referer": gw.url + "/nothing/"}):
        async with http.get(gw.url + logo, headers={**auth(), **headers}) as r:
            assert r.status == 404, headers
    async with http.post(gw.url + logo, headers={**auth(), "Referer": gw.url + "/gen/"}) as r:
        assert r.status == 404  # only the page's own GETs


# --- a node's redirect keeps the route's prefix ---------------------------------------------------

def test_keep_prefix() -> None:
    assert keep_prefix("/x?y=1", "/gen") == "/gen/x?y=1"
    assert keep_prefix("/", "/gen/") == "/gen/"
    assert keep_prefix("/x", "/") == "/x"  # a route that forwards the whole path
    for other in ("//elsewhere.example/x", "x/y", "https://elsewhere.example/x", ""):
        assert keep_prefix(other, "/gen") == other


@pytest.fixture
async def redirector() -> AsyncIterator[str]:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=302, headers={"Location": "/login?next=/x", "Content-Location": "/here"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("kind", ["generic", "openai", "comfyui"])
async def test_a_nodes_root_relative_redirect_keeps_the_prefix(redirector: str, gateway: Any,
                                                               http: aiohttp.ClientSession, kind: str) -> None:
    gw = await gateway(base_config({"n": redirector}, kind=kind))
    for method in ("GET", "POST"):  # unqueued and queued answers alike
        async with http.request(method, gw.url + "/gen/old", headers=auth(), allow_redirects=False) as r:
            assert r.status == 302, (method, await r.text())
            assert r.headers["Location"] == "/gen/login?next=/x" and r.headers["Content-Location"] == "/gen/here"


async def test_a_failed_prompt_reaches_its_client_without_the_nodes_traceback(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    _, _, gw = await two_nodes(fakegpus, gateway)
    failing = graph(3, 1)
    failing["8"] = {"class_type": "FailNode", "inputs": {"message": "sampler exploded", "x": ["3", 0]}}
    async with http.ws_connect(gw.url + "/gen/ws?clientId=mine", headers=auth()) as ws:
        await ws.receive_json(timeout=5)
        pid = (await post(http, gw, {"prompt": failing, "client_id": "mine"}))["prompt_id"]
        frames = await hear(ws, {pid})
    error = next(d for k, d in frames if k == "execution_error")
    assert error["exception_message"] == "sampler exploded\n" and "traceback" not in error
    entry = (await get(http, gw, f"/history/{pid}", auth()))[pid]
    assert entry["status"]["status_str"] == "error"
    assert next(m for m in entry["status"]["messages"] if m[0] == "execution_error")[1] == error
    job = await get(http, gw, f"/api/jobs/{pid}", auth())
    assert job["status"] == "failed" and "traceback" not in job["execution_error"]


async def test_clearing_the_history_forgets_only_your_own(fakegpus: Any, gateway: Any,
                                                          http: aiohttp.ClientSession) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway)
    mine = (await post(http, gw, {"prompt": graph(2, 1)}, who="alice"))["prompt_id"]
    theirs = (await post(http, gw, {"prompt": graph(2, 2)}, who="bob"))["prompt_id"]

    async def both_ended() -> bool:
        return mine in await get(http, gw, "/history", auth("alice")) and \
            theirs in await get(http, gw, "/history", auth("bob"))

    await wait_until(both_ended)
    for body in ({"clear": True}, {"delete": [mine]}):  # bob clears, then deletes alice's prompt
        async with http.post(gw.url + "/gen/api/history", json=body, headers=auth("bob")) as r:
            assert r.status == 200
    assert await get(http, gw, "/history", auth("bob")) == {}
    assert list(await get(http, gw, "/history", auth("alice"))) == [mine]
    node = a if node_of(gw, mine) == "a" else b
    assert mine in node.backend.history  # no node was told to clear
    async with http.post(gw.url + "/gen/history", json={"delete": [mine]}, headers=auth("alice")) as r:
        assert r.status == 200
    assert await get(http, gw, "/history", auth("alice")) == {} and mine not in node.backend.history


@pytest.mark.parametrize(("frames", "size"), [(OUTBOX_MAX + 1, 10), (3, OUTBOX_MAX_BYTES // 2)])
def test_a_client_that_does_not_read_is_closed_not_buffered(frames: int, size: int) -> None:
    client = Client(web.WebSocketResponse(), "gen", "x", Viewer("alice"))
    for _ in range(frames):
        client.send(b"\0" * size)
    assert client.closing and client.outbox.qsize() == 1 and client.outbox.get_nowait() is None
    client.send(b"more")  # nothing queued once it is closing
    assert client.outbox.empty()


async def test_a_socket_opened_mid_render_is_told_which_node_runs(fakegpus: Any, gateway: Any,
                                                                  http: aiohttp.ClientSession) -> None:
    a, b, gw = await two_nodes(fakegpus, gateway)
    pid = (await post(http, gw, {"prompt": graph(2000, 1), "client_id": "page"}))["prompt_id"]
    await wait_until(lambda: a.stats["running"] + b.stats["running"] == 1)
    await wait_until(lambda: any(comfy_state(gw.rt).hub.executing.values()))
    async with http.ws_connect(gw.url + "/gen/ws?clientId=page", headers=auth()) as ws, \
            http.ws_connect(gw.url + "/gen/ws?clientId=other", headers=auth()) as other:
        assert (await ws.receive_json(timeout=5))["data"]["status"]["exec_info"]["queue_remaining"] == 1
        assert await ws.receive_json(timeout=5) == {"type": "executing",
                                                    "data": {"node": "3", "display_node": "3", "prompt_id": pid}}
        await other.receive_json(timeout=5)
        with pytest.raises(TimeoutError):  # not its prompt: it hears of nothing
            await other.receive_json(timeout=0.3)
    async with http.post(gw.url + "/gen/interrupt", json={}, headers=auth()) as r:
        assert r.status == 200
