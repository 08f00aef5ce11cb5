"""`--kind openai` of the simulated GPU, over real sockets: a `/v1`-only server with llama.cpp's errors."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from fakegpu_util import MakeGPU, eventually, sse_data

from kilolined.cli import build_parser

CHAT = {"model": "fake-llm", "messages": [{"role": "user", "content": "hello there big world"}]}


async def test_openai_completion_has_usage(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai", steps=3)
    async with http.post(gpu.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 5}) as r:
        assert r.status == 200
        body = await r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
                             "prompt_tokens_details": {"cached_tokens": 0}}
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



async def test_openai_serves_only_v1_paths(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    """Like vLLM: no `/chat/completions` or `/models` without the /v1 prefix."""
    gpu = await make_gpu("openai", steps=1)
    for path in ("/chat/completions", "/models"):
        method = http.post if path == "/chat/completions" else http.get
        async with method(gpu.url + path, json=CHAT) as r:
            assert r.status == 404
    async with http.post(gpu.url + "/v1/chat/completions", json=CHAT) as r:
        assert r.status == 200
    async with http.get(gpu.url + "/v1/health") as r:
        assert r.status == 200
    assert gpu.stats["served"] == 1


async def test_openai_stream_sends_usage_only_when_asked(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai")
    for options in (None, {}, {"include_usage": False}):
        req: dict[str, Any] = {**CHAT, "stream": True, "max_tokens": 3}
        if options is not None:
            req["stream_options"] = options
        async with http.post(gpu.url + "/v1/chat/completions", json=req) as r:
            chunks = [json.loads(e) for e in (await sse_data(r))[:-1]]
        assert all("usage" not in c and c["choices"] for c in chunks), options
    req = {**CHAT, "stream": True, "max_tokens": 3, "stream_options": {"include_usage": True}}
    async with http.post(gpu.url + "/v1/chat/completions", json=req) as r:
        chunks = [json.loads(e) for e in (await sse_data(r))[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 4 + 3
    assert [c["usage"] for c in chunks[:-1]] == [None] * 4


async def test_openai_node_key_is_required_as_llama_cpp_does(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai", steps=1, api_key="node-secret")
    url = gpu.url + "/v1/chat/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "node-secret"}):
        async with http.post(url, json=CHAT, headers=headers) as r:
            assert r.status == 401
            assert await r.json() == {"error": {"code": 401, "message": "Invalid API Key",
                                                "type": "authentication_error"}}
    async with http.get(gpu.url + "/v1/models/fake-llm") as r:
        assert r.status == 401
    for headers in ({"Authorization": "Bearer node-secret"}, {"X-Api-Key": "node-secret"}):
        async with http.post(url, json=CHAT, headers=headers) as r:
            assert r.status == 200
    for path in ("/health", "/v1/health", "/v1/models"):  # public in llama-server
        async with http.get(gpu.url + path) as r:
            assert r.status == 200, path
    assert gpu.stats["auth_rejects"] == 4 and gpu.stats["served"] == 2


async def test_openai_context_overflow_is_llama_cpps_400(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai", steps=1, ctx_size=4)
    expected = {"error": {"code": 400, "message": "request (4 tokens) exceeds the available context size (4 tokens), "
                                                  "try increasing it",
                          "type": "exceed_context_size_error", "n_prompt_tokens": 4, "n_ctx": 4}}
    for stream in (False, True):  # llama.cpp answers the first result's error with its status, streaming or not
        async with http.post(gpu.url + "/v1/chat/completions", json={**CHAT, "stream": stream}) as r:
            assert r.status == 400 and r.content_type == "application/json"
            assert await r.json() == expected
    short = {**CHAT, "messages": [{"role": "user", "content": "three words here"}], "max_tokens": 50}
    async with http.post(gpu.url + "/v1/chat/completions", json=short) as r:
        assert r.status == 200  # only the prompt counts against the context, not max_tokens
    assert gpu.stats["served"] == 1


async def test_openai_model_retrieve(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai")
    async with http.get(gpu.url + "/v1/models/fake-llm") as r:
        assert r.status == 200
        assert await r.json() == {"id": "fake-llm", "object": "model", "created": gpu.started_at,
                                  "owned_by": "kiloline"}
    async with http.get(gpu.url + "/v1/models/other") as r:
        assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
    assert gpu.stats["served"] == 0  # no GPU work


# --- multi-model mode: --models a,b,c --swap-ms N --warm-models K -------------------------------


async def test_multi_model_fake_swaps_lists_and_answers_running(make_gpu: MakeGPU,
                                                                http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai", models=["a", "b", "c"], swap_ms=10, warm_models=2, steps=1, step_ms=1)

    async def running() -> list[tuple[str, str]]:
        async with http.get(gpu.url + "/running") as r:
            doc = await r.json()
        # llama-swap's shape: every field of its runningModel, sorted by model id.
        assert all(set(e) == {"model", "state", "cmd", "proxy", "ttl", "name", "description"} for e in doc["running"])
        return [(e["model"], e["state"]) for e in doc["running"]]

    assert await running() == [("a", "ready")]  # the first model is warm at start
    async with http.get(gpu.url + "/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["a", "b", "c"]
    for model in ["a", "b", "a", "c", "b"]:  # swaps: b, c (evicts b), b (evicts a)
        async with http.post(gpu.url + "/v1/chat/completions", json={**CHAT, "model": model}) as r:
            assert r.status == 200 and (await r.json())["model"] == model
    assert gpu.stats["swaps"] == 3 and gpu.stats["warm"] == ["c", "b"]
    assert await running() == [("b", "ready"), ("c", "ready")]
    async with http.post(gpu.url + "/v1/chat/completions", json={**CHAT, "model": "zeta"}) as r:
        assert r.status == 404 and (await r.json())["error"]["type"] == "not_found_error"
    assert "vram_used_gb" in gpu.stats and "peak_vram_gb" in gpu.stats


async def test_a_swap_comes_before_the_first_byte(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai", models=["a", "b"], swap_ms=60_000, steps=1, step_ms=1)
    got_head = asyncio.Event()

    async def ask() -> None:
        async with http.post(gpu.url + "/v1/chat/completions", json={**CHAT, "model": "b", "stream": True}):
            got_head.set()

    task = asyncio.create_task(ask())

    async def loading() -> bool:
        async with http.get(gpu.url + "/running") as r:
            return [(e["model"], e["state"]) for e in (await r.json())["running"]] == [("a", "ready"),
                                                                                       ("b", "starting")]

    for _ in range(200):
        if await loading():
            break
        await asyncio.sleep(0.02)
    assert await loading() and not got_head.is_set()  # loading b: not a byte of the answer yet
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_fakegpu_cli_takes_the_multi_model_options() -> None:
    args = build_parser().parse_args(["fakegpu", "--kind", "openai", "--models", "a,b,c", "--swap-ms", "3000",
                                      "--warm-models", "2"])
    assert (args.models, args.swap_ms, args.warm_models) == ("a,b,c", 3000, 2)
