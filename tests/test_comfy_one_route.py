"""One ComfyUI over two fake nodes, files and prompts together (docs/API.md "ComfyUI over several
GPUs"): the names a client sees are the route's everywhere (``executed`` on /ws, /history,
/api/jobs, /view); a prompt whose node dies mid-run completes on the standby with its uploaded
input, under its prompt id, in every mode; the admin key reads files and uploads none; a node's
events that arrive before its prompt's answer still reach the client."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from conftest import ADMIN, auth, base_config, wait_until

from kilolined.adapters.comfy_control import comfy_state
from kilolined.adapters.comfy_hub import Client, Hub
from kilolined.adapters.comfy_record import PromptOwners, Viewer
from kilolined.fakegpu.comfy_graph import make_png

SSE = {"X-KiloLine-Mode": "sse"}
ASYNC = {"X-KiloLine-Mode": "async"}


def img2img(image: str, prefix: str = "kl") -> dict[str, Any]:
    return {
        "1": {"class_type": "LoadImage", "inputs": {"image": image}},
        "2": {"class_type": "ImageInvert", "inputs": {"image": ["1", 0]}},
        "3": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": prefix}},
    }


async def upload(http: aiohttp.ClientSession, gw: Any, name: str, data: bytes) -> str:
    form = aiohttp.FormData()
    form.add_field("image", data, filename=name, content_type="image/png")
    async with http.post(gw.url + "/gen/upload/image", data=form, headers=auth()) as r:
        assert r.status == 200, await r.text()
        return str((await r.json())["name"])


async def view(http: aiohttp.ClientSession, gw: Any, img: dict[str, Any]) -> tuple[int, bytes]:
    q = {"filename": img["filename"], "subfolder": img["subfolder"], "type": img["type"]}
    async with http.get(gw.url + "/gen/view", params=q, headers=auth()) as r:
        return r.status, await r.read()


async def get(http: aiohttp.ClientSession, gw: Any, path: str) -> Any:
    async with http.get(gw.url + "/gen" + path, headers=auth()) as r:
        assert r.status == 200, (path, r.status, await r.text())
        return await r.json()


def history_images(entry: dict[str, Any]) -> list[dict[str, Any]]:
    return [img for out in entry["outputs"].values() for img in out.get("images", [])]


def node_of(gw: Any, pid: str) -> str:
    p = comfy_state(gw.rt).owners("gen").get(pid)
    assert p is not None
    return p.node


async def test_two_nodes_writing_the_same_name_each_prompt_sees_and_views_its_own(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    a = await fakegpus("comfyui", steps=3, step_ms=20)
    b = await fakegpus("comfyui", steps=3, step_ms=20)
    cfg = base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=1)
    cfg["routes"]["gen"].update(nodes=["a", "b"], standby=[])
    gw = await gateway(cfg)
    cat = await upload(http, gw, "cat.png", make_png("cat"))
    dog = await upload(http, gw, "dog.png", make_png("dog"))
    executed: dict[str, dict[str, Any]] = {}
    seen_at_once: dict[str, tuple[int, bytes]] = {}
    async with http.ws_connect(gw.url + "/gen/ws?clientId=mine", headers=auth()) as ws:
        await ws.receive_json(timeout=5)
        answers = await asyncio.gather(*(http.post(gw.url + "/gen/prompt", headers=auth(),
                                                   json={"prompt": img2img(n), "client_id": "mine"})
                                         for n in (cat, dog)))
        pids = set()
        for r in answers:
            assert r.status == 200, await r.text()
            pids.add((await r.json())["prompt_id"])
        left = set(pids)
        while left:
            msg = await ws.receive(timeout=15)
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            doc = orjson.loads(msg.data)
            data = doc["data"]
            if doc["type"] == "executed":
                executed[data["prompt_id"]] = data["output"]["images"][0]
                # As the web UI does: /view at once, while the copy may not be done.
                seen_at_once[data["prompt_id"]] = await view(http, gw, data["output"]["images"][0])
            elif doc["type"] == "executing" and data.get("node") is None:
                left.discard(data.get("prompt_id"))
    # Each node wrote kl_00001_.png; the route gave the two files different names.
    assert {node_of(gw, pid) for pid in pids} == {"a", "b"}
    assert ("output", "", "kl_00001_.png") in a.backend.images and ("output", "", "kl_00001_.png") in b.backend.images
    assert len({executed[pid]["filename"] for pid in pids}) == 2, executed
    await wait_until(lambda: gw.rt.adapter_state["comfyfiles"].copies == 0)
    for pid in pids:
        own = (a if node_of(gw, pid) == "a" else b).backend.images[("output", "", "kl_00001_.png")]
        assert seen_at_once[pid] == (200, own)
        entry = (await get(http, gw, f"/history/{pid}"))[pid]
        assert history_images(entry) == [executed[pid]]
        listed = (await get(http, gw, "/history"))[pid]
        assert history_images(listed) == [executed[pid]]
        job = await get(http, gw, f"/api/jobs/{pid}")
        assert job["preview_output"]["filename"] == executed[pid]["filename"]
        assert await view(http, gw, executed[pid]) == (200, own)  # from the store now


@pytest.mark.parametrize("mode", ["sync", "sse", "async"])
async def test_primary_killed_mid_prompt_completes_on_the_standby_under_its_prompt_id(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, mode: str) -> None:
    a = await fakegpus("comfyui", steps=200, step_ms=20)
    b = await fakegpus("comfyui", steps=3, step_ms=10)
    gw = await gateway(base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=1))  # b: standby
    name = await upload(http, gw, "cat.png", make_png("cat"))
    body = {"prompt": img2img(name), "client_id": "mine"}
    owners = comfy_state(gw.rt).owners("gen")
    async with http.ws_connect(gw.url + "/gen/ws?clientId=mine", headers=auth()) as ws:
        await ws.receive_json(timeout=5)
        number: Any = None
        reader: asyncio.Task[Any] | None = None
        if mode == "sync":
            async with http.post(gw.url + "/gen/prompt", json=body, headers=auth()) as r:
                assert r.status == 200, await r.text()
                answer = await r.json()
            pid, number = answer["prompt_id"], answer["number"]
        else:
            mode_header = SSE if mode == "sse" else ASYNC
            r = await http.post(gw.url + "/gen/prompt", json=body, headers={**auth(), **mode_header})
            assert r.status == (200 if mode == "sse" else 202)
            reader = asyncio.ensure_future(r.read())  # an sse client reads its stream to the end
            await wait_until(lambda: len(owners.mine(None)) == 1)
            pid = next(iter(owners.mine(None)))
        await wait_until(lambda: a.stats["running"] == 1)
        assert node_of(gw, pid) == "a" and b.backend.images == {}
        await a.kill()
        heard: list[str] = []
        while "execution_success" not in heard:
            msg = await ws.receive(timeout=15)
            if msg.type == aiohttp.WSMsgType.TEXT:
                doc = orjson.loads(msg.data)
                if doc["data"].get("prompt_id") == pid:
                    heard.append(doc["type"])
        if reader is not None:
            await asyncio.wait_for(reader, 15)
    # It ran on the standby, with its input, under the prompt id the client knows.
    assert node_of(gw, pid) == "b" and b.stats["served"] == 1
    assert ("input", "", "cat.png") in b.backend.images
    assert "executed" in heard
    entry = (await get(http, gw, f"/history/{pid}"))[pid]
    assert entry["status"]["status_str"] == "success"
    assert entry["prompt"][1] == pid and entry["prompt"][3]["client_id"] == "mine"
    if number is not None:
        assert entry["prompt"][0] == number  # the number the client was given
    status, data = await view(http, gw, history_images(entry)[0])
    assert status == 200 and data == b.backend.images[("output", "", "kl_00001_.png")]
    await wait_until(lambda: sum(gw.rt.scheduler.node_inflight.values()) == 0)


class DiesOnInterrupt:
    """A node in front of a fake ComfyUI that accepts an ``/interrupt`` and dies before it lands,
    as a real ComfyUI does that is lost between the request and its next progress step (where
    it would stop the prompt): everything else is the fake's."""

    def __init__(self, fake: Any):
        self.fake = fake
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.interrupted = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    async def die(self) -> None:
        await self.fake.kill()
        assert self.runner is not None
        await self.runner.cleanup()  # no listener, every connection dropped

    async def handle(self, request: web.Request) -> web.StreamResponse:
        async with aiohttp.ClientSession() as http:
            if request.method == "POST" and request.path.endswith("/interrupt"):
                self.interrupted += 1
                asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(self.die()))
                return web.Response(status=200)
            if request.headers.get("Upgrade", "").lower() == "websocket":
                ws = web.WebSocketResponse()
                await ws.prepare(request)
                async with http.ws_connect(self.fake.url + request.path_qs) as up:
                    async def down() -> None:
                        async for m in up:
                            await (ws.send_str(m.data) if m.type == aiohttp.WSMsgType.TEXT else ws.send_bytes(m.data))
                        await ws.close()

                    pump = asyncio.ensure_future(down())
                    async for m in ws:
                        await up.send_str(m.data)
                    pump.cancel()
                return ws
            async with http.request(request.method, self.fake.url + request.path_qs, data=await request.read(),
                                    headers={"Content-Type": request.headers.get("Content-Type", "")}) as r:
                return web.Response(status=r.status, body=await r.read(),
                                    headers={"Content-Type": r.headers.get("Content-Type", "application/json")})


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_an_interrupted_prompt_is_not_rerun_when_its_node_dies_before_stopping(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, mode: str) -> None:
    """The client interrupts its prompt; the node accepts and is lost before the interrupt lands:
    the prompt ends there, and the standby never runs it (re-running it would be work nobody
    wants, holding the slot)."""
    fake = await fakegpus("comfyui", steps=2000, step_ms=20)
    b = await fakegpus("comfyui", steps=3, step_ms=10)
    a = DiesOnInterrupt(fake)
    await a.start()
    gw = await gateway(base_config({"a": a.url, "b": b.url}, kind="comfyui", max_concurrency=1))  # b: standby
    owners = comfy_state(gw.rt).owners("gen")
    body = {"prompt": img2img("example.png")}
    body["prompt"]["1"] = {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1,
                                                                  "color": 0}}
    if mode == "sync":
        async with http.post(gw.url + "/gen/prompt", json=body, headers=auth()) as r:
            assert r.status == 200, await r.text()
            pid = (await r.json())["prompt_id"]
    else:
        async with http.post(gw.url + "/gen/prompt", json=body, headers={**auth(), **ASYNC}) as r:
            assert r.status == 202
            job = (await r.json())["job_id"]
        await wait_until(lambda: len(owners.mine(None)) == 1)
        pid = next(iter(owners.mine(None)))
    await wait_until(lambda: fake.stats["running"] == 1)
    async with http.post(gw.url + "/gen/interrupt", json={"prompt_id": pid}, headers=auth()) as r:
        assert r.status == 200
    await wait_until(lambda: sum(gw.rt.scheduler.node_inflight.values()) == 0)  # the slot is freed
    await asyncio.sleep(0.3)  # where a re-queued prompt would have reached the standby by now
    assert a.interrupted == 1 and b.stats["served"] == 0 and b.stats["running"] == 0
    if mode == "async":
        await wait_until(lambda: gw.jobs.jobs[job].status == "cancelled")


async def test_the_admin_key_reads_every_keys_files_and_uploads_none(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    a = await fakegpus("comfyui", steps=2, step_ms=10)
    gw = await gateway(base_config({"a": a.url}, kind="comfyui", max_concurrency=1))
    png = make_png("cat")
    name = await upload(http, gw, "cat.png", png)
    async with http.post(gw.url + "/gen/prompt", json={"prompt": img2img(name)}, headers=auth()) as r:
        pid = (await r.json())["prompt_id"]
    await wait_until(lambda: comfy_state(gw.rt).owners("gen").get(pid).entry is not None)  # type: ignore[union-attr]
    entry = (await get(http, gw, f"/history/{pid}"))[pid]
    out = history_images(entry)[0]
    q = {"filename": out["filename"], "subfolder": out["subfolder"], "type": "output"}
    for who, want in ((ADMIN, 200), (auth("bob"), 404)):
        async with http.get(gw.url + "/gen/view", params=q, headers=who) as r:
            assert r.status == want
    async with http.get(gw.url + "/gen/view", params={"filename": name, "type": "input"}, headers=ADMIN) as r:
        assert r.status == 200 and await r.read() == png
    form = aiohttp.FormData()
    form.add_field("image", png, filename="admin.png", content_type="image/png")
    async with http.post(gw.url + "/gen/upload/image", data=form, headers=ADMIN) as r:
        assert r.status == 403
        assert (await r.json())["error"]["type"] == "forbidden"


def test_events_a_node_sends_before_the_prompts_answer_reach_its_client_once_it_is_recorded() -> None:
    owners = PromptOwners()
    hub = Hub(lambda route: owners, lambda node: ["gen"], lambda route, node, owner, data: data)
    client = Client(web.WebSocketResponse(), "gen", "mine", Viewer("alice"))
    hub.clients["gen"] = {client}
    start = {"type": "execution_start", "data": {"prompt_id": "p1", "timestamp": 1}}
    other = {"type": "execution_start", "data": {"prompt_id": "p2", "timestamp": 1}}
    for doc in (start, other):  # ComfyUI began before its POST answer reached the gateway
        hub.event("a", doc["type"], doc["data"], orjson.dumps(doc).decode())
    assert client.outbox.empty()
    owners.add("p1", "alice", "a", 1, "mine")
    hub.claim("a", "p1")
    assert orjson.loads(client.outbox.get_nowait()) == start and client.outbox.empty()
    hub.claim("a", "p1")  # once
    assert client.outbox.empty()
