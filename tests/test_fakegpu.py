"""The simulated GPU, over real loopback sockets: the card the gateway's own tests lean on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from kilolined.fakegpu import BLOB_PATTERN, FakeGPU

MakeGPU = Callable[..., Awaitable[FakeGPU]]


@pytest.fixture
async def make_gpu() -> AsyncIterator[MakeGPU]:
    made: list[FakeGPU] = []

    async def make(kind: str = "generic", **kw: Any) -> FakeGPU:
        kw.setdefault("steps", 5)
        kw.setdefault("step_ms", 10)
        kw.setdefault("crash_sec", 0.4)
        gpu = FakeGPU(kind, **kw)
        await gpu.start()
        made.append(gpu)
        return gpu

    yield make
    for gpu in made:
        await gpu.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        yield session


async def eventually(pred: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def sse_data(resp: aiohttp.ClientResponse) -> list[str]:
    """The `data:` payloads of an event stream, in order."""
    out = []
    async for line in resp.content:
        text = line.decode().strip()
        if text.startswith("data: "):
            out.append(text[len("data: "):])
    return out


async def refused(url: str) -> bool:
    """True when a fresh connection is refused (the fake's process is 'dead')."""
    async with aiohttp.ClientSession() as fresh:
        try:
            async with fresh.get(url + "/_fake/stats"):
                return False
        except aiohttp.ClientConnectorError:
            return True


# ----------------------------------------------------------------------------- generic


async def test_generic_job_answers_json_and_counts(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu(steps=3)
    async with http.post(gpu.url + "/generate", json={"echo": {"n": 7}}) as r:
        assert r.status == 200
        assert await r.json() == {"ok": True, "steps": 3, "echo": {"n": 7}, "node": str(gpu.port)}
    async with http.post(gpu.url + "/generate") as r:  # no body at all: the defaults
        assert (await r.json())["steps"] == 3
    async with http.post(gpu.url + "/generate", json={"steps": 1, "step_ms": 1}) as r:
        assert (await r.json())["steps"] == 1
    async with http.post(gpu.url + "/generate", data=b"{not json") as r:
        assert r.status == 400 and "error" in await r.json()
    async with http.get(gpu.url + "/health") as r:
        assert await r.json() == {"status": "ok"}
    async with http.get(gpu.url + "/_fake/stats") as r:
        stats = await r.json()
    assert stats["served"] == 3 and stats["running"] == 0 and stats["max_concurrent"] == 1
    assert stats["oom_count"] == 0 and stats["crashed"] is False and stats["health_checks"] == 1


async def test_generic_stream_writes_one_event_per_step(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu(steps=4)
    async with http.post(gpu.url + "/generate", json={"stream": True}) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_data(r)
    assert events[-1] == "[DONE]"
    assert [json.loads(e) for e in events[:-1]] == [{"step": i, "total": 4} for i in range(1, 5)]
    assert gpu.stats["served"] == 1


async def test_concurrent_jobs_within_vram_all_served(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu(vram_gb=24, job_vram_gb=4, steps=5, step_ms=20)

    async def one() -> int:
        async with http.post(gpu.url + "/generate") as r:
            return r.status

    assert await asyncio.gather(*(one() for _ in range(5))) == [200] * 5
    assert gpu.stats["max_concurrent"] == 5 and gpu.stats["served"] == 5 and gpu.stats["running"] == 0


async def test_burst_past_vram_fails_every_job_and_crashes(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu(vram_gb=24, job_vram_gb=10, steps=25, step_ms=20, crash_sec=0.4)

    async def one() -> tuple[int, Any]:
        async with http.post(gpu.url + "/generate") as r:
            return r.status, await r.json()

    first = [asyncio.create_task(one()) for _ in range(2)]
    await eventually(lambda: gpu.stats["running"] == 2)
    results = [await one(), *await asyncio.gather(*first)]
    assert [status for status, _ in results] == [500, 500, 500]
    assert all("CUDA out of memory" in body["error"] for _, body in results)
    stats = gpu.stats
    assert stats["oom_count"] == 3 and stats["crashes"] == 1 and stats["crashed"] is True
    assert stats["max_concurrent"] == 2 and stats["running"] == 0 and stats["served"] == 0

    await eventually(lambda: not gpu.up)
    assert await refused(gpu.url)
    await eventually(lambda: gpu.up, timeout=3)
    async with http.get(gpu.url + "/health") as r:
        assert r.status == 200
    assert gpu.stats["crashed"] is False
    async with http.post(gpu.url + "/generate", json={"steps": 1}) as r:
        assert r.status == 200


async def test_client_disconnect_counts_aborted_and_frees_vram(
    make_gpu: MakeGPU, http: aiohttp.ClientSession
) -> None:
    gpu = await make_gpu(steps=100, step_ms=20)
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(gpu.url + "/generate", timeout=aiohttp.ClientTimeout(total=0.15)) as r:
            await r.read()
    await eventually(lambda: gpu.stats["aborted"] == 1)
    assert gpu.stats["running"] == 0 and gpu.stats["served"] == 0 and gpu.vram_used_gb == 0


async def test_kill_resets_connections_and_revive_listens_again(
    make_gpu: MakeGPU, http: aiohttp.ClientSession
) -> None:
    gpu = await make_gpu(steps=100, step_ms=20)
    port = gpu.port
    job = asyncio.create_task(http.post(gpu.url + "/generate"))
    await eventually(lambda: gpu.stats["running"] == 1)
    await gpu.kill()
    with pytest.raises(aiohttp.ClientConnectionError):
        await job
    await eventually(lambda: gpu.stats["killed_jobs"] == 1)
    assert await refused(gpu.url)
    await asyncio.sleep(0.2)
    assert await refused(gpu.url)  # stays down, unlike a crash
    await gpu.revive()
    assert gpu.port == port
    async with http.get(gpu.url + "/health") as r:
        assert r.status == 200


async def test_control_knobs(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu(steps=1)
    control = gpu.url + "/_fake/control"
    async with http.post(control, json={"health_status": 503}) as r:
        assert r.status == 200 and (await r.json())["health_status"] == 503
    async with http.get(gpu.url + "/health") as r:
        assert r.status == 503
    async with http.post(control, json={"health_status": 200, "fail_status": 500}) as r:
        assert r.status == 200
    async with http.post(gpu.url + "/generate") as r:
        assert r.status == 500 and "error" in await r.json()
    assert gpu.stats["rejected"] == 1 and gpu.stats["served"] == 0
    async with http.post(control, json={"fail_status": None, "hang": True}) as r:
        assert r.status == 200
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(gpu.url + "/generate", timeout=aiohttp.ClientTimeout(total=0.2)):
            pass
    await eventually(lambda: gpu.stats["hanging"] == 0)
    async with http.post(control, json={"hang": False, "health_hang": True}) as r:
        assert r.status == 200
    with pytest.raises(asyncio.TimeoutError):
        async with http.get(gpu.url + "/health", timeout=aiohttp.ClientTimeout(total=0.2)):
            pass
    async with http.post(control, json={"health_hang": False, "bogus": 1, "drip_ms": -1}) as r:
        assert r.status == 400  # nothing is applied when any knob is wrong
    assert gpu.knobs.health_hang is True
    gpu.set_control(health_hang=False)
    async with http.post(gpu.url + "/generate") as r:
        assert r.status == 200
    async with http.post(gpu.url + "/_fake/reset") as r:
        stats = await r.json()
    assert stats["served"] == 0 and stats["rejected"] == 0 and stats["max_concurrent"] == 0


async def test_request_log_keeps_method_path_query_headers(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu(steps=1)
    async with http.post(gpu.url + "/generate?a=1&b=two", headers={"X-Probe": "yes"}) as r:
        assert r.status == 200
    async with http.get(gpu.url + "/_fake/stats"):
        pass
    async with http.get(gpu.url + "/_fake/requests") as r:
        seen = await r.json()
    assert len(seen) == 1  # /_fake/* is not logged
    assert seen[0]["method"] == "POST" and seen[0]["path"] == "/generate" and seen[0]["query"] == "a=1&b=two"
    assert seen[0]["headers"]["x-probe"] == "yes" and "host" in seen[0]["headers"]


async def test_blob_streams_the_pattern_and_unknown_paths_404(
    make_gpu: MakeGPU, http: aiohttp.ClientSession
) -> None:
    gpu = await make_gpu()
    size = 200_000
    async with http.get(gpu.url + "/blob", params={"bytes": str(size)}) as r:
        body = await r.read()
        assert r.headers["Content-Length"] == str(size)
    assert len(body) == size
    assert body == (BLOB_PATTERN * 4)[:size]
    async with http.get(gpu.url + "/blob?bytes=lots") as r:
        assert r.status == 400
    async with http.get(gpu.url + "/nope") as r:
        assert r.status == 404 and "error" in await r.json()
    assert gpu.stats["served"] == 0  # a download is not a job


async def test_cli_run_prints_url_and_exits_cleanly_on_sigterm() -> None:
    code = "import sys; from kilolined.fakegpu import run; sys.exit(run('generic', '127.0.0.1', 0, 24, 10, 2, 5, 1))"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        assert proc.stderr is not None
        line = (await asyncio.wait_for(proc.stderr.readline(), 10)).decode()
        assert line.startswith("fakegpu generic listening on http://127.0.0.1:")
        async with aiohttp.ClientSession() as s, s.post(line.split()[-1] + "/generate") as r:
            assert r.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# ----------------------------------------------------------------------------- openai

CHAT = {"model": "fake-llm", "messages": [{"role": "user", "content": "hello there big world"}]}


async def test_openai_completion_has_usage(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai", steps=3)
    async with http.post(gpu.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 5}) as r:
        assert r.status == 200
        body = await r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9}
    async with http.post(gpu.url + "/v1/chat/completions", json=CHAT) as r:
        assert (await r.json())["usage"]["completion_tokens"] == 3  # no max_tokens: `steps` tokens
    async with http.get(gpu.url + "/v1/models") as r:
        models = await r.json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-llm"
    assert models["data"][0]["owned_by"] == "kiloline"
    async with http.get(gpu.url + "/health") as r:
        assert await r.json() == {"status": "ok"}
    assert gpu.stats["served"] == 2


async def test_openai_stream_chunks_usage_and_done(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai")
    req = {**CHAT, "stream": True, "max_tokens": 4, "stream_options": {"include_usage": True}}
    async with http.post(gpu.url + "/v1/chat/completions", json=req) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = await sse_data(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas, final, usage = chunks[:4], chunks[4], chunks[5]
    assert deltas[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["choices"][0]["delta"]["content"] for c in deltas)
    assert all(c["usage"] is None for c in [*deltas, final])
    assert final["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert len(chunks) == 6

    async with http.post(gpu.url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 2}) as r:
        plain = await sse_data(r)
    assert len(plain) == 4 and "usage" not in json.loads(plain[0])  # 2 deltas, final, [DONE]


async def test_openai_errors_have_openai_shape(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai")
    url = gpu.url + "/v1/chat/completions"
    for body, param in ((b"{broken", None), (json.dumps({"model": "x"}).encode(), "messages")):
        async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            error = (await r.json())["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["param"] == param
    async with http.get(gpu.url + "/v1/nothing") as r:
        assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"


async def test_openai_oom_is_a_500_in_openai_shape(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai", job_vram_gb=13, steps=30, step_ms=20, crash_sec=0.3)

    async def one() -> tuple[int, Any]:
        async with http.post(gpu.url + "/v1/chat/completions", json=CHAT) as r:
            return r.status, await r.json()

    first = asyncio.create_task(one())
    await eventually(lambda: gpu.stats["running"] == 1)
    for status, body in (await one(), await first):
        assert status == 500 and "CUDA out of memory" in body["error"]["message"]
    await eventually(lambda: gpu.up, timeout=3)


# ----------------------------------------------------------------------------- comfyui


def graph(steps: int | None = 10, *, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    sampler: dict[str, Any] = {"model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0],
                               "latent_image": ["5", 0], "seed": 1}
    if steps is not None:
        sampler["steps"] = steps
    nodes = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "x.safetensors"}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": 512, "height": 512, "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["4", 1]}},
        "3": {"class_type": "KSampler", "inputs": sampler},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"images": ["8", 0], "filename_prefix": "ComfyUI"}},
    }
    nodes.update(extra or {})
    return nodes


async def submit(http: aiohttp.ClientSession, gpu: FakeGPU, prompt: dict[str, Any], client_id: str | None = "c1",
                 prefix: str = "") -> str:
    body: dict[str, Any] = {"prompt": prompt}
    if client_id is not None:
        body["client_id"] = client_id
    async with http.post(gpu.url + prefix + "/prompt", json=body) as r:
        answer = await r.json()
        assert r.status == 200, answer
    assert answer["node_errors"] == {} and isinstance(answer["number"], int)
    return str(answer["prompt_id"])


async def until_done(ws: aiohttp.ClientWebSocketResponse, prompt_id: str) -> list[dict[str, Any]]:
    """Messages up to and including `executing` with node null for this prompt."""
    seen = []
    while True:
        msg = await asyncio.wait_for(ws.receive_json(), 5)
        seen.append(msg)
        if msg["type"] == "executing" and msg["data"]["node"] is None and msg["data"]["prompt_id"] == prompt_id:
            return seen


async def test_comfy_ws_event_sequence_and_history(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui")
    async with http.ws_connect(gpu.url + "/ws?clientId=c1") as ws:
        hello = await ws.receive_json()
        assert hello == {"type": "status", "data": {"status": {"exec_info": {"queue_remaining": 0}}, "sid": "c1"}}
        pid = await submit(http, gpu, graph(10))
        async with http.get(f"{gpu.url}/history/{pid}") as r:
            assert await r.json() == {}  # still running
        seen = await until_done(ws, pid)
        # Fetched before anything else runs: history must already be there.
        async with http.get(f"{gpu.url}/api/history/{pid}") as r:
            entry = (await r.json())[pid]
    kinds = [m["type"] for m in seen if m["type"] != "status"]
    assert kinds[:2] == ["execution_start", "execution_cached"]
    assert kinds[-2:] == ["execution_success", "executing"]
    executing = [m["data"]["node"] for m in seen if m["type"] == "executing"]
    assert executing == ["4", "5", "6", "7", "3", "8", "9", None]  # dependencies first
    progress = [m["data"] for m in seen if m["type"] == "progress"]
    assert [p["value"] for p in progress] == list(range(1, 11))
    assert all(p["max"] == 10 and p["node"] == "3" and p["prompt_id"] == pid for p in progress)
    executed = next(m["data"] for m in seen if m["type"] == "executed")
    image = executed["output"]["images"][0]
    assert executed["node"] == "9" and image["subfolder"] == "" and image["type"] == "output"
    assert any(m["type"] == "status" for m in seen)  # queue changes are broadcast

    assert entry["status"]["status_str"] == "success" and entry["status"]["completed"] is True
    assert entry["outputs"]["9"]["images"] == [image] and entry["prompt"][1] == pid
    assert [m[0] for m in entry["status"]["messages"]] == ["execution_start", "execution_cached",
                                                           "execution_success"]
    async with http.get(gpu.url + "/view", params=image) as r:
        assert r.status == 200 and r.content_type == "image/png"
        png = await r.read()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")

    pid2 = await submit(http, gpu, graph(2), client_id=None)
    await eventually(lambda: gpu.stats["served"] == 2)
    async with http.get(f"{gpu.url}/history/{pid2}") as r:
        image2 = (await r.json())[pid2]["outputs"]["9"]["images"][0]
    async with http.get(gpu.url + "/api/view", params=image2) as r:
        assert await r.read() != png  # each prompt's image differs
    for params, status in (({"filename": "../secret.png"}, 400), ({"filename": "/etc/passwd"}, 400),
                           ({"filename": "missing.png"}, 404)):
        async with http.get(gpu.url + "/view", params=params) as r:
            assert r.status == status
    async with http.get(gpu.url + "/history") as r:
        assert set(await r.json()) == {pid, pid2}
    async with http.get(gpu.url + "/system_stats") as r:
        device = (await r.json())["devices"][0]
    assert device["vram_total"] == 24 * 1024**3 and device["vram_free"] == device["vram_total"]


async def test_comfy_without_client_id_sends_no_execution_events(
    make_gpu: MakeGPU, http: aiohttp.ClientSession
) -> None:
    gpu = await make_gpu("comfyui")
    async with http.ws_connect(gpu.url + "/ws?clientId=watcher") as ws:
        await ws.receive_json()
        pid = await submit(http, gpu, graph(3), client_id=None)
        await eventually(lambda: gpu.stats["served"] == 1)
        await asyncio.sleep(0.05)
        seen = []
        with contextlib.suppress(TimeoutError):
            while True:  # drain what was sent, until the socket goes quiet
                seen.append(await ws.receive_json(timeout=0.1))
    kinds = {m["type"] for m in seen}
    assert "progress" in kinds and "status" in kinds  # progress has no owner, so everyone gets it
    assert not kinds & {"execution_start", "executing", "executed", "execution_success"}
    async with http.get(f"{gpu.url}/history/{pid}") as r:
        assert (await r.json())[pid]["status"]["status_str"] == "success"


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
    async with http.get(f"{gpu.url}/history/{pid}") as r:
        status = (await r.json())[pid]["status"]
    assert status["status_str"] == "error" and status["completed"] is False
    assert "execution_interrupted" in [m[0] for m in status["messages"]]
    assert gpu.stats["interrupts"] == 1 and gpu.stats["running"] == 0 and gpu.stats["served"] == 0


async def test_comfy_parallel_queue_and_delete(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui", parallel=1, step_ms=20)
    pids = [await submit(http, gpu, graph(10), prefix="/api") for _ in range(3)]
    async with http.get(gpu.url + "/queue") as r:
        queue = await r.json()
    assert [item[1] for item in queue["queue_running"]] == pids[:1]
    assert [item[1] for item in queue["queue_pending"]] == pids[1:]
    async with http.get(gpu.url + "/prompt") as r:
        assert await r.json() == {"exec_info": {"queue_remaining": 3}}
    async with http.post(gpu.url + "/queue", json={"delete": [pids[2], pids[0]]}) as r:
        assert r.status == 200  # pids[0] is running: only pending prompts are removed
    assert gpu.stats["queue_deletes"] == 1 and gpu.stats["pending"] == 1
    await eventually(lambda: gpu.stats["served"] == 2)
    async with http.get(gpu.url + "/history") as r:
        assert set(await r.json()) == set(pids[:2])
    assert gpu.stats["max_concurrent"] == 1


async def test_comfy_validation_errors(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui")
    async with http.post(gpu.url + "/prompt", json={"client_id": "c1"}) as r:
        assert r.status == 400
        assert await r.json() == {"error": {"type": "no_prompt", "message": "No prompt provided",
                                            "details": "No prompt provided", "extra_info": {}}, "node_errors": {}}
    bad = graph(extra={"8": {"class_type": "MysteryNode", "inputs": {"samples": ["3", 0]}}})
    async with http.post(gpu.url + "/prompt", json={"prompt": bad}) as r:
        assert r.status == 400
        body = await r.json()
    assert body["error"]["type"] == "prompt_outputs_failed_validation"
    node = body["node_errors"]["8"]
    assert node["class_type"] == "MysteryNode" and node["dependent_outputs"] == ["9"]
    assert node["errors"][0]["type"] == "missing_node_type"
    no_out = {k: v for k, v in graph().items() if k != "9"}
    async with http.post(gpu.url + "/api/prompt", json={"prompt": no_out}) as r:
        assert r.status == 400 and (await r.json())["error"]["type"] == "prompt_no_outputs"
    assert gpu.stats["running"] == 0 and gpu.stats["pending"] == 0


async def test_comfy_fail_node_sends_execution_error(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui")
    failing = graph(2, extra={"8": {"class_type": "FailNode", "inputs": {"message": "boom", "x": ["3", 0]}}})
    async with http.ws_connect(gpu.url + "/ws?clientId=c1") as ws:
        pid = await submit(http, gpu, failing)
        seen = await until_done(ws, pid)
    error = next(m["data"] for m in seen if m["type"] == "execution_error")
    assert error["node_id"] == "8" and error["node_type"] == "FailNode" and error["exception_message"] == "boom"
    assert error["exception_type"] and isinstance(error["traceback"], list) and "3" in error["executed"]
    assert "execution_success" not in [m["type"] for m in seen]
    async with http.get(f"{gpu.url}/history/{pid}") as r:
        assert (await r.json())[pid]["status"]["status_str"] == "error"
    assert gpu.stats["failed"] == 1 and gpu.stats["served"] == 0


async def test_comfy_oom_fails_running_prompts_and_crashes(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui", job_vram_gb=13, step_ms=20, crash_sec=0.3)
    async with http.ws_connect(gpu.url + "/ws?clientId=c1") as ws:
        first = await submit(http, gpu, graph(50))
        second = await submit(http, gpu, graph(50))
        errors = []
        async for msg in ws:  # the crash ends the socket
            data = json.loads(msg.data)
            if data["type"] == "execution_error":
                errors.append(data["data"])
    assert {e["prompt_id"] for e in errors} == {first, second}
    assert all(e["exception_message"].startswith("CUDA out of memory") for e in errors)
    assert gpu.stats["oom_count"] == 2 and gpu.stats["crashes"] == 1
    await eventually(lambda: gpu.up, timeout=3)
    async with http.get(gpu.url + "/system_stats") as r:
        assert r.status == 200


async def test_comfy_rejects_foreign_origin_on_loopback(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("comfyui")
    async with http.get(gpu.url + "/queue", headers={"Origin": "http://evil.example"}) as r:
        assert r.status == 403
    async with http.get(gpu.url + "/queue", headers={"Origin": gpu.url}) as r:
        assert r.status == 200
    assert gpu.stats["origin_rejects"] == 1
