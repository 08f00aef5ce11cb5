"""Rewriting requests end to end (docs/CONFIG.md#rewriting-requests): an alias reaches its node
under the served name and answers under the client's (sync and stream, with the official
`openai` SDK), default/set/strip reach the node as configured, a node's own rewrite follows the
route's, `/v1/models` lists the aliases, a model no node serves is 404 `model_not_found`.
Over loopback sockets to the fake OpenAI server, which keeps the bodies it got."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import anthropic
import openai
import pytest
from conftest import ADMIN, KEYS, auth, base_config, wait_until

from kilolined.fakegpu import FakeGPU

FAST = {"steps": 3, "step_ms": 2}


def llm_config(nodes: dict[str, str], **route: Any) -> dict[str, Any]:
    cfg = base_config(nodes)
    cfg["routes"] = {"llm": {"path": "/v1", "kind": "openai", "nodes": list(nodes), "max_concurrency": 2,
                             "queue_timeout_sec": 30, "request_timeout_sec": 30, **route}}
    return cfg


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}


def bodies(gpu: FakeGPU) -> list[dict[str, Any]]:
    return gpu.backend.bodies  # type: ignore[attr-defined,no-any-return]


async def test_an_alias_reaches_the_node_under_the_served_name_and_answers_under_the_clients(
        fakegpus: Any, gateway: Any) -> None:
    gpu = await fakegpus("openai", models=["qwen2.5-7b"], **FAST)
    cfg = llm_config({"box": gpu.url}, rewrite={"model": {"gpt-4o-mini": "qwen2.5-7b"}})
    cfg["nodes"]["box"]["models"] = ["qwen2.5-7b"]
    gw = await gateway(cfg)
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS["alice"], max_retries=0)
    answer = await client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}])
    assert answer.model == "gpt-4o-mini" and answer.choices[0].message.content
    stream = await client.chat.completions.create(model="gpt-4o-mini", stream=True,
                                                  messages=[{"role": "user", "content": "hi"}])
    chunks = [c async for c in stream]
    assert chunks and {c.model for c in chunks} == {"gpt-4o-mini"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The node was sent its own name both times (the fake refuses a model it does not list).
    assert [b["model"] for b in bodies(gpu)] == ["qwen2.5-7b", "qwen2.5-7b"]
    listed = {m.id async for m in client.models.list()}
    assert listed == {"qwen2.5-7b", "gpt-4o-mini"}
    with pytest.raises(openai.NotFoundError) as e:
        await client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and "'gpt-5'" in str(e.value)
    assert len(bodies(gpu)) == 2  # never sent to a node that does not serve it
    await client.close()


async def test_an_alias_answers_under_the_clients_name_in_jobs_and_anthropic_messages(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    gpu = await fakegpus("openai", **FAST)
    gw = await gateway(llm_config({"box": gpu.url}, rewrite={"model": {"claude-haiku": "qwen", "gpt-4o": "qwen"}}))
    async with http.post(gw.url + "/v1/chat/completions", json=chat("gpt-4o"),
                         headers={**auth(), "Prefer": "respond-async"}) as r:
        assert r.status == 202
        job = await r.json()
    for _ in range(200):
        async with http.get(gw.url + job["result_url"]) as r:
            if r.status == 200:
                assert (await r.json())["model"] == "gpt-4o"
                break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the job never completed")
    client = anthropic.AsyncAnthropic(base_url=gw.url, api_key=KEYS["alice"], max_retries=0)
    msg = await client.messages.create(model="claude-haiku", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert msg.model == "claude-haiku"
    async with client.messages.stream(model="claude-haiku", max_tokens=3,
                                      messages=[{"role": "user", "content": "hi"}]) as stream:
        final = await stream.get_final_message()
    assert final.model == "claude-haiku"
    assert [b["model"] for b in bodies(gpu)] == ["qwen"]  # the chat completion; /v1/messages is another handler
    await client.close()


async def test_default_set_and_strip_reach_the_node_as_configured(fakegpus: Any, gateway: Any,
                                                                  http: aiohttp.ClientSession) -> None:
    gpu = await fakegpus("openai", **FAST)
    gw = await gateway(llm_config({"box": gpu.url}, rewrite={
        "default": {"max_tokens": 2}, "set": {"temperature": 0.6}, "strip": ["logit_bias", "user"]}))
    for body in (chat("m", user="u1", logit_bias={"1": 5}, temperature=1.5),
                 chat("m", max_tokens=3, temperature=0.6)):
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
            assert r.status == 200, await r.text()
    first, second = bodies(gpu)
    assert first == {**chat("m"), "max_tokens": 2, "temperature": 0.6}
    assert second == {**chat("m"), "max_tokens": 3, "temperature": 0.6}  # the client's own max_tokens stays


async def test_a_nodes_rewrite_applies_after_the_routes(fakegpus: Any, gateway: Any,
                                                        http: aiohttp.ClientSession) -> None:
    gpu = await fakegpus("openai", **FAST)
    cfg = llm_config({"box": gpu.url}, rewrite={"model": {"gpt-4o": "qwen"}, "set": {"temperature": 0.6}})
    cfg["nodes"]["box"]["rewrite"] = {"model": {"qwen": "Qwen/Qwen2.5-32B-Instruct"}, "set": {"temperature": 0.2}}
    gw = await gateway(cfg)
    async with http.post(gw.url + "/v1/chat/completions", json=chat("gpt-4o"), headers=auth()) as r:
        assert r.status == 200
        assert (await r.json())["model"] == "gpt-4o"
    assert bodies(gpu) == [{**chat("Qwen/Qwen2.5-32B-Instruct"), "temperature": 0.2}]
    async with http.get(gw.url + "/v1/models", headers=auth()) as r:
        assert {m["id"] for m in (await r.json())["data"]} == {"qwen", "gpt-4o"}


async def test_a_multipart_forms_model_is_renamed(fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    gpu = await fakegpus("openai", models=["large-v3"], **FAST)
    cfg = llm_config({"box": gpu.url}, rewrite={"model": {"whisper-1": "large-v3"}})
    cfg["nodes"]["box"]["models"] = ["large-v3"]
    gw = await gateway(cfg)
    form = aiohttp.FormData()
    form.add_field("model", "whisper-1")
    form.add_field("file", b"RIFF" + bytes(40), filename="a.wav", content_type="audio/wav")
    async with http.post(gw.url + "/v1/audio/transcriptions", data=form, headers=auth()) as r:
        assert r.status == 200, await r.text()
    assert gpu.backend.asked == ["large-v3"]  # type: ignore[attr-defined]


async def test_a_rewrite_that_makes_the_body_invalid_is_400(fakegpus: Any, gateway: Any,
                                                            http: aiohttp.ClientSession) -> None:
    gpu = await fakegpus("openai", **FAST)
    gw = await gateway(llm_config({"box": gpu.url}, rewrite={"set": {"n": "two"}},
                                  cost={"unit": "json:/n", "per_unit": 1}))
    async with http.post(gw.url + "/v1/chat/completions", json=chat("m", n=1), headers=auth()) as r:
        body = await r.json()
    # The cost is read from the body the node would get: the rewrite's "two" is no number.
    assert r.status == 400 and body["error"]["type"] == "bad_request" and "/n" in body["error"]["message"]
    assert bodies(gpu) == []


async def test_a_model_no_node_of_the_route_serves_is_404_model_not_found(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    gpu = await fakegpus("openai", models=["a"], **FAST)
    cfg = llm_config({"box": gpu.url}, rewrite={"model": {"alias": "a"}})
    cfg["nodes"]["box"]["models"] = ["a"]
    gw = await gateway(cfg)
    async with http.post(gw.url + "/v1/chat/completions", json=chat("zeta"), headers=auth()) as r:
        body = await r.json()
    assert r.status == 404 and body["error"]["type"] == "model_not_found" and "'zeta'" in body["error"]["message"]
    assert bodies(gpu) == []


# --- overflow to a hosted API (docs/CONFIG.md#overflow) ------------------------------------------

CLOUD_KEY = "sk-cloud-0000000000000000"


async def overflow_gateway(fakegpus: Any, gateway: Any, when: float, local_steps: int,
                           **route: Any) -> tuple[Any, FakeGPU, FakeGPU]:
    """A local node (one slot, ``local_steps`` × 50 ms a request) and a "cloud" that wants its own
    key and knows the model by its own name, as overflow for ``when`` seconds."""
    local = await fakegpus("openai", steps=local_steps, step_ms=50)
    cloud = await fakegpus("openai", models=["provider/qwen-72b"], api_key=CLOUD_KEY, **FAST)
    cfg = llm_config({"local": local.url, "cloud": cloud.url}, max_concurrency=1,
                     overflow={"nodes": ["cloud"], "when_wait_sec": when}, **route)
    cfg["routes"]["llm"]["nodes"] = ["local"]
    cfg["nodes"]["cloud"].update(headers={"Authorization": f"Bearer {CLOUD_KEY}"},
                                 rewrite={"model": {"qwen": "provider/qwen-72b"}},
                                 price_per_mtok={"input": 0.5, "output": 1.5})
    return await gateway(cfg), local, cloud


async def ask(http: aiohttp.ClientSession, gw: Any) -> tuple[str, dict[str, Any]]:
    async with http.post(gw.url + "/v1/chat/completions", json=chat("qwen"), headers=auth()) as r:
        assert r.status == 200, await r.text()
        return r.headers["X-KiloLine-Node"], await r.json()


async def test_a_primary_busy_longer_than_when_wait_sec_overflows_to_the_cloud(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture) -> None:
    gw, local, cloud = await overflow_gateway(fakegpus, gateway, when=0.2, local_steps=40)  # 2 s on the gpu
    caplog.set_level(logging.INFO, logger="kilolined.access")
    first = asyncio.create_task(ask(http, gw))
    await wait_until(lambda: len(bodies(local)) == 1)
    node, body = await ask(http, gw)
    assert node == "cloud" and body["model"] == "qwen"
    assert [b["model"] for b in bodies(cloud)] == ["provider/qwen-72b"]  # its name, with its key (else 401)
    assert (await first)[0] == "local"
    line = next(r.getMessage() for r in caplog.records if " cloud " in r.getMessage())
    usage = body["usage"]
    usd = (usage["prompt_tokens"] * 0.5 + usage["completion_tokens"] * 1.5) / 1e6
    assert f"usd={usd:g}" in line
    # and on the bill (GET /admin/usage): the cloud's tokens at its price, the local GPU's time at none
    async with http.get(gw.url + "/admin/usage?group_by=route", headers=ADMIN) as r:
        assert r.status == 200
        rows = (await r.json())["rows"]
    assert len(rows) == 1 and rows[0]["requests"] == 2
    assert abs(rows[0]["cost_usd"] - usd) < 1e-9


async def test_a_primary_freed_within_when_wait_sec_keeps_the_request(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    gw, local, cloud = await overflow_gateway(fakegpus, gateway, when=20, local_steps=4)  # 0.2 s on the gpu
    first = asyncio.create_task(ask(http, gw))
    await wait_until(lambda: len(bodies(local)) == 1)
    assert (await ask(http, gw))[0] == "local"
    assert (await first)[0] == "local"
    for _ in range(3):  # the primary free: never the cloud
        assert (await ask(http, gw))[0] == "local"
    assert bodies(cloud) == []


async def test_an_estimate_beyond_when_wait_sec_overflows_at_once(
        fakegpus: Any, gateway: Any, http: aiohttp.ClientSession) -> None:
    # The gpu is busy 1 s, under the 5 s bound; the route expects 60 s a request: the estimate decides.
    gw, local, cloud = await overflow_gateway(fakegpus, gateway, when=5, local_steps=20, expected_duration_sec=60)
    first = asyncio.create_task(ask(http, gw))
    await wait_until(lambda: len(bodies(local)) == 1)
    assert (await ask(http, gw))[0] == "cloud"
    assert (await first)[0] == "local" and len(bodies(cloud)) == len(bodies(local)) == 1


async def test_with_the_primary_down_the_cloud_takes_it(fakegpus: Any, gateway: Any,
                                                        http: aiohttp.ClientSession) -> None:
    gw, local, cloud = await overflow_gateway(fakegpus, gateway, when=30, local_steps=2)
    async with http.post(gw.url + "/admin/nodes/local/drain", headers=ADMIN) as r:
        assert r.status == 200
    async with http.get(gw.url + "/health") as r:
        assert r.status == 200  # the route can still serve: through its overflow node
    assert (await ask(http, gw))[0] == "cloud"
    assert bodies(local) == [] and len(bodies(cloud)) == 1
    # What a client may ask for: the local node's models and the names the cloud is sent, never
    # the provider's own catalogue.
    async with http.get(gw.url + "/v1/models", headers=auth()) as r:
        assert sorted(m["id"] for m in (await r.json())["data"]) == ["fake-llm", "qwen"]


async def test_a_rewrite_added_by_a_reload_applies_to_the_next_request(fakegpus: Any, gateway: Any,
                                                                       http: aiohttp.ClientSession) -> None:
    gpu = await fakegpus("openai", **FAST)
    cfg = llm_config({"box": gpu.url})
    gw = await gateway(cfg)
    async with http.post(gw.url + "/v1/chat/completions", json=chat("gpt-4o"), headers=auth()) as r:
        assert (await r.json())["model"] == "gpt-4o"
    cfg["nodes"]["box"]["rewrite"] = {"model": {"gpt-4o": "qwen"}}  # a node's rewrite: the route's answer changes too
    gw.write_config(cfg)
    async with http.post(gw.url + "/admin/reload", headers=ADMIN) as r:
        assert r.status == 200, await r.text()
    async with http.post(gw.url + "/v1/chat/completions", json=chat("gpt-4o"), headers=auth()) as r:
        assert (await r.json())["model"] == "gpt-4o"
    assert [b["model"] for b in bodies(gpu)] == ["gpt-4o", "qwen"]
