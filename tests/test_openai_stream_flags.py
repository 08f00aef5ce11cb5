"""The stream switches of an OpenAI body are read as JSON booleans, by the gateway and the node
alike: anything else is refused before it can reach a server that reads it laxly."""

from __future__ import annotations

import time
from typing import Any

import pytest
from conftest import auth, base_config

MESSAGES = [{"role": "user", "content": "say something please"}]


@pytest.mark.parametrize("flags", [
    {"stream": "true"},  # vLLM's pydantic reads it as true: a stream without the usage asked for
    {"stream": 1},
    {"stream": "false"},
    {"stream": True, "stream_options": {"include_usage": "true"}},
    {"stream": True, "stream_options": {"include_usage": 0}},
])
async def test_a_stream_switch_that_is_not_a_boolean_is_refused(fakegpus, gateway, http, flags: dict[str, Any]) -> None:
    fake = await fakegpus("openai", step_ms=1)
    cfg = base_config({"o": fake.url}, kind="openai", path="/v1")
    cfg["keys"]["alice"]["budget"] = {"tokens_per_day": 1000, "requests_per_day": 10}
    gw = await gateway(cfg)
    body = {"model": "fake-llm", "messages": MESSAGES, "max_tokens": 4, **flags}
    for mode in ("sync", "sse"):
        async with http.post(gw.url + "/v1/chat/completions", json=body,
                             headers={**auth(), "X-KiloLine-Mode": mode}) as r:
            assert r.status == 400, await r.text()
            err = (await r.json())["error"]
            assert err["type"] == "bad_request" and "true or false" in err["message"]
            assert err["request_id"] == r.headers["X-Request-Id"]
    assert not [q for q in fake.requests if q["path"] == "/v1/chat/completions"]
    assert gw.rt.budgets.usage("alice", time.time())["requests"] == 0  # refused: it costs nothing


async def test_json_booleans_and_null_pass(fakegpus, gateway, http) -> None:
    fake = await fakegpus("openai", step_ms=1)
    gw = await gateway(base_config({"o": fake.url}, kind="openai", path="/v1"))
    for flags in ({"stream": None}, {"stream": False}, {"stream": True, "stream_options": {"include_usage": None}},
                  {"stream": True, "stream_options": {"include_usage": False}}):
        body = {"model": "fake-llm", "messages": MESSAGES, "max_tokens": 2, **flags}
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth()) as r:
            assert r.status == 200, (flags, await r.text())
            await r.read()
