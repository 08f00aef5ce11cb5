"""`--kind comfyui` of the simulated GPU, over real sockets: what a running ComfyUI 0.19.3 was seen to do."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import aiohttp
from comfy_events import drain, graph, kinds
from fakegpu_util import MakeGPU, eventually

from kilolined.fakegpu import FakeGPU


async def post(http: aiohttp.ClientSession, gpu: FakeGPU, prompt: dict[str, Any], client_id: str | None = "c1",
               prefix: str = "", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, **extra}
    if client_id is not None:
        body["client_id"] = client_id
    async with http.post(gpu.url + prefix + "/prompt", json=body) as r:
        answer = await r.json()
        assert r.status == 200, answer
    assert answer["node_errors"] == {}
    return dict(answer)


async def submit(http: aiohttp.ClientSession, gpu: FakeGPU, prompt: dict[str, Any], client_id: str | None = "c1",
                 prefix: str = "", **extra: Any) -> str:
    return str((await post(http, gpu, prompt, client_id, prefix, **extra))["prompt_id"])


async def until_done(ws: aiohttp.ClientWebSocketResponse, prompt_id: str) -> list[dict[str, Any]]:
    """Messages up to and including `executing` with node null for this prompt."""
    seen = []
    while True:
        msg = await asyncio.wait_for(ws.receive_json(), 5)
        seen.append(msg)
        if msg["type"] == "executing" and msg["data"]["node"] is None and msg["data"]["prompt_id"] == prompt_id:
            return seen


async def history(http: aiohttp.ClientSession, gpu: FakeGPU, pid: str) -> dict[str, Any]:
    async with http.get(f"{gpu.url}/history/{pid}") as r:
        return dict(await r.json())


async def test_comfy_ws_event_sequence_and_history(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui")
    async with http.ws_connect(gpu.url + "/ws?clientId=c1") as ws:
        hello = await ws.receive_json()
        assert hello == {"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 0}}, "sid": "c1"}}
        answer = await post(http, gpu, graph(10))
        pid = answer["prompt_id"]
        assert await history(http, gpu, pid) == {}  # still running
        seen = await until_done(ws, pid)
        # Fetched before anything else runs: history must already be there.
        async with http.get(f"{gpu.url}/api/history/{pid}") as r:
            entry = (await r.json())[pid]
    # Two status broadcasts per POST (queued, then started), one at the end.
    assert seen[:3] == [{"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 1}}}}] * 2 + [
        seen[2]] and seen[2]["type"] == "execution_start"
    assert kinds(seen, "progress_state")[-3:] == ["execution_success", "status", "executing"]
    assert seen[-2] == {"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 0}}}}
    assert kinds(seen, "status", "progress_state")[:2] == ["execution_start", "execution_cached"]
    executing = [m["data"]["node"] for m in seen if m["type"] == "executing"]
    assert executing == ["4", "5", "6", "7", "3", "8", "9", None]  # dependencies first
    progress = [m["data"] for m in seen if m["type"] == "progress"]
    assert [p["value"] for p in progress] == list(range(1, 11))
    assert all(p["max"] == 10 and p["node"] == "3" and p["prompt_id"] == pid for p in progress)
    executed = next(m["data"] for m in seen if m["type"] == "executed")
    image = executed["output"]["images"][0]
    assert executed["node"] == "9" and image["subfolder"] == "" and image["type"] == "output"

    assert entry["prompt"][:2] == [answer["number"], pid]  # the entry names its submission's number
    assert list(entry) == ["prompt", "outputs", "status", "meta"]
    assert entry["status"]["status_str"] == "success" and entry["status"]["completed"] is True
    assert entry["outputs"]["9"]["images"] == [image]
    assert [m[0] for m in entry["status"]["messages"]] == ["execution_start", "execution_cached",
                                                           "execution_success"]
    assert all(isinstance(m[1]["timestamp"], int) for m in entry["status"]["messages"])
    async with http.get(gpu.url + "/view", params=image) as r:
        assert r.status == 200 and r.content_type == "image/png"
        png = await r.read()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")

    pid2 = await submit(http, gpu, graph(2, seed=2), client_id=None)
    await eventually(lambda: gpu.stats["served"] == 2)
    image2 = (await history(http, gpu, pid2))[pid2]["outputs"]["9"]["images"][0]
    async with http.get(gpu.url + "/api/view", params=image2) as r:
        assert await r.read() != png  # each prompt's image differs
    for params, status in (({"filename": "../secret.png"}, 400), ({"filename": "/etc/passwd"}, 400),
                           ({"filename": "missing.png"}, 404)):
        async with http.get(gpu.url + "/view", params=params) as r:
            assert r.status == status
    async with http.get(gpu.url + "/history") as r:
        assert set(await r.json()) == {pid, pid2}


async def test_comfy_progress_state_per_node(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    """Sent at each node's start (0.0 of 1.0), on each step and at its finish; it lists every node so far."""
    gpu = await make_gpu("comfyui")
    second = {"class_type": "KSampler", "inputs": {"model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0],
                                                   "latent_image": ["3", 0], "seed": 5, "steps": 2}}
    prompt = graph(3, extra={"10": second, "8": {"class_type": "VAEDecode",
                                                 "inputs": {"samples": ["10", 0], "vae": ["4", 2]}}})
    async with http.ws_connect(gpu.url + "/ws?clientId=c1") as ws:
        pid = await submit(http, gpu, prompt)
        seen = await until_done(ws, pid)
    states = [m["data"] for m in seen if m["type"] == "progress_state"]
    assert all(s["prompt_id"] == pid for s in states)
    first = states[0]["nodes"]
    assert first == {"4": {"value": 0.0, "max": 1.0, "state": "running", "node_id": "4", "prompt_id": pid,
                           "display_node_id": "4", "parent_node_id": None, "real_node_id": "4"}}
    last = states[-1]["nodes"]
    assert set(last) == {"3", "4", "5", "6", "7", "8", "9", "10"}
    assert all(n["state"] == "finished" and n["value"] == n["max"] for n in last.values())
    assert last["3"]["max"] == 3 and last["10"]["max"] == 2 and last["9"]["max"] == 1.0
    # per-node `progress` restarts for each sampler; progress_state comes just before each one
    values = [(m["data"]["node"], m["data"]["value"]) for m in seen if m["type"] == "progress"]
    assert values == [("3", 1), ("3", 2), ("3", 3), ("10", 1), ("10", 2)]
    for i, msg in enumerate(seen):
        if msg["type"] == "progress":
            assert seen[i - 1]["type"] == "progress_state"
            node = msg["data"]["node"]
            assert seen[i - 1]["data"]["nodes"][node]["value"] == msg["data"]["value"]
    # the node's start comes before its `executing`
    start = next(i for i, m in enumerate(seen) if m["type"] == "progress_state" and "3" in m["data"]["nodes"])
    assert seen[start + 1] == {"type": "executing", "data": {"node": "3", "display_node": "3", "prompt_id": pid}}


async def test_comfy_progress_updates_are_throttled_like_comfy_utils(
    make_gpu: MakeGPU, http: aiohttp.ClientSession
) -> None:
    gpu = await make_gpu("comfyui", step_ms=1, progress_min_sec=10)
    async with http.ws_connect(gpu.url + "/ws?clientId=c1") as ws:
        pid = await submit(http, gpu, graph(20))
        seen = await until_done(ws, pid)
    assert [m["data"]["value"] for m in seen if m["type"] == "progress"] == [1, 20]  # the first and last go


async def test_comfy_identical_repeat_is_served_from_the_cache(
    make_gpu: MakeGPU, http: aiohttp.ClientSession
) -> None:
    gpu = await make_gpu("comfyui")
    async with http.ws_connect(gpu.url + "/ws?clientId=c1") as ws:
        first = await submit(http, gpu, graph(5))
        await until_done(ws, first)
        again = await submit(http, gpu, graph(5))
        seen = await until_done(ws, again)
        cached = next(m["data"] for m in seen if m["type"] == "execution_cached")
        assert cached["nodes"] == list(graph(5)) and cached["prompt_id"] == again
        assert kinds(seen, "status", "progress_state") == ["execution_start", "execution_cached", "executed",
                                                            "execution_success", "executing"]
        executed = next(m["data"] for m in seen if m["type"] == "executed")
        entry = (await history(http, gpu, again))[again]
        assert entry["status"]["status_str"] == "success" and entry["outputs"]["9"] == executed["output"]
        first_image = (await history(http, gpu, first))[first]["outputs"]["9"]["images"][0]
        assert executed["output"]["images"][0]["filename"] != first_image["filename"]  # still a new file

        # a new seed: the loader, the text encoders and the latent come from the cache, the rest runs
        changed = await submit(http, gpu, graph(5, seed=9))
        seen = await until_done(ws, changed)
    cached = next(m["data"]["nodes"] for m in seen if m["type"] == "execution_cached")
    assert cached == ["4", "5", "6", "7"]
    assert [m["data"]["node"] for m in seen if m["type"] == "executing"] == ["3", "8", "9", None]
    assert len([m for m in seen if m["type"] == "progress"]) == 5
    async with http.post(gpu.url + "/free", json={"free_memory": True}) as r:
        assert r.status == 200
    assert gpu.stats["cached_nodes"] == 0


async def test_comfy_duplicate_prompt_id_is_accepted_and_old_history_stays_until_the_end(
    make_gpu: MakeGPU, http: aiohttp.ClientSession
) -> None:
    gpu = await make_gpu("comfyui", parallel=1, step_ms=20)
    reused = str(uuid.uuid4())
    async with http.ws_connect(gpu.url + "/ws?clientId=c1") as ws:
        old = await post(http, gpu, graph(2), prompt_id=reused)
        await until_done(ws, reused)
        blocker = await submit(http, gpu, graph(30, seed=2))
        new = await post(http, gpu, graph(3, seed=3), prompt_id=reused)
        assert new["prompt_id"] == reused and new["number"] == old["number"] + 2
        async with http.get(gpu.url + "/queue") as r:
            queue = await r.json()
        assert [i[1] for i in queue["queue_running"]] == [blocker]
        assert [i[:2] for i in queue["queue_pending"]] == [[new["number"], reused]]
        # queued behind the blocker: the finished entry under that id is the old submission's
        assert (await history(http, gpu, reused))[reused]["prompt"][0] == old["number"]
        await until_done(ws, blocker)
        await until_done(ws, reused)
    entry = (await history(http, gpu, reused))[reused]
    assert entry["prompt"][0] == new["number"] and entry["prompt"][2] == graph(3, seed=3)
    async with http.get(gpu.url + "/history") as r:
        assert list(await r.json()) == [reused, blocker]  # replaced where it stood
    assert gpu.stats["served"] == 3


async def test_comfy_validation_errors(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui")
    async with http.post(gpu.url + "/prompt", json={"client_id": "c1"}) as r:
        assert r.status == 400
        assert await r.json() == {"error": {"type": "no_prompt", "message": "No prompt provided",
                                            "details": "No prompt provided", "extra_info": {}}, "node_errors": {}}
    # two problems in one chain: only the first unknown class is reported, at the top level
    bad = graph(extra={"8": {"class_type": "MysteryNode", "inputs": {"samples": ["3", 0]}},
                       "9": {"class_type": "OtherMystery", "inputs": {"images": ["8", 0]}}})
    async with http.post(gpu.url + "/prompt", json={"prompt": bad}) as r:
        assert r.status == 400
        assert await r.json() == {
            "error": {"type": "missing_node_type",
                      "message": "Node 'MysteryNode' not found. The custom node may not be installed.",
                      "details": "Node ID '#8'",
                      "extra_info": {"node_id": "8", "class_type": "MysteryNode", "node_title": "MysteryNode"}},
            "node_errors": {}}
    titled = graph(extra={"8": {"inputs": {}, "_meta": {"title": "My decode"}}})
    async with http.post(gpu.url + "/prompt", json={"prompt": titled}) as r:
        error = (await r.json())["error"]
    assert error["type"] == "missing_node_type" and error["extra_info"]["class_type"] is None
    assert error["message"].startswith("Node 'My decode' has no class_type.")
    wrong_steps = graph(0)
    async with http.post(gpu.url + "/prompt", json={"prompt": wrong_steps}) as r:
        body = await r.json()
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    assert body["node_errors"]["3"]["errors"][0]["type"] == "value_smaller_than_min"
    assert body["node_errors"]["3"]["dependent_outputs"] == ["9"]
    no_out = {k: v for k, v in graph().items() if k != "9"}
    async with http.post(gpu.url + "/api/prompt", json={"prompt": no_out}) as r:
        assert r.status == 400 and (await r.json())["error"]["type"] == "prompt_no_outputs"
    async with http.post(gpu.url + "/prompt", json={"prompt": graph(), "prompt_id": "NOT-A-UUID"}) as r:
        assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_prompt_id"
    assert gpu.stats["running"] == 0 and gpu.stats["pending"] == 0


async def test_comfy_body_that_is_not_json_is_aiohttps_500(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui")
    for path in ("/prompt", "/api/prompt", "/queue", "/history"):
        async with http.post(gpu.url + path, data=b"{not json", headers={"Content-Type": "application/json"}) as r:
            assert r.status == 500 and r.content_type == "text/plain"
            assert await r.text() == "500 Internal Server Error\n\nServer got itself in trouble"
    async with http.post(gpu.url + "/interrupt", data=b"junk") as r:
        assert r.status == 200  # /interrupt treats a broken body as "interrupt everything"
    assert gpu.stats["pending"] == 0


async def test_comfy_features_system_stats_and_queue_items(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui", parallel=1, step_ms=20)
    features = {"supports_preview_metadata": True, "max_upload_size": 104857600,
                "extension": {"manager": {"supports_v4": True}}, "node_replacements": True, "assets": False}
    for path in ("/features", "/api/features"):
        async with http.get(gpu.url + path) as r:
            assert await r.json() == features
    async with http.ws_connect(gpu.url + "/ws?clientId=c1") as ws:
        await ws.receive_json()
        await ws.send_json({"type": "feature_flags", "data": {"supports_preview_metadata": False}})
        assert await ws.receive_json() == {"type": "feature_flags", "data": features}
    async with http.get(gpu.url + "/system_stats") as r:
        stats = await r.json()
    assert {"required_frontend_version", "installed_templates_version",
            "required_templates_version"} <= set(stats["system"])
    assert stats["devices"][0]["vram_total"] == 24 * 1024**3
    await submit(http, gpu, graph(50), extra_data={"api_key_comfy_org": "secret", "mine": 1})
    async with http.get(gpu.url + "/queue") as r:
        item = (await r.json())["queue_running"][0]
    assert list(item[3]) == ["mine", "client_id", "create_time"]  # the key is kept out of the queue
    assert item[3]["client_id"] == "c1" and isinstance(item[3]["create_time"], int)


async def test_comfy_upload_image_then_view_it(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui")

    async def upload(data: bytes, **fields: str) -> Any:
        form = aiohttp.FormData()
        form.add_field("image", data, filename="in.png", content_type="image/png")
        for name, value in fields.items():
            form.add_field(name, value)
        async with http.post(gpu.url + "/upload/image", data=form) as r:
            assert r.status == 200
            return await r.json()

    assert await upload(b"one") == {"name": "in.png", "subfolder": "", "type": "input"}
    assert await upload(b"one") == {"name": "in.png", "subfolder": "", "type": "input"}  # same bytes
    assert (await upload(b"two"))["name"] == "in (1).png"
    assert (await upload(b"three", overwrite="true"))["name"] == "in.png"
    async with http.get(gpu.url + "/view", params={"filename": "in.png", "type": "input"}) as r:
        assert await r.read() == b"three"
    async with http.post(gpu.url + "/api/upload/image", data=aiohttp.FormData({"nothing": "here"})) as r:
        assert r.status == 400
    assert gpu.stats["served"] == 0


async def test_comfy_jobs_api(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui", parallel=1, step_ms=20)
    done = await submit(http, gpu, graph(1))
    await eventually(lambda: gpu.stats["served"] == 1)
    running = await submit(http, gpu, graph(100, seed=2))
    pending = await submit(http, gpu, graph(5, seed=3))
    async with http.get(gpu.url + "/api/jobs") as r:
        listing = await r.json()
    # newest first (two prompts of the same millisecond keep ComfyUI's order: running, pending)
    got = [(j["id"], j["status"]) for j in listing["jobs"]]
    assert sorted(got[:2]) == sorted([(pending, "pending"), (running, "in_progress")])
    assert got[2] == (done, "completed")
    assert listing["pagination"] == {"offset": 0, "limit": None, "total": 3, "has_more": False}
    async with http.get(gpu.url + "/api/jobs", params={"status": "completed", "limit": "1"}) as r:
        page = await r.json()
    assert [j["id"] for j in page["jobs"]] == [done] and page["jobs"][0]["outputs_count"] == 1
    assert page["jobs"][0]["preview_output"]["nodeId"] == "9"
    async with http.get(f"{gpu.url}/api/jobs/{done}") as r:
        job = await r.json()
    assert job["status"] == "completed" and job["outputs"]["9"]["images"] and job["workflow"]["prompt"] == graph(1)
    async with http.get(f"{gpu.url}/api/jobs/{uuid.uuid4()}") as r:
        assert r.status == 404 and await r.json() == {"error": "Job not found"}
    async with http.post(f"{gpu.url}/api/jobs/{pending}/cancel") as r:
        assert await r.json() == {"cancelled": True}
    async with http.post(f"{gpu.url}/api/jobs/{pending}/cancel") as r:
        assert await r.json() == {"cancelled": False}  # idempotent
    async with http.post(gpu.url + "/api/jobs/cancel", json={"job_ids": [running]}) as r:
        assert await r.json() == {"cancelled": True}
    await eventually(lambda: gpu.stats["interrupts"] == 1 and gpu.stats["running"] == 0)
    async with http.get(f"{gpu.url}/api/jobs/{running}") as r:
        assert (await r.json())["status"] == "cancelled"
    async with http.post(gpu.url + "/api/jobs/cancel", json={"job_ids": ["nope"]}) as r:
        assert r.status == 400 and (await r.json())["invalid_ids"] == ["nope"]


async def test_comfy_without_client_id_sends_no_execution_events(
    make_gpu: MakeGPU, http: aiohttp.ClientSession
) -> None:
    gpu = await make_gpu("comfyui")
    async with http.ws_connect(gpu.url + "/ws?clientId=watcher") as ws:
        await ws.receive_json()
        pid = await submit(http, gpu, graph(3), client_id=None)
        await eventually(lambda: gpu.stats["served"] == 1)
        seen = await drain(ws)
    found = set(kinds(seen))
    # progress has no owner, so everyone gets it (sid None broadcasts in ComfyUI)
    assert {"progress", "progress_state", "status"} <= found
    assert not found & {"execution_start", "execution_cached", "executing", "executed", "execution_success"}
    assert (await history(http, gpu, pid))[pid]["status"]["status_str"] == "success"


async def test_comfy_interrupt(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui", step_ms=20)
    async with http.ws_connect(gpu.url + "/ws?clientId=c1") as ws:
        pid = await submit(http, gpu, graph(100))
        while (await ws.receive_json())["type"] != "progress":
            pass
        async with http.post(gpu.url + "/interrupt", json={"prompt_id": "not-running"}) as r:
            assert r.status == 200
        async with http.post(gpu.url + "/interrupt", json={"prompt_id": pid}) as r:
            assert r.status == 200
        seen = await until_done(ws, pid)
    stopped = next(m["data"] for m in seen if m["type"] == "execution_interrupted")
    assert stopped["prompt_id"] == pid and stopped["node_id"] == "3" and stopped["node_type"] == "KSampler"
    status = (await history(http, gpu, pid))[pid]["status"]
    assert status["status_str"] == "error" and status["completed"] is False
    assert "execution_interrupted" in [m[0] for m in status["messages"]]
    assert gpu.stats["interrupts"] == 1 and gpu.stats["running"] == 0 and gpu.stats["served"] == 0


async def test_comfy_parallel_queue_delete_and_clear(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui", parallel=1, step_ms=20)
    pids = [await submit(http, gpu, graph(10, seed=i), prefix="/api") for i in range(4)]
    async with http.get(gpu.url + "/queue") as r:
        queue = await r.json()
    assert [item[1] for item in queue["queue_running"]] == pids[:1]
    assert [item[1] for item in queue["queue_pending"]] == pids[1:]
    async with http.get(gpu.url + "/prompt") as r:
        assert await r.json() == {"exec_info": {"queue_remaining": 4}}
    async with http.post(gpu.url + "/queue", json={"delete": [pids[2], pids[0]]}) as r:
        assert r.status == 200  # pids[0] is running: only pending prompts are removed
    assert gpu.stats["queue_deletes"] == 1 and gpu.stats["pending"] == 2
    async with http.post(gpu.url + "/queue", json={"clear": True}) as r:
        assert r.status == 200
    assert gpu.stats["queue_deletes"] == 3 and gpu.stats["pending"] == 0
    await eventually(lambda: gpu.stats["served"] == 1)
    async with http.get(gpu.url + "/history") as r:
        assert set(await r.json()) == set(pids[:1])
    assert gpu.stats["max_concurrent"] == 1


async def test_comfy_fail_node_sends_execution_error(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui")
    failing = graph(2, extra={"9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0]}},
                              "8": {"class_type": "FailNode", "inputs": {"message": "boom", "x": ["3", 0]}}})
    async with http.ws_connect(gpu.url + "/ws?clientId=c1") as ws:
        pid = await submit(http, gpu, failing)
        seen = await until_done(ws, pid)
    error = next(m["data"] for m in seen if m["type"] == "execution_error")
    assert error["node_id"] == "8" and error["node_type"] == "FailNode" and error["exception_message"] == "boom\n"
    assert error["exception_type"] and "3" in error["executed"]
    assert isinstance(error["traceback"], list) and all(frame.startswith("  File \"/") for frame in error["traceback"])
    assert kinds(seen, "progress_state", "progress", "executing")[-2:] == ["execution_error", "status"]
    status = (await history(http, gpu, pid))[pid]["status"]
    assert status["status_str"] == "error" and status["messages"][-1][0] == "execution_error"
    assert gpu.stats["failed"] == 1 and gpu.stats["served"] == 0


async def test_comfy_oom_fails_running_prompts_and_restart_forgets(
    make_gpu: MakeGPU, http: aiohttp.ClientSession
) -> None:
    gpu = await make_gpu("comfyui", job_vram_gb=13, step_ms=20, crash_sec=0.3)
    async with http.ws_connect(gpu.url + "/ws?clientId=c1") as ws:
        first = await submit(http, gpu, graph(50))
        second = await submit(http, gpu, graph(50, seed=2))
        errors = []
        async for msg in ws:  # the crash ends the socket
            data = json.loads(msg.data)
            if data["type"] == "execution_error":
                errors.append(data["data"])
    assert {e["prompt_id"] for e in errors} == {first, second}
    assert all(e["exception_message"].startswith("CUDA out of memory") for e in errors)
    assert all("TIPS:" in e["exception_message"] and e["exception_type"] == "torch.OutOfMemoryError"
               for e in errors)
    assert gpu.stats["oom_count"] == 2 and gpu.stats["crashes"] == 1
    await eventually(lambda: gpu.up, timeout=3)
    # a restart: history gone, the number counter back at 0
    assert await history(http, gpu, first) == {}
    gpu.job_vram_gb = 1
    assert (await post(http, gpu, graph(1, seed=7)))["number"] == 0


async def test_comfy_rejects_foreign_origin_on_loopback(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui")
    async with http.get(gpu.url + "/queue", headers={"Origin": "http://evil.example"}) as r:
        assert r.status == 403
    async with http.get(gpu.url + "/queue", headers={"Origin": gpu.url}) as r:
        assert r.status == 200
    assert gpu.stats["origin_rejects"] == 1
