"""openai kind: token budgets from `usage`, and unqueued paths that never wait behind the queue."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest
from conftest import ADMIN, KEYS, auth, base_config, wait_until
from openai import AsyncOpenAI

from kilolined.adapters.openai import StreamParser, UsageStripper, estimate_tokens
from kilolined.core.config import parse_config
from kilolined.ops import views

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
    assert gw.rt.budgets.usage("alice", time.time())["tokens"] == used


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


# --- issue 13: the OpenAI adapter as real servers need it ------------------------------------------


async def test_shipped_example_route_reaches_a_v1_only_server(fakegpus, gateway, http) -> None:
    """The fake serves only /v1/... (as vLLM): the node's url is its root, the route keeps /v1."""
    shipped = parse_config(Path(__file__).parent.parent.joinpath("etc/kiloline.yaml").read_text(),
                           env={"KILOLINE_ADMIN_KEY": "kl_example_admin_7f3a9c", "ALICE_KEY": "kl_example_alice_e41b8d",
                                "BOB_KEY": "kl_example_bob_20c5a6"})
    assert shipped.routes["llm"].path == "/v1" and shipped.routes["llm"].strips_path is False
    assert shipped.routes["comfy"].strips_path is True
    fake = await fakegpus("openai", step_ms=1)
    gw = await gateway(llm_cfg(fake))
    c = AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["alice"], max_retries=0, timeout=30)
    done = await c.chat.completions.create(model="fake-llm", messages=MESSAGES, max_tokens=2)
    assert done.choices[0].message.content == "The quick"
    assert [m.id for m in (await c.models.list()).data] == ["fake-llm"]
    await c.close()
    assert [q["path"] for q in fake.requests if q["path"] != "/health"] == ["/v1/chat/completions", "/v1/models"]


async def test_strip_path_true_cuts_the_prefix(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=1)
    gw = await gateway(base_config({"o": fake.url}, kind="openai", path="/llm", strip_path=True))
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 1}
    async with http.post(gw.url + "/llm/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status == 200, await r.text()
    assert fake.requests[-1]["path"] == "/v1/chat/completions"


async def test_models_retrieve_never_queues(fakegpus, gateway, http) -> None:
    """GET /v1/models/{id} (the SDK's models.retrieve) is answered while the only slot is busy and
    the queue holds nothing more (a queued request would get 429 queue_full)."""
    fake = await fakegpus("openai", step_ms=100)
    # The old spelling of a /v1 route (prefix cut, node url with /v1) sees the tail /models/{id}.
    gw = await gateway(base_config({"o": fake.url + "/v1"}, kind="openai", path="/v1", strip_path=True,
                                   max_concurrency=1, max_queue_depth=0))
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 30}

    async def completion() -> int:
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
            await r.read()
            return r.status

    running = asyncio.create_task(completion())
    await wait_until(lambda: fake.stats["running"] == 1)
    c = AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["alice"], max_retries=0, timeout=30)
    model = await c.models.retrieve("fake-llm")
    assert model.id == "fake-llm"
    assert not running.done()
    await c.close()
    running.cancel()


async def test_stream_without_include_usage_counts_prompt_and_completion(fakegpus, gateway, http) -> None:
    """The SDK's default stream: the gateway asks the node for usage and cuts the extra chunk."""
    fake = await fakegpus("openai", step_ms=1)
    gw = await gateway(llm_cfg(fake))
    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True, "max_tokens": 4}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status == 200
        text = (await r.read()).decode()
    datas = [ln[5:].strip() for ln in text.splitlines() if ln.startswith("data:")]
    assert datas[-1] == "[DONE]"
    chunks = [orjson.loads(d) for d in datas[:-1]]
    assert not any(ch.get("usage") for ch in chunks), "the usage the client did not ask for is cut"
    # ... and what the node put beside it stays: its timings, on a chunk of their own
    *tokens, last = chunks
    assert last["choices"] == [] and last["timings"]["predicted_n"] == 4
    assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in tokens) == "The quick brown fox"
    assert "\n\n\n" not in text  # the cut event leaves no stray blank line
    assert gw.rt.budgets.usage("alice", time.time())["tokens"] == 3 + 4


async def test_a_streamed_job_result_has_no_usage_chunk_the_client_did_not_ask_for(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=1)
    gw = await gateway(llm_cfg(fake))
    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True, "max_tokens": 4}
    async with http.post(gw.url + "/v1/chat/completions", json=body,
                         headers={**auth(), "X-KiloLine-Mode": "async"}) as r:
        assert r.status == 202
        result_url = (await r.json())["result_url"]
    for _ in range(200):
        async with http.get(gw.url + result_url) as r:
            if r.status != 425:
                text = (await r.read()).decode()
                break
        await asyncio.sleep(0.05)
    datas = [ln[5:].strip() for ln in text.splitlines() if ln.startswith("data:")]
    assert datas and datas[-1] == "[DONE]", text
    assert not any(orjson.loads(d).get("usage") for d in datas[:-1]), "the usage is not the client's"
    assert "timings" in orjson.loads(datas[-2]), "the node's timings are"
    assert gw.rt.budgets.usage("alice", time.time())["tokens"] == 3 + 4


async def test_token_budget_holds_for_concurrent_and_queued_requests(fakegpus, gateway, http) -> None:
    """Each request reserves 5 + 10 tokens at dispatch and uses 3 + 10; 40 hold two of them."""
    fake = await fakegpus("openai", step_ms=30)
    cfg = llm_cfg(fake, max_concurrency=2)
    cfg["keys"]["alice"]["budget"] = {"tokens_per_day": 40}
    gw = await gateway(cfg)
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 10}

    async def completion() -> tuple[int, Any]:
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
            return r.status, await r.json()

    results = await asyncio.gather(*(completion() for _ in range(6)))
    statuses = sorted(s for s, _ in results)
    assert statuses == [200, 200, 429, 429, 429, 429], results
    assert {b["error"]["type"] for s, b in results if s == 429} == {"budget_exhausted"}
    assert gw.rt.budgets.usage("alice", time.time())["tokens"] == 26
    assert len([q for q in fake.requests if q["path"] == "/v1/chat/completions"]) == 2
    assert gw.rt.budgets.reserved == {}


async def test_node_refusing_the_gateways_key_is_a_node_failure(fakegpus, gateway, http, caplog) -> None:
    fake = await fakegpus("openai", step_ms=1, api_key="node-key")
    cfg = llm_cfg(fake, retry_on_failover=0)
    cfg["nodes"]["o"]["headers"] = {"Authorization": "Bearer wrong-node-key"}
    gw = await gateway(cfg)
    c = AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["alice"], max_retries=0, timeout=30)
    for stream in (False, True, False):
        with pytest.raises(openai.InternalServerError) as e:
            await c.chat.completions.create(model="fake-llm", messages=MESSAGES, max_tokens=1, stream=stream)
        assert e.value.status_code == 502
        assert e.value.body["type"] == "upstream_error"  # type: ignore[index]
    await c.close()
    assert any(r.levelname == "ERROR" and "credentials" in r.getMessage() for r in caplog.records)
    assert views.state(gw.rt)["nodes"]["o"]["breaker"] == "open"


async def test_stream_headers_and_access_log_tell_the_truth(fakegpus, gateway, http, caplog) -> None:
    """A stream names its node; a stream that failed after its 200 is logged with the status it
    would have had; a streamed success feeds the route's service-time average."""
    caplog.set_level(logging.INFO, logger="kilolined.access")
    fake = await fakegpus("openai", step_ms=100)
    gw = await gateway(llm_cfg(fake, max_concurrency=1, queue_timeout_sec=0.5))
    body = {"model": "fake-llm", "messages": MESSAGES, "stream": True, "max_tokens": 15}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
        assert r.status == 200 and r.headers["X-KiloLine-Node"] == "o"
        first = asyncio.create_task(r.read())
        await wait_until(lambda: fake.stats["running"] == 1)
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth("bob")) as late:
            assert late.status == 200  # it had to wait: the 200 went out while queued
            assert b"queue_timeout" in await late.read()
        await first
    mean = gw.rt.scheduler.routes["gen"].mean_service
    assert mean is not None and mean >= 1.4  # fifteen 100 ms tokens: the stream's real service time
    lines = [r.getMessage() for r in caplog.records if r.name == "kilolined.access"]
    assert any(" bob gen - sync 503 " in ln for ln in lines), lines
    assert any(" alice gen o sync 200 " in ln for ln in lines), lines


# llama.cpp's last chunks, as docs/BACKENDS.md records them (no include_usage: only `timings`).
LLAMA_FINISH = (b'data: {"choices":[{"finish_reason":"length","index":0,"delta":{}}],"object":"chat.completion.chunk",'
                b'"timings":{"cache_n":16,"prompt_n":1,"prompt_ms":1.4,"predicted_n":4,"predicted_ms":1.8}}\n\n'
                b"data: [DONE]\n\n")
LLAMA_USAGE = (b'data: {"choices":[],"object":"chat.completion.chunk","usage":{"completion_tokens":4,'
               b'"prompt_tokens":17,"total_tokens":21,"prompt_tokens_details":{"cached_tokens":16}},'
               b'"timings":{"cache_n":16,"prompt_n":1,"predicted_n":4}}\n\n')
CONTENT = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" grup"}}]}\n\n'


def test_llama_timings_count_cached_prompt_tokens() -> None:
    p = StreamParser()
    for chunk in (CONTENT, CONTENT, LLAMA_FINISH):
        p.feed(chunk)
    p.done(True)
    assert p.tokens() == 16 + 1 + 4


@pytest.mark.parametrize("cut", [1, 7, 40, 200, 10_000])
def test_usage_stripper_cuts_only_the_usage(cut: int) -> None:
    """The usage the gateway asked for goes; llama.cpp's timings, on the same chunk, stay."""
    stream = CONTENT + LLAMA_USAGE + b"data: [DONE]\n\n"
    s = UsageStripper()
    out = b"".join(s.feed(stream[i:i + cut]) for i in range(0, len(stream), cut)) + s.flush()
    assert out == CONTENT + (b'data: {"choices":[],"object":"chat.completion.chunk",'
                             b'"timings":{"cache_n":16,"prompt_n":1,"predicted_n":4}}\n\n') + b"data: [DONE]\n\n"
    # a usage chunk with nothing but the envelope goes whole, blank line included
    bare = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{}}\n\n'
    assert UsageStripper().feed(CONTENT + bare + b"data: [DONE]\n\n") == CONTENT + b"data: [DONE]\n\n"
    # a chunk that carries "usage": null with content is the client's and stays
    kept = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}],"usage":null}\n\n'
    assert UsageStripper().feed(kept) == kept


def test_prompt_estimate() -> None:
    data = {"messages": [{"role": "system", "content": "abcde"},
                         {"role": "user", "content": [{"type": "text", "text": "fgh"}, {"type": "image_url"}]}],
            "max_tokens": 10}
    assert estimate_tokens(data) == 2 + 10  # 8 characters ÷ 4, then max_tokens
    assert estimate_tokens({"prompt": "abcdefghi", "max_completion_tokens": 3}) == 3 + 3
    assert estimate_tokens({"messages": [{"content": "a"}, {"content": "b"}]}) == 1  # rounded up once
