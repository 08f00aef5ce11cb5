"""An OpenAI request's body is parsed once per request by the gateway, whatever reads its fields
(affinity keys, the stream flag, the usage rewrite, token budgets, the observer)."""

from __future__ import annotations

import sys
from typing import Any

import orjson
import pytest
from conftest import auth, base_config

from kilolined.wire.proxy import Exchange


def count_gateway_parses(monkeypatch: pytest.MonkeyPatch, body: bytes) -> list[str]:
    """Patch orjson.loads to record each gateway module that parses exactly ``body`` (the fake
    node runs in this process too and parses what it is sent: it is not counted)."""
    real = orjson.loads
    seen: list[str] = []

    def loads(data: Any) -> Any:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if data == body and caller.startswith("kilolined.") and not caller.startswith("kilolined.fakegpu"):
            seen.append(caller)
        return real(data)

    monkeypatch.setattr(orjson, "loads", loads)
    return seen


@pytest.mark.parametrize("affinity", ["prefix", "off"])
@pytest.mark.parametrize("stream", [False, True])
async def test_openai_body_is_parsed_once(fakegpus, gateway, http, monkeypatch, affinity, stream) -> None:
    fake = await fakegpus("openai", step_ms=1)
    cfg = base_config({"o": fake.url}, kind="openai", path="/v1", affinity=affinity)
    cfg["keys"]["alice"]["budget"] = {"tokens_per_day": 100_000}
    gw = await gateway(cfg)
    body = orjson.dumps({"model": "fake-llm", "max_tokens": 3, "stream": stream,
                         "messages": [{"role": "user", "content": "count my parses " * 64}]})
    seen = count_gateway_parses(monkeypatch, body)
    async with http.post(gw.url + "/v1/chat/completions", data=body,
                         headers={**auth(), "Content-Type": "application/json"}) as r:
        assert r.status == 200, await r.text()
        await r.read()
    assert len(seen) == 1, seen


async def test_bad_json_is_still_refused(gateway, fakegpus, http) -> None:
    fake = await fakegpus("openai", step_ms=1)
    gw = await gateway(base_config({"o": fake.url}, kind="openai", path="/v1", affinity="prefix"))
    async with http.post(gw.url + "/v1/chat/completions", data=b"{not json",
                         headers={**auth(), "Content-Type": "application/json"}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "bad_request"


def test_a_replaced_body_is_parsed_again() -> None:
    """A body swapped for other bytes is never answered from the old parse."""
    ex = Exchange(None, "POST", "/v1/chat/completions", b'{"stream": true}', "rid", "127.0.0.1")  # type: ignore[arg-type]
    assert ex.body_doc() == {"stream": True}
    ex.body = b'{"stream": false}'
    assert ex.body_doc() == {"stream": False}
    ex.body = b"not json"
    assert ex.body_doc() is None
