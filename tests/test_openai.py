"""openai kind: token budgets from `usage`, and unqueued paths that never wait behind the queue."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from conftest import ADMIN, KEYS, auth, base_config, wait_until
from openai import AsyncOpenAI

from kilolined import views

MESSAGES = [{"role": "user", "content": "say something please"}]


def llm_cfg(fake: Any, **route: Any) -> dict[str, Any]:
    cfg = base_config({"o": fake.url}, kind="openai", path="/v1", **route)
    return cfg


async def test_tokens_exhaust_tokens_per_day(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=1)
    cfg = llm_cfg(fake, max_concurrency=2)
    cfg["keys"]["alice"]["budget"] = {"tokens_per_day": 30}
    gw = await gateway(cfg)
    llm = AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["alice"], max_retries=0, timeout=30)
    used = 0
    # Each reserves 5 (prompt estimate) + 10 at dispatch and uses 3 + 10: two fit in 30, the third
    # no longer does and is refused before it reaches the node.
    for _ in range(2):
        r = await llm.chat.completions.create(model="fake-llm", messages=MESSAGES, max_tokens=10)
        assert r.usage is not None
        used += r.usage.total_tokens
    assert used == 26
    with pytest.raises(openai.RateLimitError) as e:
        await llm.chat.completions.create(model="fake-llm", messages=MESSAGES, max_tokens=10)
    assert e.value.status_code == 429
    assert e.value.body["type"] == "budget_exhausted"  # type: ignore[index]
    assert int(e.value.response.headers["Retry-After"]) >= 1
    # Streamed usage counts too: bob streams with include_usage, tokens land on his key.
    stream = await AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["bob"], max_retries=0).chat.completions.create(
        model="fake-llm", messages=MESSAGES, max_tokens=5, stream=True, stream_options={"include_usage": True})
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == 5
    async with http.get(gw.url + "/metrics", headers=ADMIN) as r:
        text = await r.text()
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1])
             for ln in text.splitlines() if ln.startswith("kiloline_tokens_total")}
    assert lines['kiloline_tokens_total{key="alice",route="gen"}'] == used
    assert lines['kiloline_tokens_total{key="bob",route="gen"}'] == usage.total_tokens
    assert gw.rt.budgets.usage("alice", __import__("time").time())["tokens"] == used


async def test_models_answer_while_the_queue_is_full(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=200)
    gw = await gateway(llm_cfg(fake, max_concurrency=1, max_queue_depth=1))
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 20}  # ~4 s each

    async def completion() -> int:
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
            await r.read()
            return r.status

    running = asyncio.create_task(completion())
    await wait_until(lambda: fake.stats["running"] == 1)
    waiting = asyncio.create_task(completion())
    await wait_until(lambda: views.state(gw.rt)["routes"]["gen"]["queue_depth"] == 1)
    assert await completion() == 429  # full
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with http.get(gw.url + "/v1/models", headers=auth()) as r:
        assert r.status == 200
        assert (await r.json())["data"][0]["id"] == "fake-llm"
    assert loop.time() - t0 < 2  # did not wait behind ~8 s of queued work
    assert views.state(gw.rt)["routes"]["gen"]["queue_depth"] == 1
    for t in (running, waiting):
        t.cancel()


async def test_comfy_status_answers_while_the_queue_is_full(fakegpus, gateway, http) -> None:
    fake = await fakegpus("comfyui", step_ms=100, steps=40)
    gw = await gateway(base_config({"c": fake.url}, kind="comfyui", max_concurrency=1, max_queue_depth=0))
    prompt = {"prompt": {"1": {"class_type": "KSampler", "inputs": {"steps": 40}},
                         "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0]}}}}
    async with http.post(gw.url + "/gen/prompt", json=prompt, headers=auth()) as r:
        assert r.status == 200
    # The slot is held while the node renders; the queue (depth 0) is full.
    async with http.post(gw.url + "/gen/prompt", json=prompt, headers=auth()) as r:
        assert r.status == 429
    async with http.get(gw.url + "/gen/system_stats", headers=auth()) as r:
        assert r.status == 200
        assert "devices" in await r.json()
    async with http.get(gw.url + "/gen/queue", headers=auth()) as r:
        assert r.status == 200
