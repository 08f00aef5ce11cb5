"""Routes that match the request, end to end: several routes on /v1, chosen by the prompt's size,
the model and a header, each with its own queue; over loopback sockets to fake OpenAI servers."""

from __future__ import annotations

from typing import Any

import aiohttp
from conftest import auth, base_config

from kilolined.fakegpu import FakeGPU
from kilolined.fakegpu.openai import MODEL_ID


def routes_config(chat: FakeGPU, big: FakeGPU, fallback: bool = True) -> dict[str, Any]:
    cfg = base_config({"chat": chat.url, "big": big.url})
    common = {"path": "/v1", "kind": "openai", "max_concurrency": 2, "queue_timeout_sec": 30}
    cfg["routes"] = {
        "llm-batch": {**common, "nodes": ["big"], "match": {"min_units": 8000},
                      "cost": {"unit": "tokens", "default_max_tokens": 0}},
        "llm-coder": {**common, "nodes": ["big"], "match": {"model": ["qwen2.5-coder*"]}},
        "llm-tier": {**common, "nodes": ["big"], "match": {"header": {"X-Tier": "gold"}, "method": ["POST"]}},
    }
    if fallback:
        cfg["routes"]["llm-chat"] = {**common, "nodes": ["chat"]}
    cfg["keys"]["carol"]["routes"] = ["llm-chat"] if fallback else ["llm-tier"]
    return cfg


def chat_body(text: str, model: str = "fake-llm") -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], who: str = "alice",
               **headers: str) -> tuple[int, dict[str, Any]]:
    async with http.post(url + "/v1/chat/completions", json=body, headers={**auth(who), **headers}) as r:
        return r.status, await r.json()


async def test_the_first_route_whose_match_holds_takes_the_request(fakegpus: Any, gateway: Any,
                                                                   http: aiohttp.ClientSession) -> None:
    chat, big = await fakegpus("openai", step_ms=1), await fakegpus("openai", step_ms=1, ctx_size=100_000)
    gw = await gateway(routes_config(chat, big))
    routes = gw.rt.scheduler.routes
    assert (await post(http, gw.url, chat_body("hello")))[0] == 200
    assert chat.stats["served"] == 1 and big.stats["served"] == 0 and routes["llm-chat"].samples == 1
    long = "word " * 8000  # 40 000 characters: 10 000 tokens
    assert (await post(http, gw.url, chat_body(long)))[0] == 200
    assert big.stats["served"] == 1 and routes["llm-batch"].samples == 1
    assert (await post(http, gw.url, chat_body("fix it", "qwen2.5-coder:32b")))[0] == 200
    assert routes["llm-coder"].samples == 1
    assert (await post(http, gw.url, chat_body("hi"), **{"X-Tier": "gold"}))[0] == 200
    assert routes["llm-tier"].samples == 1
    assert chat.stats["served"] == 1 and big.stats["served"] == 3


async def test_the_chosen_route_decides_what_a_key_may_use(fakegpus: Any, gateway: Any,
                                                           http: aiohttp.ClientSession) -> None:
    chat, big = await fakegpus("openai", step_ms=1), await fakegpus("openai", step_ms=1, ctx_size=100_000)
    gw = await gateway(routes_config(chat, big))
    assert (await post(http, gw.url, chat_body("hello"), "carol"))[0] == 200
    status, body = await post(http, gw.url, chat_body("word " * 8000), "carol")
    assert status == 403 and body["error"]["type"] == "forbidden" and "llm-batch" in body["error"]["message"]
    assert big.stats["served"] == 0


async def test_no_match_and_no_fallback_is_404_naming_what_did_not_match(fakegpus: Any, gateway: Any,
                                                                         http: aiohttp.ClientSession) -> None:
    chat, big = await fakegpus("openai", step_ms=1), await fakegpus("openai", step_ms=1, ctx_size=100_000)
    gw = await gateway(routes_config(chat, big, fallback=False))
    status, body = await post(http, gw.url, chat_body("short"))
    assert status == 404 and body["error"]["type"] == "not_found"
    msg = body["error"]["message"]
    assert "llm-batch (units ≥ 8000)" in msg and "qwen2.5-coder*" in msg and "X-Tier" in msg
    assert chat.requests == [] and big.requests == []


async def test_models_on_a_shared_path_is_the_union_of_the_nodes_models(fakegpus: Any, gateway: Any,
                                                                         http: aiohttp.ClientSession) -> None:
    chat = await fakegpus("openai", models=["llama3", "qwen2.5-coder:32b"])
    big = await fakegpus("openai", models=["qwen2.5-coder:32b", "llama3.3:70b"])
    gw = await gateway(routes_config(chat, big))
    async with http.get(gw.url + "/v1/models", headers=auth()) as r:
        assert r.status == 200
        body = await r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["qwen2.5-coder:32b", "llama3.3:70b", "llama3"]
    await big.kill()
    async with http.get(gw.url + "/v1/models", headers=auth()) as r:
        assert r.status == 200  # a node that does not answer is left out, and so is a model only it
        # could take: chat serves qwen2.5-coder:32b too, but a request for it matches llm-coder
        assert [m["id"] for m in (await r.json())["data"]] == ["llama3"]


async def test_models_lists_only_what_a_request_can_reach_and_a_misrouted_model_is_refused(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    """docs/CONFIG.md's example: swap-box declares three models but only qwen2.5-coder* requests
    match its route; a request for the others falls to the chat node, a single-model server that
    answers whatever model is asked with its own (as llama.cpp does). SPEC §19: /v1/models lists
    what a client may ask for; a model no node of the route serves is 404 model_not_found, never
    sent elsewhere."""
    chat = await fakegpus("openai")  # serves MODEL_ID, whatever the request names
    swap = await fakegpus("openai", models=["qwen2.5-coder:32b", "deepseek-coder-v2", "llama3.3:70b"])
    cfg = base_config({"chat-4090": chat.url, "swap-box": swap.url})
    cfg["nodes"]["swap-box"]["models"] = ["qwen2.5-coder:32b", "deepseek-coder-v2", "llama3.3:70b"]
    common = {"path": "/v1", "kind": "openai", "max_concurrency": 2, "queue_timeout_sec": 30}
    cfg["routes"] = {"llm-coder": {**common, "nodes": ["swap-box"], "match": {"model": ["qwen2.5-coder*"]}},
                     "llm-chat": {**common, "nodes": ["chat-4090"]}}
    gw = await gateway(cfg)
    async with http.get(gw.url + "/v1/models", headers=auth()) as r:
        assert r.status == 200
        listed = [m["id"] for m in (await r.json())["data"]]
    assert listed == ["qwen2.5-coder:32b", MODEL_ID]
    for model in listed:  # each listed model is answered by a node that serves it
        status, body = await post(http, gw.url, chat_body("hi", model))
        assert status == 200 and body["model"] == model, body
    for model in ("deepseek-coder-v2", "llama3.3:70b"):
        status, body = await post(http, gw.url, chat_body("hi", model))
        assert status == 404 and body["error"]["type"] == "model_not_found", body
        assert repr(model) in body["error"]["message"] and "llm-coder" in body["error"]["message"]
