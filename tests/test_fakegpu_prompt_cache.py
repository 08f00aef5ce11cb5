"""The simulated GPU's prompt cache, over real sockets: a repeated prompt is reported cached and
costs no prefill, in llama-server's `timings` and `usage.prompt_tokens_details` (docs/BACKENDS.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import time
from typing import Any

import aiohttp
import pytest
from fakegpu_util import MakeGPU, eventually, sse_data

from kilolined.fakegpu.prompt_cache import PromptCache, common_prefix, prompt_tokens

DOC = " ".join(f"w{i}" for i in range(1000))  # 1000 tokens: one per word
TIMING_KEYS = ["cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
               "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second"]


def chat(text: str = DOC, **extra: Any) -> dict[str, Any]:
    return {"model": "fake-llm", "messages": [{"role": "user", "content": text}], "max_tokens": 3, **extra}


async def complete(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        out: dict[str, Any] = await r.json()
        return out


async def stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with http.post(url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status == 200
        events = await sse_data(r)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_repeated_prompt_is_cached_and_skips_the_prefill(make_gpu: MakeGPU,
                                                               http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai", prefill_ms_per_1k=200)
    cold = await complete(http, gpu.url, chat())
    warm = await complete(http, gpu.url, chat())
    assert list(cold["timings"]) == TIMING_KEYS
    assert cold["usage"]["prompt_tokens"] == 1000 and cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert (cold["timings"]["cache_n"], cold["timings"]["prompt_n"], cold["timings"]["prompt_ms"]) == (0, 1000, 200)
    assert cold["timings"]["prompt_per_second"] == 5000 and cold["timings"]["predicted_n"] == 3
    # As llama.cpp: one token is always computed, so a repeat is all cached but one.
    assert warm["usage"]["prompt_tokens_details"] == {"cached_tokens": 999}
    assert (warm["timings"]["cache_n"], warm["timings"]["prompt_n"]) == (999, 1)
    assert cold["timings"]["prompt_ms"] - warm["timings"]["prompt_ms"] == pytest.approx(999 * 0.2)
    assert gpu.stats["prompt_cache_entries"] == 1


async def test_stream_reports_timings_on_its_last_chunk(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai", prefill_ms_per_1k=100)
    plain = await stream(http, gpu.url, chat())
    finish = plain[-1]
    assert finish["choices"][0]["finish_reason"] == "length" and finish["choices"][0]["delta"] == {}
    timings = finish["timings"]
    assert (timings["cache_n"], timings["prompt_n"], timings["prompt_ms"]) == (0, 1000, 100)
    assert all("timings" not in c for c in plain[:-1])
    # With include_usage: the usage chunk is last and carries both; the finish chunk has no timings.
    usage = await stream(http, gpu.url, chat(stream_options={"include_usage": True}))
    last, finish = usage[-1], usage[-2]
    assert last["choices"] == [] and "timings" not in finish
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": 999}
    assert (last["timings"]["cache_n"], last["timings"]["prompt_n"], last["timings"]["predicted_n"]) == (999, 1, 3)
    assert last["timings"]["prompt_ms"] == pytest.approx(0.1)
    assert all("timings" not in c for c in usage[:-1])


async def test_next_turn_reuses_the_prompt_and_the_reply(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai", prefill_ms_per_1k=50)
    first = await complete(http, gpu.url, chat())
    reply = first["choices"][0]["message"]
    turn = {"model": "fake-llm", "max_tokens": 3, "messages": [
        {"role": "user", "content": DOC}, reply, {"role": "user", "content": "and then what"}]}
    second = await complete(http, gpu.url, turn)
    held = len(prompt_tokens(turn["messages"][:2]))
    assert second["timings"]["cache_n"] == held and second["timings"]["prompt_n"] == 3
    # Another role saying the same words is another prompt.
    other = await complete(http, gpu.url, {**chat(), "messages": [{"role": "system", "content": DOC}]})
    assert other["timings"]["cache_n"] == 0


async def test_a_prompt_in_use_is_not_shared_with_a_concurrent_request(make_gpu: MakeGPU,
                                                                       http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai", step_ms=50)
    await complete(http, gpu.url, chat())
    long = asyncio.create_task(complete(http, gpu.url, chat(max_tokens=400)))
    try:
        await eventually(lambda: gpu.stats["running"] == 1)
        # -no-kvu: the saved prompt is loaded into the first request's slot; the second computes it all.
        meanwhile = await complete(http, gpu.url, chat(max_tokens=1))
        assert meanwhile["timings"]["cache_n"] == 0
        assert long.done() is False
    finally:
        long.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await long
    await eventually(lambda: gpu.stats["running"] == 0)
    again = await complete(http, gpu.url, chat())
    assert again["timings"]["cache_n"] == 999


async def test_cache_is_bounded_and_evicts_the_least_recently_used(make_gpu: MakeGPU,
                                                                    http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai", prompt_cache_tokens=2500)
    doc_b = " ".join(f"b{i}" for i in range(1000))
    doc_c = " ".join(f"c{i}" for i in range(1000))
    await complete(http, gpu.url, chat())
    await complete(http, gpu.url, chat(doc_b))
    assert (await complete(http, gpu.url, chat()))["timings"]["cache_n"] == 999  # A is now the newest
    await complete(http, gpu.url, chat(doc_c))  # B, the oldest, makes room
    assert gpu.stats["prompt_cache_tokens"] <= 2500 and gpu.stats["prompt_cache_entries"] == 2
    assert (await complete(http, gpu.url, chat(doc_b)))["timings"]["cache_n"] == 0
    none = await make_gpu("openai", prompt_cache_tokens=0)
    await complete(http, none.url, chat())
    assert (await complete(http, none.url, chat()))["timings"]["cache_n"] == 0


async def test_crash_and_model_swap_forget_the_cache(make_gpu: MakeGPU, http: aiohttp.ClientSession) -> None:
    gpu = await make_gpu("openai")
    await complete(http, gpu.url, chat())
    await gpu.kill()
    await gpu.revive()
    assert (await complete(http, gpu.url, chat()))["timings"]["cache_n"] == 0
    swapping = await make_gpu("openai", models=["a", "b"], warm_models=1)
    await complete(http, swapping.url, {**chat(), "model": "a"})
    await complete(http, swapping.url, {**chat(), "model": "b"})  # a is unloaded, its cache with it
    assert (await complete(http, swapping.url, {**chat(), "model": "b"}))["timings"]["cache_n"] == 999
    assert (await complete(http, swapping.url, {**chat(), "model": "a"}))["timings"]["cache_n"] == 0


async def test_cli_flags_set_the_prefill_cost_and_the_bound(http: aiohttp.ClientSession) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kilolined", "fakegpu", "--kind", "openai", "--port", "0",
                             "--steps", "2", "--step-ms", "1", "--prefill-ms-per-1k", "40",
                             "--prompt-cache-tokens", "500"],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = await asyncio.to_thread(proc.stderr.readline)
        m = re.search(r"listening on (http://\S+)", line)
        assert m, line
        url = m.group(1)
        short = " ".join(f"s{i}" for i in range(400))
        cold = await complete(http, url, chat(short))
        assert (cold["timings"]["prompt_n"], cold["timings"]["prompt_ms"]) == (400, 16)
        assert (await complete(http, url, chat(short)))["timings"]["cache_n"] == 399
        await complete(http, url, chat())  # 1000 tokens: more than the cache holds, so not kept
        assert (await complete(http, url, chat()))["timings"]["cache_n"] == 0
    finally:
        proc.terminate()
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_prompt_cache_logic() -> None:
    assert common_prefix(["a", "b", "c"], ["a", "b", "d", "e"]) == 2
    assert common_prefix([], ["a"]) == 0 and common_prefix(["a"], ["a"]) == 1
    cache = PromptCache(max_tokens=10)
    hit = cache.lookup("m", ["x", "y"])
    assert hit.cached == 0
    cache.save("m", ["x", "y", "z"], hit)
    cache.save("m", ["x", "y", "z", "w"])  # the shorter entry is a prefix of this one: dropped
    assert len(cache) == 1 and cache.tokens == 4
    cache.save("m", ["x", "y"])  # held in full already
    assert len(cache) == 1
    assert cache.lookup("other", ["x", "y", "z"]).cached == 0
    hit = cache.lookup("m", ["x", "y", "z", "q"])
    assert hit.cached == 3 and cache.lookup("m", ["x", "y", "z", "q"]).cached == 0  # busy
    cache.release(hit)
    assert cache.lookup("m", ["x", "y", "z", "w"]).cached == 3  # all but one
    assert prompt_tokens([{"role": "user", "content": [{"type": "text", "text": "a b"}, {"type": "image_url"}]},
                          {"role": "assistant", "content": None}, "junk"]) == ["user\0a", "b"]
