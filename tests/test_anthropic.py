"""Anthropic Messages (`POST /v1/messages`) on an openai route, with the official `anthropic` SDK
(SPEC §19): usage feeds budgets, reservations and metrics; the prefix index reads `system` and
`messages`; a queued stream is kept alive with `event: ping`; every error the gateway makes, in a
body or in a stream, is Anthropic's shape, so the SDK raises it.

The node is the simulated LLM server, which answers `/v1/messages` as llama-server does
(kilolined/fakegpu/anthropic.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

import anthropic
import orjson
import pytest
from anthropic import AsyncAnthropic
from conftest import ADMIN, KEYS, auth, base_config, wait_until
from jobs_client import SSEReader

from kilolined.adapters.anthropic import MessagesParser, openai_usage
from kilolined.ops import views
from kilolined.scheduling.affinity import prefix_affinity
from kilolined.scheduling.anthropic_body import chat_view, is_anthropic_path, is_messages_path

MESSAGES = [{"role": "user", "content": "say something please"}]  # 3 prompt tokens for the fake
WORDS = ["The", " quick", " brown", " fox", " jumps"]


def llm_cfg(fake: Any, **route: Any) -> dict[str, Any]:
    route.setdefault("max_concurrency", 1)
    cfg = base_config({"o": fake.url}, kind="openai", path="/v1", **route)
    cfg["server"]["heartbeat_sec"] = 0.3
    return cfg


def client(gw: Any, who: str = "alice", key: str | None = None) -> AsyncAnthropic:
    # The SDK's base URL is the server's root: it adds /v1/messages itself.
    return AsyncAnthropic(base_url=gw.url, api_key=key or KEYS[who], max_retries=0, timeout=30)


async def hold_the_slot(http: Any, gw: Any, fake: Any, tokens: int) -> asyncio.Task[int]:
    async def one() -> int:
        body = {"model": "m", "messages": MESSAGES, "max_tokens": tokens}
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth("bob")) as r:
            await r.read()
            return r.status

    task = asyncio.create_task(one())
    await wait_until(lambda: fake.stats["running"] == 1)
    return task


async def tokens_metric(http: Any, gw: Any, key: str) -> float:
    async with http.get(gw.url + "/metrics", headers=ADMIN) as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith(f'kiloline_tokens_total{{key="{key}",route="gen"}}'):
            return float(line.split(" ")[1])
    return 0.0


async def test_messages_and_their_stream_count_usage_into_budgets_and_metrics(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=1)
    gw = await gateway(llm_cfg(fake))
    c = client(gw)
    done = await c.messages.create(model="m", max_tokens=4, system="be brief", messages=MESSAGES)
    assert done.content[0].text == "".join(WORDS[:4])  # type: ignore[union-attr]
    assert (done.usage.input_tokens, done.usage.output_tokens) == (5, 4)
    async with c.messages.stream(model="m", max_tokens=3, messages=MESSAGES) as s:
        text = "".join([t async for t in s.text_stream])
        final = await s.get_final_message()
    assert text == "".join(WORDS[:3]) and final.usage.output_tokens == 3
    await c.close()
    # 5 + 4 answered whole, 3 + 3 from the stream's message_start and message_delta
    assert await tokens_metric(http, gw, "alice") == 15
    assert gw.rt.budgets.usage("alice", __import__("time").time())["tokens"] == 15


async def test_a_token_budget_reserves_an_anthropic_request_before_it_reaches_the_node(fakegpus, gateway) -> None:
    fake = await fakegpus("openai", step_ms=1)
    cfg = llm_cfg(fake)
    cfg["keys"]["alice"]["budget"] = {"tokens_per_day": 30}
    gw = await gateway(cfg)
    c = client(gw)
    # ~3 prompt tokens + 40 to generate cannot fit in 30: refused before the node sees it.
    with pytest.raises(anthropic.RateLimitError) as e:
        await c.messages.create(model="m", max_tokens=40, messages=MESSAGES)
    assert e.value.status_code == 429
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "budget_exhausted"
    assert not [q for q in fake.requests if q["path"] == "/v1/messages"]
    await c.close()


async def test_gateway_errors_are_anthropic_shaped_and_the_sdk_raises_them(fakegpus, gateway) -> None:
    fake = await fakegpus("openai", step_ms=1)
    cfg = llm_cfg(fake)
    cfg["keys"]["bob"]["rate"] = {"per_minute": 0.001, "burst": 1}
    cfg["keys"]["carol"]["budget"] = {"requests_per_day": 1}
    gw = await gateway(cfg)

    bad = client(gw, key="kl_not_a_key_at_all_000000000000000")
    with pytest.raises(anthropic.AuthenticationError) as auth_err:
        await bad.messages.create(model="m", max_tokens=1, messages=MESSAGES)
    assert auth_err.value.body == {"type": "error", "request_id": auth_err.value.body["request_id"],  # type: ignore[index]
                                   "error": {"type": "authentication_error", "message": "missing or unknown API key",
                                             "code": "unauthorized", "retry_after_sec": None}}
    assert "request_id: " in str(auth_err.value)  # the SDK reads it from the top level, where Anthropic puts it

    bob = client(gw, "bob")
    await bob.messages.create(model="m", max_tokens=1, messages=MESSAGES)
    with pytest.raises(anthropic.RateLimitError) as rate:
        await bob.messages.create(model="m", max_tokens=1, messages=MESSAGES)
    assert rate.value.body["error"]["code"] == "rate_limited"  # type: ignore[index]
    assert rate.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]

    carol = client(gw, "carol")
    await carol.messages.create(model="m", max_tokens=1, messages=MESSAGES)
    with pytest.raises(anthropic.RateLimitError) as spent:
        await carol.messages.create(model="m", max_tokens=1, messages=MESSAGES)
    assert spent.value.body["error"]["code"] == "budget_exhausted"  # type: ignore[index]

    with pytest.raises(anthropic.BadRequestError) as bad_body:
        await client(gw).post("/v1/messages", cast_to=object, body=[1, 2])  # not an object
    assert bad_body.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    for c in (bad, bob, carol):
        await c.close()


async def test_a_queued_stream_pings_then_its_timeout_is_an_error_event_the_sdk_raises(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=100)
    gw = await gateway(llm_cfg(fake, queue_timeout_sec=0.8))
    ahead = await hold_the_slot(http, gw, fake, tokens=25)  # 2.5 s: longer than the queue timeout
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 5, "stream": True}
    async with http.post(gw.url + "/v1/messages", json=body, headers=auth()) as r:
        assert r.status == 200
        reader = SSEReader(r)
        events = await reader.rest(timeout=15)
    assert any(text.startswith("queued position=1") for _, text in reader.comments), reader.comments
    assert events[0].event == "ping" and orjson.loads(events[0].data) == {"type": "ping"}
    assert events[-1].event == "error", events
    err = orjson.loads(events[-1].data)
    assert err["type"] == "error" and err["error"]["type"] == "overloaded_error"
    assert err["error"]["code"] == "queue_timeout" and err["error"]["message"]
    assert all(e.event in ("ping", "error") for e in events)  # nothing OpenAI-shaped, no [DONE]

    c = client(gw)
    with pytest.raises(anthropic.APIStatusError) as info:
        async with c.messages.stream(model="m", max_tokens=5, messages=MESSAGES) as s:
            async for _ in s.text_stream:
                pass
    assert "queue" in str(info.value).lower()
    await c.close()
    assert await ahead == 200
    assert not [q for q in fake.requests if q["path"] == "/v1/messages"]


async def test_a_queued_stream_pings_until_its_node_answers_and_the_sdk_reads_it(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=100)
    gw = await gateway(llm_cfg(fake))
    ahead = await hold_the_slot(http, gw, fake, tokens=8)  # 0.8 s: a few heartbeats of 0.3 s
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 3, "stream": True}
    async with http.post(gw.url + "/v1/messages", json=body, headers=auth()) as r:
        assert r.status == 200
        events = await SSEReader(r).rest(timeout=15)
    names = [e.event for e in events]
    assert names[0] == "ping" and "message_start" in names and names[-1] == "message_stop", names
    assert set(names[:names.index("message_start")]) == {"ping"}
    assert await ahead == 200

    ahead = await hold_the_slot(http, gw, fake, tokens=8)
    c = client(gw)
    async with c.messages.stream(model="m", max_tokens=3, messages=MESSAGES) as s:
        assert "".join([t async for t in s.text_stream]) == "".join(WORDS[:3])
    assert await ahead == 200
    await c.close()


@pytest.mark.parametrize("flag", ["true", 1, 0, "false"])
async def test_a_stream_flag_that_is_not_a_json_boolean_is_refused_in_anthropics_shape(fakegpus, gateway, http,
                                                                                       flag: Any) -> None:
    """A lax node (vLLM's pydantic) reads "true" or 1 as true: the gateway refuses it before it
    reaches the node or the budget, in Anthropic's error shape."""
    fake = await fakegpus("openai")
    gw = await gateway(llm_cfg(fake))
    body = {"model": "m", "max_tokens": 3, "messages": MESSAGES, "stream": flag}
    async with http.post(gw.url + "/v1/messages", json=body, headers=auth("alice")) as r:
        assert r.status == 400
        got = await r.json()
    assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    assert "stream" in got["error"]["message"]
    assert fake.stats["served"] == 0


async def test_a_queued_request_timing_out_is_a_503_overloaded_error(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=100)
    gw = await gateway(llm_cfg(fake, queue_timeout_sec=0.5))
    ahead = await hold_the_slot(http, gw, fake, tokens=20)
    c = client(gw)
    with pytest.raises(anthropic.APIStatusError) as info:
        await c.messages.create(model="m", max_tokens=3, messages=MESSAGES)
    assert info.value.status_code == 503 and int(info.value.response.headers["Retry-After"]) >= 1
    assert info.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    assert info.value.body["error"]["code"] == "queue_timeout"  # type: ignore[index]
    await c.close()
    assert await ahead == 200


async def test_a_queued_stream_refused_by_the_token_budget_ends_with_an_error_event(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=100)
    cfg = llm_cfg(fake)
    cfg["keys"]["alice"]["budget"] = {"tokens_per_day": 30}
    gw = await gateway(cfg)
    ahead = await hold_the_slot(http, gw, fake, tokens=5)
    c = client(gw)
    with pytest.raises(anthropic.APIStatusError) as info:
        async with c.messages.stream(model="m", max_tokens=40, messages=MESSAGES) as s:
            async for _ in s.text_stream:
                pass
    assert info.value.body["error"]["code"] == "budget_exhausted"  # type: ignore[index]
    assert info.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    await c.close()
    assert await ahead == 200


async def test_a_node_dying_mid_stream_is_an_error_event_the_sdk_raises(fakegpus, gateway) -> None:
    fake = await fakegpus("openai", step_ms=100)
    # Not continued on another node (tests/test_continuation.py has those): the stream ends.
    gw = await gateway(llm_cfg(fake, continue_streams=False))
    c = client(gw)
    got: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as info:
        async with c.messages.stream(model="m", max_tokens=30, messages=MESSAGES) as s:
            async for t in s.text_stream:
                got.append(t)
                if len(got) == 1:
                    await fake.kill()  # a spot machine vanishing mid-answer
    assert got[:1] == ["The"]
    err = info.value.body["error"]  # type: ignore[index]
    assert err["type"] == "api_error" and err["code"] == "upstream_error"
    assert str(fake.port) not in err["message"]
    await c.close()
    await wait_until(lambda: views.state(gw.rt)["routes"]["gen"]["inflight"] == 0, timeout=3)


async def test_prefix_affinity_reads_system_and_messages(fakegpus, gateway, http) -> None:
    """Two nodes: the second request with the same long system prompt goes where the first went."""
    a, b = await fakegpus("openai", step_ms=1), await fakegpus("openai", step_ms=1)
    cfg = base_config({"a": a.url, "b": b.url}, kind="openai", path="/v1", affinity="prefix", max_concurrency=2)
    cfg["routes"]["gen"]["nodes"], cfg["routes"]["gen"]["standby"] = ["a", "b"], []
    gw = await gateway(cfg)
    c = client(gw)
    system = "You are a careful assistant. " * 40
    first = await c.messages.with_raw_response.create(model="m", max_tokens=1, system=system, messages=MESSAGES)
    second = await c.messages.with_raw_response.create(
        model="m", max_tokens=1, system=system, messages=[{"role": "user", "content": "another question"}])
    assert first.headers["X-KiloLine-Node"] == second.headers["X-KiloLine-Node"]
    await c.close()
    async with http.get(gw.url + "/metrics", headers=ADMIN) as r:
        text = await r.text()
    assert 'kiloline_affinity_decisions_total{outcome="hit",route="gen"} 1.0' in text, text


def test_the_prefix_of_a_messages_request_is_its_system_then_its_messages() -> None:
    data = {"model": "m", "system": [{"type": "text", "text": "rules " * 100}], "messages": MESSAGES}
    chat = {"model": "m", "messages": [{"role": "system", "content": "rules " * 100}, *MESSAGES]}
    a, b = prefix_affinity("r", chat_view(data), 64), prefix_affinity("r", chat, 64)
    assert a is not None and b is not None and a.keys == b.keys


def test_anthropic_usage_in_openai_names() -> None:
    assert openai_usage({"input_tokens": 7, "output_tokens": 2}) == {
        "prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
    # Anthropic's input_tokens exclude what the cache served
    assert openai_usage({"input_tokens": 3, "cache_read_input_tokens": 10, "output_tokens": 1}) == {
        "prompt_tokens": 13, "completion_tokens": 1, "total_tokens": 14, "prompt_tokens_details": {"cached_tokens": 10}}
    assert openai_usage({"output_tokens": -5, "input_tokens": "x"}) == {
        "prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    assert openai_usage({}) is None


def test_stream_parser_reads_message_start_and_message_delta_across_reads() -> None:
    p = MessagesParser()
    stream = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":12,'
              b'"output_tokens":0}}}\n\nevent: content_block_delta\ndata: {"type":"content_block_delta",'
              b'"index":0,"delta":{"type":"text_delta","text":"Hi"}}\n\nevent: message_delta\ndata: '
              b'{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":1}}\n\n')
    for i in range(0, len(stream), 7):
        p.feed(stream[i:i + 7])
    p.done(True)
    assert p.chunks == 1 and p.tokens() == 13 and p.first_at is not None
    spaced = MessagesParser()  # a serializer with blanks takes the parsing path: the same count
    spaced.feed(stream.replace(b'{"type":"content_block_delta"', b'{ "type": "content_block_delta"'))
    assert (spaced.chunks, spaced.tokens()) == (1, 13)
    whole = MessagesParser()
    whole.feed(b'{"type":"message","usage":{"input_tokens":4,"output_tokens":6}}')
    whole.done(True)
    assert whole.tokens() == 10


def test_which_paths_are_anthropics() -> None:
    for path in ("/v1/messages", "/llm/v1/messages", "/messages"):
        assert is_messages_path(path) and is_anthropic_path(path) and is_anthropic_path(path + "/count_tokens")
    for path in ("/v1/threads/t_1/messages", "/v1/chat/completions", "/v1/messages/count_tokens", "/x/messages"):
        assert not is_messages_path(path)
    assert not is_anthropic_path("/v1/threads/t_1/messages") and not is_anthropic_path("/count_tokens")
